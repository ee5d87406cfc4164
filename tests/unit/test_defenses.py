"""What each similarity- and spectrum-based defense promises: DnC, SignGuard, clipped clustering, FoolsGold,
and centered clipping's adaptive radius. Each test plants Byzantine rows the rule is meant to catch and checks
the output against a float64 reference of the rule on the rows it must keep."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor

from fedrobust import aggregators
from fedrobust.aggregators.dnc import sample_columns
from fedrobust.aggregators.foolsgold import foolsgold_weights

N, F, D = 16, 4, 200


def planted(kind: str, *, n: int = N, f: int = F, d: int = D, seed: int = 0) -> tuple[Tensor, Tensor]:
    """``(x, honest)``: ``n - f`` honest float64 rows around a common positive direction, then ``f`` Byzantine
    rows of the given kind."""
    g = torch.Generator().manual_seed(seed)
    honest = 1.0 + 0.3 * torch.randn(n - f, d, generator=g, dtype=torch.float64)
    if kind == "sign_flip":
        byz = -honest[:f]  # same norms: only the direction gives them away
    elif kind == "scaled":
        byz = 100.0 * honest[:f]  # same signs and directions: only the norms give them away
    elif kind == "tiny":
        byz = 1e-3 * honest[:f]
    elif kind == "huge":
        byz = 1e4 * torch.randn(f, d, generator=g, dtype=torch.float64)
    elif kind == "collude":  # one point just outside the honest cloud, along a common direction
        byz = (honest.mean(0) + 3 * honest.std(0)).expand(f, d)
    else:
        raise AssertionError(kind)
    return torch.cat([honest, byz]), honest


def clipped_mean(rows: Tensor, threshold: Tensor | float) -> Tensor:
    """Mean of ``rows`` each clipped to norm ``threshold``."""
    norms = rows.norm(dim=1, keepdim=True)
    return (rows * torch.clamp(threshold / norms, max=1.0)).mean(0)


def spread(honest: Tensor) -> float:
    return float((honest - honest.mean(0)).norm(dim=1).max())


# --------------------------------------------------------------------------- DnC


@pytest.mark.parametrize("kind", ["collude", "sign_flip"])
def test_dnc_removes_a_planted_group(kind: str) -> None:
    x, honest = planted(kind)
    out = aggregators.build("dnc", f=F, sub_dim=50, niters=3)(x)
    # A group along one direction is the top singular direction: exactly the Byzantine rows are dropped in
    # every iteration, so the output is the honest mean.
    torch.testing.assert_close(out, honest.mean(0), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(x.mean(0), honest.mean(0), atol=1e-3)  # the plain mean is moved


def test_dnc_drops_huge_outliers_in_unrelated_directions() -> None:
    # Each subset's top direction follows one outlier, so some honest rows may be dropped with them; what
    # holds is that every outlier goes: the output is a mean of honest rows only.
    x, honest = planted("huge")
    out = aggregators.build("dnc", f=F, sub_dim=50, niters=3)(x)
    assert float((out - honest.mean(0)).norm()) < spread(honest)
    assert float((x.mean(0) - honest.mean(0)).norm()) > 1e3


def test_dnc_draws_new_coordinates_each_call_and_replays_them_from_the_seed() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 300, generator=g, dtype=torch.float64)
    agg = aggregators.build("dnc", f=2, sub_dim=3, niters=1, seed=5)
    outs = [agg(x) for _ in range(6)]
    assert any(not torch.equal(outs[0], out) for out in outs[1:])  # 3 of 300 coordinates: the subsets differ
    replay = aggregators.build("dnc", f=2, sub_dim=3, niters=1, seed=5)
    assert all(torch.equal(replay(x), out) for out in outs)


@pytest.mark.parametrize(("d", "k"), [(1000, 30), (1000, 200), (100, 40), (50, 80)])
def test_dnc_draws_a_uniform_subset_of_distinct_coordinates(d: int, k: int) -> None:
    g = torch.Generator().manual_seed(0)
    draws = [sample_columns(d, k, g) for _ in range(3000)]
    size = min(k, d)
    for cols in draws[:50]:
        assert cols.numel() == size and bool((cols[1:] > cols[:-1]).all()) and 0 <= int(cols[0]) <= int(cols[-1]) < d
    counts = torch.bincount(torch.cat(draws), minlength=d).to(torch.float64)
    expected = 3000 * size / d
    # Each coordinate is in a draw with probability k/d: the counts scatter as binomials around it (5 sd).
    sd = (3000 * (size / d) * (1 - size / d)) ** 0.5
    assert float((counts - expected).abs().max()) <= 5 * sd + 1e-9
    again = torch.Generator().manual_seed(0)
    assert all(torch.equal(sample_columns(d, k, again), cols) for cols in draws[:20])  # replays from the seed


def reference_dnc_drops(x: Tensor, f: int, c: float, sub_dim: int, niters: int, seed: int) -> Tensor:
    """How many of DnC's iterations drop each row, replaying the rule's coordinate draws."""
    g = torch.Generator().manual_seed(seed)
    dropped = torch.zeros(x.shape[0], dtype=torch.int64)
    for _ in range(niters):
        sub = x[:, sample_columns(x.shape[1], sub_dim, g)]
        centred = sub - sub.mean(0)
        top = torch.linalg.svd(centred, full_matrices=False).Vh[0]
        scores = (centred @ top) ** 2
        dropped[torch.sort(scores, descending=True, stable=True).indices[: int(c * f)]] += 1
    return dropped


def test_dnc_falls_back_when_the_iterations_drop_every_row() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 40, generator=g, dtype=torch.float64)
    # c * f = 4 of 5 rows dropped per iteration: one survivor per subset, different ones across subsets.
    dropped = reference_dnc_drops(x, f=2, c=2.0, sub_dim=2, niters=20, seed=0)
    assert (dropped > 0).all()  # no row survives every iteration: the fallback is taken
    out = aggregators.build("dnc", f=2, c=2.0, sub_dim=2, niters=20)(x)
    torch.testing.assert_close(out, x[dropped == dropped.min()].mean(0))


def test_dnc_after_nnm_scores_the_mixed_rows() -> None:
    # The rule sees the mixed rows: the same as running it on the rows NNM produces.
    x, _ = planted("collude", d=60)
    dist = torch.cdist(x, x) ** 2
    nearest = torch.sort(dist.fill_diagonal_(-1.0), dim=1, stable=True).indices[:, : N - F]
    nnm_rows = x[nearest].mean(dim=1)
    with_pre = aggregators.build("dnc", f=F, sub_dim=20, pre=[{"name": "nnm"}])(x)
    direct = aggregators.build("dnc", f=F, sub_dim=20)(nnm_rows)
    torch.testing.assert_close(with_pre, direct, rtol=1e-10, atol=1e-12)


def test_dnc_filter_drops_the_rows_dnc_drops_most_often_at_most_f() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(11, 80, generator=g, dtype=torch.float64)
    params = {"c": 1.5, "sub_dim": 7, "niters": 8, "seed": 2}  # floor(1.5 * 2) = 3 rows per subset
    dropped = reference_dnc_drops(x, f=2, **params)
    assert int((dropped > 0).sum()) > 2 and len(set(dropped.tolist())) > 2  # more rows than it may drop, ranked
    order = torch.sort(dropped, descending=True, stable=True).indices
    assert dropped[order[1]] > dropped[order[2]]  # the two dropped most often are clear: no tie to break
    keep = torch.ones(11, dtype=torch.bool)
    keep[order[:2]] = False
    agg = aggregators.build("mean", f=2, pre=[{"name": "dnc", **params}])
    torch.testing.assert_close(agg(x), x[keep].mean(0))
    assert agg.last_filtered == tuple(order[:2].sort().values.tolist())
    tight = x[:5]  # n = 2f + 1: nothing may go
    torch.testing.assert_close(aggregators.build("mean", f=2, pre=[{"name": "dnc", **params}])(tight), tight.mean(0))


@pytest.mark.parametrize("kind", ["collude", "sign_flip"])
def test_dnc_filter_in_front_of_the_default_leaves_the_planted_group_out(kind: str) -> None:
    x, honest = planted(kind)
    agg = aggregators.build("trimmed_mean", f=F, pre=[{"name": "dnc", "sub_dim": 50}, "winsorize", "nnm"])
    out = agg(x)
    assert agg.last_filtered == tuple(range(N - F, N))
    torch.testing.assert_close(out, aggregators.build("winsorize+nnm+trimmed_mean", f=F)(honest))


def test_dnc_filter_state_replays_its_draws_after_a_restart() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 300, generator=g, dtype=torch.float64)
    params = {"name": "dnc", "sub_dim": 3, "niters": 1, "seed": 5}
    first = aggregators.build("mean", f=2, pre=[params])
    first(x)
    saved = first.state_dict()
    later = [first(x) for _ in range(3)]
    resumed = aggregators.build("mean", f=2, pre=[params])
    resumed.load_state_dict(saved)
    assert all(torch.equal(resumed(x), out) for out in later)
    assert any(not torch.equal(later[0], out) for out in later[1:])  # the draws move on


# --------------------------------------------------------------------------- SignGuard


@pytest.mark.parametrize("kind", ["sign_flip", "scaled", "tiny", "huge"])
def test_signguard_rejects_the_planted_group(kind: str) -> None:
    x, honest = planted(kind)
    out = aggregators.build("signguard", f=F)(x)
    median = torch.quantile(x.norm(dim=1), 0.5)
    torch.testing.assert_close(out, clipped_mean(honest, median), rtol=1e-10, atol=1e-12)
    assert float((out - honest.mean(0)).norm()) < spread(honest)


def test_signguard_keeps_every_row_when_the_signs_do_not_split() -> None:
    # Balanced random signs: all sign fractions lie within a few 1/sqrt(d) of 1/2, closer than min_gap.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, 4000, generator=g, dtype=torch.float64)
    out = aggregators.build("signguard", f=2)(x)
    torch.testing.assert_close(out, clipped_mean(x, torch.quantile(x.norm(dim=1), 0.5)))
    # With min_gap=0 the 2-means split is always used, so some honest rows are dropped.
    split = aggregators.build("signguard", f=2, min_gap=0.0)(x)
    assert not torch.allclose(split, out)


# --------------------------------------------------------------------------- clipped clustering


def test_clipped_clustering_rejects_a_sign_flipped_group() -> None:
    x, honest = planted("sign_flip")
    out = aggregators.build("clipped_clustering", f=F)(x)
    median = torch.quantile(x.norm(dim=1), 0.5)
    torch.testing.assert_close(out, clipped_mean(honest, median), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["huge", "collude"])
def test_clipped_clustering_bounds_what_the_split_cannot_see(kind: str) -> None:
    # Unrelated huge rows may join the honest cluster (their cosines are all near 0) and a colluding point in
    # the honest direction always does; clipping to the median norm bounds their pull.
    x, honest = planted(kind)
    out = aggregators.build("clipped_clustering", f=F)(x)
    assert float((out - honest.mean(0)).norm()) < spread(honest)
    assert float((out - honest.mean(0)).norm()) < 0.2 * float((x.mean(0) - honest.mean(0)).norm())


def test_clipped_clustering_after_clipping_uses_the_clipped_rows() -> None:
    # A non-affine pre-aggregator: inner products must come from the clipped rows, not the inputs.
    x, _ = planted("sign_flip", d=50)
    x = x * torch.linspace(0.5, 3.0, N, dtype=torch.float64)[:, None]
    clip = {"name": "clipping", "threshold": 12.0}
    with_pre = aggregators.build("clipped_clustering", f=F, pre=[clip])(x)
    clipped = x * torch.clamp(12.0 / x.norm(dim=1, keepdim=True), max=1.0)
    direct = aggregators.build("clipped_clustering", f=F)(clipped)
    torch.testing.assert_close(with_pre, direct, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- FoolsGold


def reference_foolsgold(x: np.ndarray) -> np.ndarray:
    """FoolsGold's reference algorithm (Fung et al.'s published code), per round, as a weighted mean."""
    n = x.shape[0]
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    cs = unit @ unit.T - np.eye(n)
    maxcs = cs.max(axis=1)
    for i in range(n):
        for j in range(n):
            if i != j and maxcs[i] < maxcs[j]:
                cs[i, j] *= maxcs[i] / maxcs[j]
    wv = np.clip(1 - cs.max(axis=1), 0, 1)
    wv = wv / wv.max()
    wv[wv == 1] = 0.99
    wv = np.log(wv / (1 - wv)) + 0.5
    wv[np.isinf(wv) | (wv > 1)] = 1
    wv[wv < 0] = 0
    return wv @ x / wv.sum()


def sybil_round(seed: int = 0) -> tuple[Tensor, Tensor]:
    """Honest clients with different data (weakly aligned updates) and F sybils sending one shared update."""
    g = torch.Generator().manual_seed(seed)
    honest = 0.3 + torch.randn(N - F, D, generator=g, dtype=torch.float64)
    sybil = (-2.0 + 0.01 * torch.randn(D, generator=g, dtype=torch.float64)).expand(F, D)
    return torch.cat([honest, sybil + 1e-3 * torch.randn(F, D, generator=g, dtype=torch.float64)]), honest


def test_foolsgold_matches_the_reference_algorithm() -> None:
    x, _ = sybil_round(1)
    out = aggregators.build("foolsgold", f=F)(x)
    np.testing.assert_allclose(out.numpy(), reference_foolsgold(x.numpy()), rtol=1e-9, atol=1e-12)


def test_foolsgold_gives_sybils_no_weight() -> None:
    x, honest = sybil_round(2)
    unit = x / x.norm(dim=1, keepdim=True)
    weights = foolsgold_weights(unit @ unit.T)
    assert (weights[N - F :] == 0).all() and (weights[: N - F] > 0).all()
    out = aggregators.build("foolsgold", f=F)(x)
    torch.testing.assert_close(out, weights[: N - F] @ honest / weights.sum())
    # The sybils pull the plain mean far away; FoolsGold stays with the honest rows.
    assert float((out - honest.mean(0)).norm()) < 0.2 * float((x.mean(0) - honest.mean(0)).norm())


# --------------------------------------------------------------------------- centered clipping, adaptive radius


def reference_adaptive_cc(x: np.ndarray, center: np.ndarray, f: int, iterations: int) -> np.ndarray:
    v = center.copy()
    for _ in range(iterations):
        diff = x - v
        norms = np.linalg.norm(diff, axis=1, keepdims=True)
        radius = np.sort(norms[:, 0])[x.shape[0] - f - 1]
        v = v + (diff * np.minimum(1.0, radius / norms)).mean(axis=0)
    return v


def test_adaptive_radius_matches_reference_over_calls() -> None:
    rng = np.random.default_rng(4)
    agg = aggregators.build("centered_clipping", f=2, tau="auto", iterations=3)
    center = np.zeros(30)
    for _ in range(3):
        x = rng.standard_normal((9, 30)) + 2.0
        x[:2] *= 50.0
        center = reference_adaptive_cc(x, center, 2, 3)
        np.testing.assert_allclose(agg(torch.from_numpy(x)).numpy(), center, rtol=1e-10, atol=1e-12)


def test_adaptive_radius_clips_an_outlier_a_fixed_tau_lets_through() -> None:
    # Small honest updates (norm ~0.1) and one outlier at distance 8: inside tau=10, far outside their spread.
    g = torch.Generator().manual_seed(5)
    honest = 0.01 + 0.01 * torch.randn(9, 50, generator=g, dtype=torch.float64)
    direction = torch.randn(50, generator=g, dtype=torch.float64)
    outlier = honest.mean(0) + 8.0 * direction / direction.norm()
    x = torch.cat([honest, outlier[None]])
    fixed = aggregators.build("centered_clipping", f=1, tau=10.0)(x)
    auto = aggregators.build("centered_clipping", f=1, tau="auto")(x)
    torch.testing.assert_close(fixed, x.mean(0))  # nothing clipped: the outlier moves the center by 8/n
    assert float((fixed - honest.mean(0)).norm()) > 0.7
    assert float((auto - honest.mean(0)).norm()) < 0.02


def test_radius_quantile_one_clips_nothing() -> None:
    x = torch.randn(7, 20, dtype=torch.float64)
    agg = aggregators.build("centered_clipping", f=1, tau="auto", radius_quantile=1.0)
    torch.testing.assert_close(agg(x), x.mean(0))
    # A lower quantile clips: the center moves less than the mean does.
    low = aggregators.build("centered_clipping", f=1, tau="auto", radius_quantile=0.3)(x)
    assert float(low.norm()) < float(x.mean(0).norm())


def test_winsorize_clamps_each_coordinate_to_what_a_trimmed_mean_keeps() -> None:
    """Every value beyond the f+1-th smallest or largest of its coordinate is pulled in to it. So NNM can no longer
    spread a few rows' outlying coordinates into the rows that trimming keeps: a backdoor's, whose trigger pixels
    are blank in honest data (honest clients leave those weights exactly unchanged) while its rows stay close to
    the honest ones overall."""
    g = torch.Generator().manual_seed(5)
    x = 0.01 * torch.randn(N, D, generator=g, dtype=torch.float64)
    trigger = [3, 77, 150]
    x[:, trigger] = 0.0
    x[-F:, trigger] = 0.05  # f rows, near the honest ones (NNM's neighbours), move the trigger weights
    low, high = x.sort(dim=0).values[F], x.sort(dim=0).values[N - F - 1]
    clamped = torch.minimum(torch.maximum(x, low), high)
    mean_after = aggregators.build("mean", f=F, pre=("winsorize",))
    torch.testing.assert_close(mean_after(x), clamped.mean(dim=0))
    assert torch.equal(clamped[:, trigger], torch.zeros(N, 3, dtype=torch.float64))
    # The trimmed mean alone drops them; NNM in front spreads them into every row it keeps, winsorizing stops that.
    assert torch.equal(aggregators.build("trimmed_mean", f=F)(x)[trigger], torch.zeros(3, dtype=torch.float64))
    assert aggregators.build("trimmed_mean", f=F, pre=("nnm",))(x)[trigger].min() > 0.003
    held = aggregators.build("trimmed_mean", f=F, pre=("winsorize", "nnm"))(x)[trigger]
    assert torch.equal(held, torch.zeros(3, dtype=torch.float64))
    # f = 0: nothing to clamp, the rows pass unchanged.
    torch.testing.assert_close(aggregators.build("mean", f=0, pre=("winsorize",))(x), x.mean(dim=0))


@pytest.mark.parametrize(
    "rest",
    ["mean", "krum", "multikrum", "geometric_median", "trimmed_mean", "median", "centered_clipping", "dnc",
     "nnm+trimmed_mean", "nnm+krum", "bucketing+mean", "winsorize+trimmed_mean", "clipped_clustering", "signguard"],
)
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_winsorize_in_front_reads_the_rows_clamped_without_copying_them(
    rest: str, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Winsorizing the input rows keeps no copy: later stages read them clamped. Every stage after it must see
    exactly the rows an explicit clamp writes, whatever it reads (order statistics, Gram matrix, one selected
    row, sampled columns), on the CPU kernels and on the torch path of other devices."""
    if backend == "torch":
        monkeypatch.setenv("FEDROBUST_NUMBA", "0")
    g = torch.Generator().manual_seed(11)
    x = torch.randn(N, D, generator=g)
    x[-F:] += 3.0 * torch.randn(F, D, generator=g)  # outliers for the clamp to catch
    low, high = x.sort(dim=0).values[F], x.sort(dim=0).values[N - F - 1]
    clamped = torch.minimum(torch.maximum(x, low), high)
    rest_pre, rest_rule = aggregators.split_pipeline(rest)
    # As a pre list: a pipeline name may not repeat a stage, and winsorize+winsorize+... is tested here.
    lazy = aggregators.build(rest_rule, f=F, pre=["winsorize", *rest_pre])(x)
    explicit = aggregators.build(rest, f=F)(clamped)
    torch.testing.assert_close(lazy, explicit, rtol=1e-5, atol=1e-6)
    assert not torch.equal(x, clamped)  # the input itself is left as it was


