"""FLTrust: trust scores from the server's own update, rows rescaled to its norm.

The rule is checked against a float64 NumPy transcription of the paper's aggregate, and on planted rounds for
what it promises: sign-flipped rows get trust 0 (the output is then FLTrust of the honest rows alone), a boosted
row gains nothing from its size, and a round where nobody agrees with the server does not move the model.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import Tensor

from fedrobust import aggregators, attacks

N, F, D = 12, 4, 150


def reference_fltrust(x: np.ndarray, g0: np.ndarray) -> np.ndarray:
    """Cao et al. 2021, Algorithm 1's aggregation step, in float64."""
    g0_norm = np.linalg.norm(g0)
    out, total = np.zeros_like(g0), 0.0
    for row in x:
        norm = np.linalg.norm(row)
        trust = max(0.0, float(row @ g0) / (norm * g0_norm)) if norm > 0 and g0_norm > 0 else 0.0
        if trust > 0:
            out += trust * (g0_norm / norm) * row
            total += trust
    return out / total if total > 0 else out


def fltrust(x: Tensor, g0: Tensor, **params) -> Tensor:
    agg = aggregators.build("fltrust", f=F, **params)
    agg.set_server_update(g0)
    return agg(x)


def honest_round(seed: int = 0) -> tuple[Tensor, Tensor]:
    """``(honest, g0)``: honest float64 rows around a common direction, and the server's update near it."""
    g = torch.Generator().manual_seed(seed)
    direction = torch.randn(D, generator=g, dtype=torch.float64)
    honest = direction + 0.8 * torch.randn(N - F, D, generator=g, dtype=torch.float64)
    g0 = 0.5 * (direction + 0.8 * torch.randn(D, generator=g, dtype=torch.float64))
    return honest, g0


@pytest.mark.parametrize("seed", range(4))
def test_matches_the_reference(seed: int) -> None:
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(N, D, generator=g, dtype=torch.float64) * torch.rand(N, 1, generator=g, dtype=torch.float64) * 5
    x[3] = 0.0  # a zero row: trust 0
    g0 = torch.randn(D, generator=g, dtype=torch.float64) + x[:4].mean(0)
    expected = reference_fltrust(x.numpy(), g0.numpy())
    np.testing.assert_allclose(fltrust(x, g0).numpy(), expected, rtol=1e-9, atol=1e-12)
    # float32 rows: the same up to float32 rounding
    np.testing.assert_allclose(fltrust(x.float(), g0.float()).numpy(), expected, rtol=2e-4, atol=2e-5)


def test_sign_flipped_rows_get_trust_zero_and_the_output_is_the_honest_rows_aggregate() -> None:
    honest, g0 = honest_round()
    x = torch.cat([honest, -3.0 * honest[:F]])
    agg = aggregators.build("fltrust", f=F)
    agg.set_server_update(g0)
    out = agg(x)
    trust = agg.rule.last_trust
    assert trust is not None
    assert bool((trust[: N - F] > 0.2).all()), trust  # honest rows agree with the server
    assert bool((trust[N - F :] == 0).all()), trust  # flipped rows point away from it
    torch.testing.assert_close(out, fltrust(honest, g0), rtol=1e-12, atol=1e-12)
    # The plain mean is dragged back by the flipped rows; FLTrust's output is an average of rows rescaled to
    # the server update's norm, so it is never longer than that.
    assert float(out @ g0) > 0 and float(x.mean(0) @ g0) < float(honest.mean(0) @ g0) / 2
    assert float(out.norm()) <= float(g0.norm()) * (1 + 1e-12)


def test_a_boosted_row_gains_nothing_from_its_size() -> None:
    honest, g0 = honest_round(1)
    planted = honest[0] + 2.0 * g0  # agrees with the server, so it is trusted
    unboosted = fltrust(torch.cat([honest, planted[None]]), g0)
    boosted = fltrust(torch.cat([honest, 1000.0 * planted[None]]), g0)
    torch.testing.assert_close(boosted, unboosted, rtol=1e-9, atol=1e-12)
    # The mean is taken over by the boosted row.
    assert float(torch.cat([honest, 1000.0 * planted[None]]).mean(0).norm()) > 50 * float(unboosted.norm())


def test_no_row_agreeing_with_the_server_gives_the_zero_update() -> None:
    honest, g0 = honest_round(2)
    out = fltrust(-honest, g0 * 0 + honest.mean(0))
    assert out.shape == (D,) and bool((out == 0).all())
    assert bool((fltrust(honest, torch.zeros(D, dtype=torch.float64)) == 0).all())  # a zero server update


def test_the_server_update_is_required_used_once_and_checked() -> None:
    honest, g0 = honest_round(3)
    agg = aggregators.build("fltrust", f=F)
    assert agg.needs_server_update and agg.min_n() == 1
    with pytest.raises(ValueError, match=rf"fltrust: no server update .*n={N - F}, f={F}.*requires set_server"):
        agg(honest)
    agg.set_server_update(g0)
    agg(honest)
    with pytest.raises(ValueError, match="no server update"):  # not reused in the next round
        agg(honest)
    agg.set_server_update(g0[:-1])
    with pytest.raises(ValueError, match=rf"fltrust: the server update has {D - 1} coordinates .*d={D}"):
        agg(honest)
    bad = g0.clone()
    bad[5] = float("nan")
    agg.set_server_update(bad)
    with pytest.raises(ValueError, match="fltrust: the server update contains non-finite"):
        agg(honest)
    with pytest.raises(ValueError, match="fltrust: the server update must be a 1-D float tensor"):
        agg.set_server_update(g0[None])
    with pytest.raises(ValueError, match="krum: this rule takes no server update"):
        aggregators.build("krum", f=1).set_server_update(g0)


def test_after_a_pre_aggregator_it_scores_the_mixed_rows() -> None:
    honest, g0 = honest_round(4)
    x = torch.cat([honest, -honest[:F]])
    agg = aggregators.build("fltrust", f=F, pre=["nnm"])
    agg.set_server_update(g0)
    out = agg(x)
    # NNM replaces each row by the mean of its n - f nearest rows; FLTrust then scores those.
    dist = torch.cdist(x, x)
    near = dist.argsort(dim=1)[:, : N - F]
    rows = torch.stack([x[i].mean(0) for i in near])
    np.testing.assert_allclose(out.numpy(), reference_fltrust(rows.numpy(), g0.numpy()), rtol=1e-9, atol=1e-12)


TUNED = ["optimal_alie", "optimal_ipm", "optimal_fang", "optimal_mix", "optimal_search"]


def tuned_rows(name: str, honest: Tensor, g0: Tensor | None, **params) -> Tensor:
    """The rows of tuned attack ``name`` against FLTrust, given the server update ``g0`` of the round."""
    rows, byzantine = torch.cat([honest, honest[:F]]), torch.arange(N) >= N - F
    attack = attacks.build(name, rule="fltrust", **params)
    return attack.craft_round(rows, byzantine, list(range(N)), generator=torch.Generator().manual_seed(0),
                              server_update=g0)


def shift(honest: Tensor, g0: Tensor, byzantine: Tensor) -> float:
    """The tuned attacks' objective: how far FLTrust's output lands from the honest rows' mean."""
    return float((fltrust(torch.cat([honest, byzantine.to(honest.dtype)]), g0) - honest.mean(0)).norm())