def test_winsorize_after_a_mixing_stage_clamps_the_mixed_rows() -> None:
    g = torch.Generator().manual_seed(12)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    rows_after_nnm = _nnm_rows(x, F)
    low, high = rows_after_nnm.sort(dim=0).values[F], rows_after_nnm.sort(dim=0).values[N - F - 1]
    clamped = torch.minimum(torch.maximum(rows_after_nnm, low), high)
    out = aggregators.build("nnm+winsorize+mean", f=F)(x)
    torch.testing.assert_close(out, clamped.mean(dim=0))


def _nnm_rows(x: torch.Tensor, f: int) -> torch.Tensor:
    """NNM by its definition: each row replaced by the mean of its n - f nearest rows (itself included)."""
    dist = torch.cdist(x, x)
    nearest = dist.argsort(dim=1)[:, : x.shape[0] - f]
    return x[nearest].mean(dim=1)


# --------------------------------------------------------------------------- direction filter


def reference_direction_keep(x: Tensor, f: int, z: float = 3.0) -> Tensor:
    """The rows the direction filter keeps, by its definition, computed on the rows themselves."""
    n = x.shape[0]
    budget = min(f, n - max(n - f, 2 * f + 1))
    inner = x @ x.T
    scores = []
    for i in range(n):
        others = torch.sort(torch.cat([inner[i, :i], inner[i, i + 1 :]])).values
        trim = min(f, (n - 2) // 2)
        scores.append(others[trim : n - 1 - trim].mean() / x[i].norm())
    score = torch.stack(scores)
    center = score.sort().values[(n - 1) // 2]
    spread = 1.4826 * (score - center).abs().median()
    order = torch.sort(score, stable=True).indices
    outlying = [int(i) for i in order if score[i] <= 0 and score[i] < center - z * spread][:budget]
    return torch.tensor([i for i in range(n) if i not in outlying])


def test_direction_drops_the_sign_flipped_rows_and_unbiases_the_trimmed_mean() -> None:
    x, honest = planted("sign_flip")
    torch.testing.assert_close(aggregators.build("direction+mean", f=F)(x), honest.mean(0))
    # Alone, the trimmed mean drops the f flipped values of each coordinate and the f largest honest ones:
    # it lands below the honest values' mean. With the flipped rows gone it trims honest values on both sides.
    alone = (aggregators.build("trimmed_mean", f=F)(x) - honest.mean(0)).norm()
    after = (aggregators.build("direction+trimmed_mean", f=F)(x) - honest.mean(0)).norm()
    assert float(after) < 0.5 * float(alone)


@pytest.mark.parametrize("kind", ["scaled", "collude"])
def test_direction_keeps_rows_that_point_the_same_way(kind: str) -> None:
    """Rows along the honest direction are another rule's job (norms, distances): the filter keeps every row."""
    x, _ = planted(kind)
    torch.testing.assert_close(aggregators.build("direction+mean", f=F)(x), x.mean(0))


@pytest.mark.parametrize("seed", range(6))
def test_direction_drops_what_its_definition_drops(seed: int) -> None:
    """Honest rows around a common direction and a few reversed rows, sometimes more than f: the rows kept are
    those of a plain computation of the scores and of the outlier rule."""
    g = torch.Generator().manual_seed(seed)
    n, f, d = 20, 4, 300
    x = 0.5 + torch.randn(n, d, generator=g, dtype=torch.float64)
    flipped = int(torch.randint(0, f + 2, (1,), generator=g))  # sometimes more than f
    x[:flipped] = -(0.2 + 0.5 * torch.rand(flipped, 1, generator=g, dtype=torch.float64)) * x[-flipped - 1 : -1]
    keep = reference_direction_keep(x, f)
    assert n - f <= keep.numel() <= n
    if flipped:
        assert keep.numel() < n  # the reversed rows are caught
    torch.testing.assert_close(aggregators.build("direction+mean", f=f)(x), x[keep].mean(0))


def test_direction_keeps_an_honest_majority_and_passes_f_zero() -> None:
    x, honest = planted("sign_flip", n=2 * F + 3)  # room to drop 2 of the f = 4 flipped rows, not more
    keep = reference_direction_keep(x, F)
    assert keep.numel() == 2 * F + 1
    torch.testing.assert_close(aggregators.build("direction+mean", f=F)(x), x[keep].mean(0))
    tight, _ = planted("sign_flip", n=2 * F + 1)
    torch.testing.assert_close(aggregators.build("direction+mean", f=F)(tight), tight.mean(0))
    torch.testing.assert_close(aggregators.build("direction+mean", f=0)(x), x.mean(0))


def test_direction_then_winsorize_clamps_the_rows_it_kept() -> None:
    x, honest = planted("sign_flip")
    out = aggregators.build("direction+winsorize+nnm+trimmed_mean", f=F)(x)
    torch.testing.assert_close(out, aggregators.build("winsorize+nnm+trimmed_mean", f=F)(honest))


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("multikrum", {}),
        ("dnc", {"sub_dim": 50, "niters": 3}),
        ("signguard", {}),
        ("clipped_clustering", {}),
        ("fltrust", {}),
    ],
)
def test_rules_that_select_rows_name_the_rows_they_gave_no_weight(name: str, params: dict[str, object]) -> None:
    x, honest = planted("sign_flip")
    agg = aggregators.build(name, f=F, **params)
    if agg.needs_server_update:
        agg.set_server_update(honest.mean(0))
    agg(x)
    assert agg.last_excluded == tuple(range(N - F, N))  # exactly the flipped rows
    assert agg.last_filtered == ()


def test_what_the_selecting_rules_exclude_carries_no_weight() -> None:
    x, honest = planted("sign_flip", n=19)
    krum = aggregators.build("krum", f=F)
    out = krum(x)
    (chosen,) = set(range(19)) - set(krum.last_excluded)
    torch.testing.assert_close(out, x[chosen])
    multikrum = aggregators.build("multikrum", f=F)
    out = multikrum(x)
    kept = [i for i in range(19) if i not in multikrum.last_excluded]
    assert len(kept) == 19 - F
    torch.testing.assert_close(out, x[kept].mean(0))
    bulyan = aggregators.build("bulyan", f=F)
    bulyan(x)
    assert len(bulyan.last_excluded) == 2 * F  # it selects n - 2f rows, then trims each coordinate
    sybils, _ = planted("collude", n=19)  # f identical rows
    foolsgold = aggregators.build("foolsgold", f=F)
    foolsgold(sybils)
    assert foolsgold.last_excluded == tuple(range(19 - F, 19))
    for coordinatewise in ("mean", "median", "trimmed_mean", "geometric_median", "centered_clipping"):
        rule = aggregators.build(coordinatewise, f=F)
        rule(x)
        assert rule.last_excluded == ()


def test_the_pipeline_names_rule_exclusions_by_input_row() -> None:
    x, honest = planted("sign_flip")
    agg = aggregators.build("direction+multikrum", f=F)
    out = agg(x)
    assert agg.last_filtered == tuple(range(N - F, N))
    # Multi-Krum then leaves out f more of the rows the filter kept, named by their input row.
    assert len(agg.last_excluded) == F and set(agg.last_excluded) < set(range(N - F))
    left = [i for i in range(N) if i not in agg.last_filtered + agg.last_excluded]
    torch.testing.assert_close(out, x[left].mean(0))
    mixed = aggregators.build("nnm+multikrum", f=F)
    mixed(x)
    assert mixed.last_excluded == ()  # a mixed row stands for no one input row


def test_the_pipeline_names_the_input_rows_the_filter_dropped() -> None:
    x, honest = planted("sign_flip")  # the flipped rows are the last f
    flipped = tuple(range(N - F, N))
    agg = aggregators.build("direction+winsorize+nnm+trimmed_mean", f=F)
    agg(x)
    assert agg.last_filtered == flipped
    agg(honest)  # nothing to drop: the report is of the last call only
    assert agg.last_filtered == ()
    # After a stage that mixes rows, a dropped row is no input row: nothing is named. Here the filter drops
    # a bucket (seed 0's buckets of two), which stands for two input rows.
    few, _ = planted("sign_flip", f=2)
    buckets = [{"name": "bucketing", "s": 2, "seed": 0}]
    mixed_first = aggregators.build("mean", f=2, pre=[*buckets, "direction"])
    assert not torch.equal(mixed_first(few), aggregators.build("mean", f=2, pre=buckets)(few))  # it dropped one
    assert mixed_first.last_filtered == ()