@pytest.mark.parametrize("name", TUNED)
def test_tuned_attacks_search_against_fltrust_with_the_round_s_server_update(name: str) -> None:
    honest, g0 = honest_round(1)
    assert attacks.build(name, rule="fltrust").needs_server_update and not attacks.build(name).needs_server_update
    crafted = tuned_rows(name, honest, g0)
    assert crafted.shape == (F, D) and bool((crafted == crafted[0]).all())
    # Following the server's (stateless) FLTrust round by round finds the same rows.
    torch.testing.assert_close(tuned_rows(name, honest, g0, memory=True), crafted, rtol=0, atol=0)
    honest_only = shift(honest, g0, honest[:0])
    if name == "optimal_ipm":  # -eps * mean points away from g0 for every eps > 0: trust 0, nothing to gain
        assert shift(honest, g0, crafted) == pytest.approx(honest_only, rel=1e-12)
        return
    # FLTrust trusts the rows (a row it scores 0 leaves it where the honest rows put it), and they move it.
    assert float(torch.nn.functional.cosine_similarity(crafted[0], g0, dim=0)) > 0
    assert shift(honest, g0, crafted) > 1.05 * honest_only
    # The search ran FLTrust with this g0: its rows beat those tuned with another server update (the honest
    # rows' mean, then a turned one), scored with this g0.
    turned = g0 + 2.0 * torch.randn(D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    for other in (honest.mean(0), turned):
        assert shift(honest, g0, crafted) >= shift(honest, g0, tuned_rows(name, honest, other)) - 1e-12
    assert not torch.equal(crafted, tuned_rows(name, honest, turned))


def test_tuned_attacks_against_fltrust_need_the_server_update() -> None:
    honest, g0 = honest_round()
    attack = attacks.build("optimal_alie", rule="fltrust")
    with pytest.raises(ValueError, match="optimal_alie.*needs the server's own update.*aggregator=fltrust"):
        attack.craft(honest, f=F, generator=torch.Generator())
    for memory in (False, True):
        with pytest.raises(ValueError, match="optimal_alie.*needs the server's own update"):
            tuned_rows("optimal_alie", honest, None, memory=memory)
        with pytest.raises(ValueError, match=rf"optimal_alie.*server update has shape \({D - 1},\).*d={D}"):
            tuned_rows("optimal_alie", honest, g0[:-1], memory=memory)


def changing_direction(honest: Tensor, g0: Tensor, direction: str) -> Tensor:
    before = fltrust(honest, g0)
    return torch.sign(before) if direction == "sign" else before


def adaptive_move(honest: Tensor, g0: Tensor, byzantine: Tensor, direction: str = "sign") -> float:
    """How far ``byzantine`` rows move FLTrust's output against its changing direction: ``s . (g - g')``."""
    before = fltrust(honest, g0)
    after = fltrust(torch.cat([honest, byzantine.to(honest.dtype)]), g0)
    return float(changing_direction(honest, g0, direction) @ (before - after))


def in_plane(g0: Tensor, s: Tensor, rho: float) -> Tensor:
    """``||g0|| (rho u + sqrt(1 - rho^2) w)``: the unit ``u`` along g0, ``w`` opposite to s across it."""
    u = g0 / g0.norm()
    across = s - (s @ u) * u
    w = -across / across.norm()
    return g0.norm() * (rho * u + math.sqrt(1 - rho * rho) * w)


@pytest.mark.parametrize("direction", ["sign", "update"])
@pytest.mark.parametrize("seed", range(3))
def test_adaptive_attack_is_trusted_and_beats_every_other_row_it_could_send(seed: int, direction: str) -> None:
    honest, g0 = honest_round(seed)
    attack = attacks.build("fltrust_adaptive", direction=direction)
    byz = attack.against(honest, g0, f=F)
    assert byz.shape == (F, D) and bool((byz == byz[0]).all())
    torch.testing.assert_close(byz[0].norm(), g0.norm())  # FLTrust rescales to ||g0|| anyway
    rho = float(torch.nn.functional.cosine_similarity(byz[0], g0, dim=0))
    assert 0 < rho < 1  # trusted, and turned away from the server's direction
    move = adaptive_move(honest, g0, byz, direction)
    s = changing_direction(honest, g0, direction)
    assert move > 0.05 * float(s.abs() @ fltrust(honest, g0).abs())  # a real move: 5% of s . g
    # Every turn in the plane, on a grid five times finer than the attack's: none moves FLTrust farther.
    turns = [in_plane(g0, s, r / 5000)[None].repeat(F, 1) for r in range(1, 5001, 7)]
    assert move >= max(adaptive_move(honest, g0, t, direction) for t in turns) * (1 - 1e-6)
    # Nor does any trusted row off that plane, nor the rows that reverse the update (trust 0: no move).
    g = torch.Generator().manual_seed(100 + seed)
    for _ in range(50):
        e = torch.randn(D, generator=g, dtype=torch.float64)
        e = e if e @ g0 > 0 else -e
        assert adaptive_move(honest, g0, (g0.norm() * e / e.norm())[None].repeat(F, 1), direction) < move
    assert adaptive_move(honest, g0, -4.0 * honest[:F], direction) == pytest.approx(0.0, abs=1e-9)
    if direction == "update":  # another objective, another row
        assert not torch.equal(byz, attacks.build("fltrust_adaptive").against(honest, g0, f=F))


def test_adaptive_attack_needs_the_server_update() -> None:
    honest, g0 = honest_round()
    attack = attacks.build("fltrust_adaptive")
    rows, byzantine = torch.cat([honest, honest[:F]]), torch.arange(N) >= N - F
    crafted = attack.craft_round(rows, byzantine, list(range(N)), generator=torch.Generator(), server_update=g0)
    assert torch.equal(crafted, attack.against(honest, g0, f=F))
    with pytest.raises(ValueError, match="fltrust_adaptive.*needs the server's own update.*aggregator=fltrust"):
        attack.craft_round(rows, byzantine, list(range(N)), generator=torch.Generator())
    assert bool((attack.against(honest, 0 * g0, f=F) == 0).all())  # g0 = 0: FLTrust trusts nothing


def test_a_config_with_the_adaptive_attack_and_a_rule_without_server_update_is_refused() -> None:
    from fedrobust.config import ConfigError, from_flat
    from fedrobust.run_setup import validate

    cfg = {"attack.name": "fltrust_adaptive", "num_byzantine": 2}
    validate(from_flat({**cfg, "aggregator.name": "fltrust"}))
    with pytest.raises(ConfigError, match="attack.name=fltrust_adaptive: needs the server's own update .*"
                                          "median does not compute.*aggregator=fltrust"):
        validate(from_flat({**cfg, "aggregator.name": "nnm+median"}))
    # A tuned attack needs the server update only where it is tuned to FLTrust (its rule: the server's).
    tuned = {"attack.name": "optimal_alie", "num_byzantine": 2}
    validate(from_flat({**tuned, "aggregator.name": "fltrust", "attack.params": {"rule": "fltrust"}}))
    validate(from_flat({**tuned, "aggregator.name": "median", "attack.params": {"rule": "median"}}))
    with pytest.raises(ConfigError, match="attack.name=optimal_alie: needs the server's own update .*"
                                          "median does not compute.*aggregator=fltrust"):
        validate(from_flat({**tuned, "aggregator.name": "median", "attack.params": {"rule": "fltrust"}}))


# --------------------------------------------------------------------------- the server's side


def test_the_strategy_refuses_fltrust_without_a_server_update_fn() -> None:
    from fedrobust.strategies.robust_strategy import RobustStrategy

    with pytest.raises(ValueError, match="fltrust needs the server's own update each round: pass server_update_fn"):
        RobustStrategy(aggregator="fltrust", num_byzantine=1, progress=False)


def test_root_data_set_is_a_seeded_sample_of_the_training_split() -> None:
    from fedrobust import components
    from fedrobust.config import from_flat
    from fedrobust.strategies.evaluation import root_data_set

    cfg = from_flat({"aggregator.name": "fltrust", "aggregator.root_size": 50, "partition.name": "dirichlet"})
    root = root_data_set(cfg)
    assert len(root) == 50
    assert all(torch.equal(a, b) for a, b in zip(root.tensors, root_data_set(cfg).tensors, strict=True))
    other = root_data_set(from_flat({"aggregator.root_size": 50, "seed": 1}))
    assert not torch.equal(other.tensors[0], root.tensors[0])
    # Drawn from the union of the clients' partitions (whatever the partitioner), never from the test set.
    train = torch.cat([components.load_partition(cfg, p, cfg.num_clients).tensors[0] for p in range(cfg.num_clients)])
    test = components.load_test_set(cfg).tensors[0]
    in_train = (torch.cdist(root.tensors[0], train) == 0).any(dim=1)
    in_test = (torch.cdist(root.tensors[0], test) == 0).any(dim=1)
    assert bool(in_train.all()) and int(in_test.sum()) <= 1  # digits has a few duplicate images across splits


def test_server_update_is_trained_from_the_round_s_global_model_and_seeded() -> None:
    from fedrobust.config import from_flat
    from fedrobust.strategies.evaluation import build_global_model, server_update_fn

    cfg = from_flat({"aggregator.name": "fltrust", "aggregator.root_size": 40})
    global_state = {k: v.clone() for k, v in build_global_model(cfg).state_dict().items()}
    before = {k: v.clone() for k, v in global_state.items()}
    first = server_update_fn(cfg)(1, global_state)
    assert set(first) == set(global_state)
    assert all(torch.equal(global_state[k], before[k]) for k in before)  # the global model is not touched
    assert float(torch.cat([v.flatten() for v in first.values()]).norm()) > 0
    again = server_update_fn(cfg)(1, global_state)
    assert all(torch.equal(first[k], again[k]) for k in first)  # same seed, same round: same bytes
    next_round = server_update_fn(cfg)(2, global_state)
    assert not all(torch.equal(first[k], next_round[k]) for k in first)  # batch order seeded by round


@pytest.mark.parametrize("rule", ["mean", "fltrust"])
def test_fltrust_run_keeps_learning_under_boosted_sign_flips(rule: str, tmp_path) -> None:
    """6 clients, 2 flip their update and multiply it by 4 (in-process transport, production server and
    ClientApp): the plain mean is driven off, FLTrust gives the flipped rows trust 0 and learns."""
    from experiments.inprocess import run_inprocess
    from fedrobust.config import from_flat

    cfg = from_flat({
        "num_clients": 6, "clients_per_round": 6, "num_byzantine": 2, "num_rounds": 3,
        "aggregator.name": rule, "attack.name": "sign_flip",
        **({"aggregator.root_size": 60} if rule == "fltrust" else {}),  # the root set: FLTrust's only
        "attack.params": {"scale": 4.0}, "liveness.quarantine_after": 0,
        "client.local_epochs": 2,  # the setting the bounds below were measured in
    })
    rows = run_inprocess(cfg, tmp_path, echo=False)
    accuracy = rows[-1]["accuracy"]
    assert len(rows) == 3
    if rule == "fltrust":
        assert all(r["accepted"] == 6 for r in rows) and accuracy > 0.8, rows
    else:  # (validation rejects some of the boosted rows for their norm; the others still win)
        assert accuracy < 0.5, rows
