"""Contract suite for fedrobust.attacks: every registered attack is checked against the same properties,
plus the attack-specific guarantees each one documents (ALIE's small deviation, min-max / min-sum's distance
bounds, stale replay, ...)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from fedrobust import aggregators, attacks
from fedrobust.attacks import Attack
from fedrobust.attacks.optimal import maximize_scale

H, F = 16, 4  # honest and Byzantine clients of the reference round (n = 20)
NOISE = 0.5  # per-coordinate spread of honest updates around their non-zero mean

# A model-like update: several float dtypes and an integer counter (BatchNorm's num_batches_tracked).
TEMPLATE: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "conv.weight": ((4, 3), torch.float32),
    "conv.bias": ((3,), torch.float32),
    "head.weight": ((5,), torch.float16),
    "head.bias": ((2, 2), torch.float64),
    "bn.num_batches_tracked": ((), torch.int64),
}
FLOAT_KEYS = [k for k, (_, dt) in TEMPLATE.items() if dt.is_floating_point]
D = sum(math.prod(shape) for k, (shape, _) in TEMPLATE.items() if k in FLOAT_KEYS)

CLIENT = attacks.client_names()
OMNISCIENT = attacks.omniscient_names()
# Client attacks that act on the update itself (the others act on data or on the reported weight).
UPDATE_ATTACKS = [name for name in CLIENT if name not in ("label_flip", "lying_weight", "malformed", "backdoor")]

# Non-default settings that take other code paths, checked by the generic tests besides each default build.
VARIANTS: list[tuple[str, dict[str, object]]] = [
    ("nan", {"fraction": 0.3}),
    ("inf", {"fraction": 0.3}),
    ("malformed", {"mode": "dtype"}),
    ("malformed", {"mode": "keys"}),
    ("stale", {"capture_round": 1}),
    ("alie", {"z": 1.5}),
    ("mimic", {"target": 2}),
    ("mimic", {"noise": 0.5}),
    ("sign_flip", {"start_round": 2}),
    ("sign_flip", {"start_round": 2, "turn_rounds": 3}),
    ("min_max", {"perturbation": "unit_vec"}),
    ("min_sum", {"perturbation": "sign"}),
    ("fang_trimmed_mean", {"b": 4.0}),
    ("fang_trimmed_mean", {"space": "model"}),
    ("optimal_alie", {"rule": "krum", "grid": 5, "refine": 3}),
    ("optimal_ipm", {"rule": "centered_clipping", "rule_f": 2, "rule_params": {"tau": "auto"}}),
    ("optimal_fang", {"rule": "median", "max_scale": 3.0, "grid": 4, "refine": 2}),
    ("optimal_mix", {"rule": "trimmed_mean", "grid": 3, "refine": 1}),
    ("optimal_search", {"rule": "median", "grid": 3, "refine": 1, "directions": 2, "local": 2, "components": 1}),
    ("fltrust_adaptive", {"direction": "update", "steps": 50}),
    ("rop", {"rule": "centered_clipping", "rule_params": {"tau": "auto"}, "location": 0.0, "angle": 60.0, "grid": 4,
             "refine": 2}),
    ("backdoor", {"boost": 5.0, "value": 3.0, "target": 3}),
]
CONFIGS = [(name, {}) for name in attacks.names()] + VARIANTS
CLIENT_CONFIGS = [(name, params) for name, params in CONFIGS if name in CLIENT]

# One invalid value per parameter of every attack (a test checks that none is missing).
INVALID: dict[str, list[tuple[str, object]]] = {
    "fltrust_adaptive": [("steps", 0), ("steps", 1.5), ("steps", True), ("direction", "both")],
    "rop": [
        ("rule", "clipping"), ("rule_f", -1), ("rule_params", 1), ("rule_pre_params", [1]), ("max_scale", 0.0),
        ("grid", 1), ("refine", -1), ("memory", "yes"), ("location", 1.5), ("location", True), ("reference", -0.1),
        ("angle", 181.0), ("angle", math.nan),
    ],
    "sign_flip": [("scale", 0.0), ("scale", -1.0), ("scale", True), ("start_round", -1), ("start_round", 2.0),
                  ("turn_rounds", 0)],
    "scaled": [("factor", math.nan), ("factor", -2.0)],
    "gaussian": [("std", -1.0), ("std", math.inf), ("std", "1")],
    "random": [("scale", 0)],
    "nan": [("fraction", 0.0), ("fraction", 1.5)],
    "inf": [("fraction", -0.1)],
    "malformed": [("mode", "values")],
    "backdoor": [
        ("target", -1), ("fraction", 0.0), ("fraction", 1.5), ("size", 0), ("value", math.inf), ("boost", 0.0),
    ],
    "stale": [("capture_round", -1), ("capture_round", 1.5)],
    "lying_weight": [("factor", 0.0)],
    "alie": [("z", math.inf), ("z", "big")],
    "ipm": [("epsilon", -0.1)],
    "mimic": [("target", -1), ("target", 2.0), ("noise", -0.1), ("noise", math.inf)],
    "min_max": [("perturbation", "gaussian")],
    "min_sum": [("perturbation", None)],
    "fang_krum": [("threshold", 0.0), ("threshold", math.inf)],
    "fang_trimmed_mean": [("b", 1.0), ("b", 0.5), ("space", "weights")],
    "optimal_alie": [
        ("rule", "kurm"), ("rule", "winsorise+trimmed_mean"),
        ("rule", "nnm+fr_no_such_pkg.Rule"), ("rule_f", -1), ("rule_params", {"tau": 1.0}),
        ("max_scale", 0.0), ("grid", 1), ("refine", -1),
        ("memory", "yes"),
        ("rule_pre_params", {"nnm": {"k": -1}}),
    ],
    "optimal_ipm": [
        ("rule", None), ("rule_f", 1.5), ("rule_params", [1]), ("max_scale", math.nan), ("grid", 2.0),
        ("refine", True),
        ("memory", "yes"),
        ("rule_pre_params", [1]),
    ],
    "optimal_mix": [
        ("rule", "mean+nnm"), ("rule_f", "2"), ("rule_params", {"k": 1}), ("rule_pre_params", {"nnm": None}),
        ("max_scale", math.inf), ("grid", -3), ("refine", None), ("memory", 1),
    ],
    "optimal_search": [
        ("rule", "nnm"), ("rule_f", 1.0), ("rule_params", []), ("rule_pre_params", {"x": {}}), ("max_scale", -2.0),
        ("grid", 1), ("refine", -1), ("memory", None), ("components", -1), ("directions", 2.5), ("local", True),
    ],
    "optimal_fang": [
        ("rule", "fltrust+mean"), ("rule_f", -2), ("rule_params", None), ("max_scale", -1.0), ("grid", 0),
        ("refine", 1.5),
        ("memory", "yes"),
        ("rule_pre_params", {"consistency": 1.0}),
    ],
}


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_update(g: torch.Generator, shift: float = 1.0) -> dict[str, Tensor]:
    """One client's honest update: a non-zero common mean (``shift`` + a ramp) plus noise."""
    out: dict[str, Tensor] = {}
    for key, (shape, dtype) in TEMPLATE.items():
        if dtype.is_floating_point:
            base = shift + torch.linspace(-0.5, 0.5, math.prod(shape)).reshape(shape)
            out[key] = (base + NOISE * torch.randn(shape, generator=g)).to(dtype)
        else:
            out[key] = torch.tensor(7, dtype=dtype)
    return out


def flat(update: dict[str, Tensor]) -> Tensor:
    return torch.cat([update[k].double().reshape(-1) for k in FLOAT_KEYS])


def honest_rows(seed: int = 0, h: int = H, shift: float = 1.0) -> Tensor:
    g = gen(seed)
    return torch.stack([flat(make_update(g, shift)) for _ in range(h)]).float()


def server_update_for(honest: Tensor) -> Tensor:
    """A server update near the honest rows' direction (FLTrust's root data agrees with them, roughly)."""
    noise = torch.randn(honest.shape[1], generator=gen(99)).to(honest)
    return honest.mean(dim=0) + NOISE * noise


def global_model_for(honest: Tensor) -> Tensor:
    """A global model whose weights are larger than one round's update, as a trained model's are."""
    return (4.0 * torch.randn(honest.shape[1], generator=gen(98))).to(honest)


def craft(attack: Attack, honest: Tensor, *, f: int, generator: torch.Generator) -> Tensor:
    """``attack.craft``; an attack that needs the server update or the global model crafts in
    ``craft_round``, given them."""
    if not (attack.needs_server_update or attack.needs_global_model):
        return attack.craft(honest, f=f, generator=generator)
    rows = torch.cat([honest, honest[:f]])
    byzantine = torch.arange(rows.shape[0], device=rows.device) >= honest.shape[0]
    clients = list(range(rows.shape[0]))
    return attack.craft_round(
        rows, byzantine, clients, generator=generator, server_update=server_update_for(honest),
        global_model=global_model_for(honest),
    )


def as_bytes(obj: object) -> object:
    """Byte-level view of attack outputs, so determinism checks compare exact bits (NaN included)."""
    if isinstance(obj, Tensor):
        raw = obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return (str(obj.dtype), tuple(obj.shape), raw.numpy().tobytes())
    if isinstance(obj, dict):
        return {k: as_bytes(v) for k, v in obj.items()}
    if isinstance(obj, tuple | list):
        return [as_bytes(v) for v in obj]
    return obj


def honest_update(client: int, r: int) -> dict[str, Tensor]:
    """The honest update of client ``client`` in round ``r``; its mean drifts with the round."""
    return make_update(gen(1000 * client + r), shift=1.0 + r)


def run_client_rounds(attack: Attack, rounds: int, client: int) -> list[dict[str, Tensor]]:
    """What a client running ``attack`` sends in rounds ``0 .. rounds-1``."""
    g = gen(client)
    return [attack.poison_update(honest_update(client, r), round=r, generator=g) for r in range(rounds)]


def exercise(attack: Attack, seed: int) -> list[object]:
    """Every hook of ``attack`` on fixed inputs; for a plain :class:`Attack` this is honest behaviour."""
    g = gen(seed)
    x, y = torch.randn(8, 3, generator=gen(1)), torch.arange(8) % 4
    out: list[object] = [attack.poison_data(x, y, num_classes=4, generator=g), attack.poison_num_examples(50)]
    if attack.omniscient:
        out.append(craft(attack, honest_rows(seed), f=F, generator=g))
    else:
        out.extend(run_client_rounds(attack, 3, seed))
    return out


# --------------------------------------------------------------------------- registry and parameters


def test_registry_partitions_names() -> None:
    assert attacks.names() == sorted(set(CLIENT) | set(OMNISCIENT))
    assert not set(CLIENT) & set(OMNISCIENT)
    assert {"sign_flip", "label_flip", "alie", "ipm", "mimic", "min_max", "min_sum"} <= set(attacks.names())


@pytest.mark.parametrize("name", attacks.names())
def test_build_gives_named_attack(name: str) -> None:
    attack = attacks.build(name)
    assert isinstance(attack, Attack)
    assert attack.name == name
    assert attack.omniscient == (name in OMNISCIENT)


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="valid attacks: .*sign_flip"):
        attacks.build("sign_flop")


@pytest.mark.parametrize("name", attacks.names())
def test_unknown_param_raises(name: str) -> None:
    with pytest.raises(ValueError, match=rf"'{name}'.*'bogus'.*allowed"):
        attacks.build(name, bogus=1)


@pytest.mark.parametrize("name", attacks.names())
def test_every_param_has_an_invalid_case(name: str) -> None:
    params = {fld.name for fld in dataclasses.fields(type(attacks.build(name))) if fld.init}
    assert params == {param for param, _ in INVALID.get(name, [])}


@pytest.mark.parametrize(
    ("name", "param", "value"), [(n, p, v) for n, cases in INVALID.items() for p, v in cases]
)
def test_invalid_param_value_raises(name: str, param: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"'{name}'.*'{param}'.*must be"):
        attacks.build(name, **{param: value})


# --------------------------------------------------------------------------- properties of every attack


@pytest.mark.parametrize(("name", "params"), CONFIGS)
def test_deterministic_under_seeded_generator(name: str, params: dict[str, object]) -> None:
    first, second = exercise(attacks.build(name, **params), 3), exercise(attacks.build(name, **params), 3)
    assert as_bytes(first) == as_bytes(second)


@pytest.mark.parametrize(("name", "params"), CONFIGS)
def test_attack_is_not_a_no_op(name: str, params: dict[str, object]) -> None:
    # Some hook must differ from honest behaviour on the same inputs, else the attack is inert.
    attack = attacks.build(name, **params)
    honest = exercise(Attack(), 5)
    if attack.omniscient:
        honest.append(honest_rows(5).mean(0).expand(F, -1))  # Byzantine rows that leave the mean alone
    assert as_bytes(exercise(attack, 5)) != as_bytes(honest)


@pytest.mark.parametrize(
    ("name", "params"), [cfg for cfg in CLIENT_CONFIGS if cfg[0] != "malformed"]  # malformed: own test
)
def test_client_attack_keeps_structure_and_integer_arrays(name: str, params: dict[str, object]) -> None:
    expected = make_update(gen(0))
    for sent in run_client_rounds(attacks.build(name, **params), 3, client=0):
        assert list(sent) == list(expected)
        for key, t in sent.items():
            ref = expected[key]
            assert (t.shape, t.dtype, t.device) == (ref.shape, ref.dtype, ref.device)
        assert torch.equal(sent["bn.num_batches_tracked"], expected["bn.num_batches_tracked"])


@pytest.mark.parametrize(("name", "params"), CONFIGS)
def test_state_dict_carries_the_attack_across_instances(name: str, params: dict[str, object]) -> None:
    # A client whose process does not outlive the round rebuilds the attack and loads the saved state;
    # it must then act exactly as the instance that lived on.
    lived_on = attacks.build(name, **params)
    for r in range(2):
        lived_on.poison_update(honest_update(0, r), round=r, generator=gen(r))
    reborn = attacks.build(name, **params)
    reborn.load_state_dict({k: t.clone() for k, t in lived_on.state_dict().items()})
    for r in range(2, 4):
        expected = lived_on.poison_update(honest_update(0, r), round=r, generator=gen(r))
        got = reborn.poison_update(honest_update(0, r), round=r, generator=gen(r))
        assert as_bytes(got) == as_bytes(expected)
    assert as_bytes(reborn.state_dict()) == as_bytes(lived_on.state_dict())


@pytest.mark.parametrize("name", attacks.names())
def test_load_state_dict_rejects_foreign_state(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        attacks.build(name).load_state_dict({"something": torch.zeros(1)})


@pytest.mark.parametrize(("name", "params"), CLIENT_CONFIGS)
def test_client_attack_does_not_modify_its_input(name: str, params: dict[str, object]) -> None:
    attack, g = attacks.build(name, **params), gen(0)
    for r in range(3):
        update = honest_update(0, r)
        before = as_bytes(update)
        attack.poison_update(update, round=r, generator=g)
        assert as_bytes(update) == before


@pytest.mark.parametrize("name", CLIENT)
def test_client_attack_has_no_omniscient_form(name: str) -> None:
    with pytest.raises(NotImplementedError, match=name):
        attacks.build(name).craft(honest_rows(), f=F, generator=gen())


@pytest.mark.parametrize(("name", "params"), [cfg for cfg in CONFIGS if cfg[0] in OMNISCIENT])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_craft_shape_dtype_and_collusion(name: str, params: dict[str, object], dtype: torch.dtype) -> None:
    honest = honest_rows().to(dtype)
    out = craft(attacks.build(name, **params), honest, f=F, generator=gen())
    assert (out.shape, out.dtype, out.device) == ((F, honest.shape[1]), dtype, honest.device)
    assert torch.isfinite(out).all()
    if params.get("noise"):
        assert (out[1:] != out[0]).any(dim=1).all()  # copies spread apart on purpose
    else:
        assert (out == out[0]).all()  # colluding: identical rows
    assert craft(attacks.build(name), honest, f=0, generator=gen()).shape == (0, honest.shape[1])


@pytest.mark.parametrize("name", OMNISCIENT)
def test_craft_rejects_bad_input(name: str) -> None:
    attack = attacks.build(name)
    if attack.needs_server_update:
        with pytest.raises(ValueError, match=f"{name}.*needs the server's own update.*aggregator=fltrust"):
            attack.craft(honest_rows(), f=F, generator=gen())
        rows, byzantine = honest_rows(h=H + F), torch.arange(H + F) >= H
        with pytest.raises(ValueError, match=f"{name}.*needs the server's own update"):
            attack.craft_round(rows, byzantine, list(range(H + F)), generator=gen())
        with pytest.raises(ValueError, match=f"{name}.*server update has shape"):
            attack.craft_round(rows, byzantine, list(range(H + F)), generator=gen(), server_update=rows[0, :-1])
        with pytest.raises(ValueError, match=name):
            attack.craft_round(rows.long(), byzantine, list(range(H + F)), generator=gen(), server_update=rows[0])
        return
    with pytest.raises(ValueError, match=name):
        attack.craft(honest_rows()[0], f=F, generator=gen())  # rank 1
    with pytest.raises(ValueError, match=name):
        attack.craft(torch.ones(H, D, dtype=torch.int64), f=F, generator=gen())
    with pytest.raises(ValueError, match=name):
        attack.craft(honest_rows(), f=-1, generator=gen())


@pytest.mark.parametrize("name", OMNISCIENT)
def test_omniscient_attack_leaves_client_hooks_honest(name: str) -> None:
    attack, update = attacks.build(name), make_update(gen())
    assert attack.poison_update(update, round=0, generator=gen()) is update
    assert attack.poison_num_examples(50) == 50


# --------------------------------------------------------------------------- the attacks move a plain mean


def shift_norm(attacked_mean: Tensor, honest_mean: Tensor) -> float:
    diff = attacked_mean.double() - honest_mean.double()
    return math.inf if not torch.isfinite(diff).all() else float(diff.norm())


MEASURABLE = 0.01 * NOISE * math.sqrt(D)  # 1% of one honest update's noise norm; exact arithmetic gives 0


@pytest.mark.parametrize("name", UPDATE_ATTACKS)
def test_client_attack_moves_plain_mean(name: str) -> None:
    # n = H + F clients; the last F apply the attack to their own honest updates. Round 1 is compared, so a
    # stateful attack (stale) has an earlier round to replay.
    honest = torch.stack([flat(honest_update(c, 1)) for c in range(H + F)])
    byzantine = [flat(run_client_rounds(attacks.build(name), 2, c)[1]) for c in range(H, H + F)]
    sent = torch.cat([honest[:H], torch.stack(byzantine)])
    assert shift_norm(sent.mean(0), honest.mean(0)) > MEASURABLE


@pytest.mark.parametrize("name", OMNISCIENT)
def test_omniscient_attack_moves_plain_mean(name: str) -> None:
    honest = honest_rows(seed=11)
    byz = craft(attacks.build(name), honest, f=F, generator=gen())
    assert shift_norm(torch.cat([honest, byz]).mean(0), honest.mean(0)) > MEASURABLE


def test_lying_weight_moves_weighted_mean() -> None:
    attack = attacks.build("lying_weight")
    assert attack.poison_num_examples(50) == 5000
    assert attacks.build("lying_weight", factor=2.5).poison_num_examples(3) == 8
    updates = torch.stack([flat(honest_update(c, 0)) for c in range(H + F)])
    true_w = torch.full((H + F,), 50.0, dtype=torch.float64)
    lied_w = torch.tensor([50.0] * H + [float(attack.poison_num_examples(50))] * F, dtype=torch.float64)
    honest_mean = (true_w[:, None] * updates).sum(0) / true_w.sum()
    attacked_mean = (lied_w[:, None] * updates).sum(0) / lied_w.sum()
    assert shift_norm(attacked_mean, honest_mean) > MEASURABLE


# --------------------------------------------------------------------------- attack-specific guarantees


@pytest.mark.parametrize("num_classes", [2, 7, 10])
def test_label_flip_maps_every_label(num_classes: int) -> None:
    g = gen()
    x, y = torch.randn(64, 5, generator=g), torch.randint(0, num_classes, (64,), generator=g)
    px, py = attacks.build("label_flip").poison_data(x, y, num_classes=num_classes, generator=g)
    assert px is x
    assert py.dtype == y.dtype
    assert torch.equal(py, num_classes - 1 - y)
    # Every label changes except the middle class of an odd number of classes, which maps to itself.
    changed = py != y
    assert changed.all() if num_classes % 2 == 0 else torch.equal(~changed, y == num_classes // 2)


def test_label_flip_rejects_bad_labels() -> None:
    attack, x = attacks.build("label_flip"), torch.zeros(2, 1)
    with pytest.raises(ValueError, match=r"label_flip.*\[0, 3\)"):
        attack.poison_data(x, torch.tensor([0, 3]), num_classes=3, generator=gen())
    with pytest.raises(ValueError, match="label_flip.*integer"):
        attack.poison_data(x, torch.tensor([0.0, 1.0]), num_classes=3, generator=gen())


@pytest.mark.parametrize("name", ["nan", "inf"])
def test_non_finite_fill(name: str) -> None:
    sent = attacks.build(name).poison_update(make_update(gen()), round=0, generator=gen())
    check = torch.isnan if name == "nan" else torch.isposinf
    for key in FLOAT_KEYS:
        assert check(sent[key]).all()


@pytest.mark.parametrize("name", ["nan", "inf"])
@given(fraction=st.floats(0.01, 1.0), seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
def test_non_finite_fill_fraction(name: str, fraction: float, seed: int) -> None:
    update = make_update(gen(seed))
    sent = attacks.build(name, fraction=fraction).poison_update(update, round=0, generator=gen(seed))
    for key in FLOAT_KEYS:
        bad = ~torch.isfinite(sent[key])
        assert int(bad.sum()) == math.ceil(fraction * update[key].numel())
        assert torch.equal(sent[key][~bad], update[key][~bad])  # the other coordinates are untouched


@pytest.mark.parametrize("mode", ["shape", "dtype", "keys"])
def test_malformed_breaks_exactly_one_property(mode: str) -> None:
    expected = make_update(gen())
    sent = attacks.build("malformed", mode=mode).poison_update(make_update(gen()), round=0, generator=gen())
    keys_ok = list(sent) == list(expected)
    assert keys_ok == (mode != "keys")
    if mode == "keys":
        assert len(set(sent) - set(expected)) == 1 and len(set(expected) - set(sent)) == 1
        return
    shapes_ok = all(sent[k].shape == expected[k].shape for k in expected)
    dtypes_ok = all(sent[k].dtype == expected[k].dtype for k in expected)
    assert (shapes_ok, dtypes_ok) == (mode != "shape", mode != "dtype")
    broken = [k for k in expected if (sent[k].shape, sent[k].dtype) != (expected[k].shape, expected[k].dtype)]
    assert len(broken) == 1


def test_stale_replays_first_round() -> None:
    sent = run_client_rounds(attacks.build("stale"), 4, client=2)
    assert as_bytes(sent[0]) == as_bytes(honest_update(2, 0))  # honest in the first round
    for later in sent[1:]:
        assert as_bytes(later) == as_bytes(sent[0])


def test_stale_keeps_its_own_copy() -> None:
    attack, update = attacks.build("stale"), honest_update(0, 0)
    expected = as_bytes(update)
    attack.poison_update(update, round=0, generator=gen())
    update["conv.weight"].zero_()  # the client reuses its buffers after sending
    assert as_bytes(attack.poison_update(honest_update(0, 1), round=1, generator=gen())) == expected


def test_stale_capture_round_and_copy() -> None:
    attack = attacks.build("stale", capture_round=2)
    updates = {r: make_update(gen(r), shift=float(r)) for r in (0, 1, 3, 4)}
    assert attack.poison_update(updates[0], round=0, generator=gen()) is updates[0]
    assert attack.poison_update(updates[1], round=1, generator=gen()) is updates[1]
    # A client not sampled in round 2 captures the first round after it.
    assert attack.poison_update(updates[3], round=3, generator=gen()) is updates[3]
    replay = attack.poison_update(updates[4], round=4, generator=gen())
    assert as_bytes(replay) == as_bytes(updates[3])
    replay["conv.weight"].fill_(123.0)  # the caller edits its reply; later replays must not change
    assert as_bytes(attack.poison_update(updates[4], round=5, generator=gen())) == as_bytes(updates[3])


def test_gaussian_and_random_draw_the_configured_noise() -> None:
    big = {"w": torch.zeros(20_000), "step": torch.tensor(3)}
    noise = attacks.build("gaussian", std=2.0).poison_update(big, round=0, generator=gen())["w"]
    assert abs(float(noise.mean())) < 0.1 and abs(float(noise.std()) - 2.0) < 0.1
    uni = attacks.build("random", scale=0.5).poison_update(big, round=0, generator=gen())["w"]
    assert float(uni.min()) >= -0.5 and float(uni.max()) <= 0.5 and float(uni.std()) > 0.25


@pytest.mark.parametrize("name", ["gaussian", "random"])
def test_noise_depends_on_seed_not_dtype(name: str) -> None:
    # A float16 model must receive the same noise as a float32 one, rounded, for runs to be comparable.
    attack = attacks.build(name)
    full = attack.poison_update({"w": torch.zeros(64)}, round=0, generator=gen(9))["w"]
    half = attack.poison_update({"w": torch.zeros(64, dtype=torch.float16)}, round=0, generator=gen(9))["w"]
    assert half.dtype == torch.float16
    assert torch.equal(half, full.half())


def test_a_sleeper_sign_flip_is_honest_before_its_start_round() -> None:
    update = make_update(gen())
    sleeper = attacks.build("sign_flip", start_round=3)
    assert sleeper.poison_update(update, round=2, generator=gen()) is update
    flipped = sleeper.poison_update(update, round=3, generator=gen())
    assert all(torch.equal(flipped[key], -update[key]) for key in FLOAT_KEYS)


def test_a_turning_sleeper_reverses_its_update_by_equal_angles_keeping_its_norm() -> None:
    update = make_update(gen())
    turning = attacks.build("sign_flip", start_round=3, turn_rounds=4, scale=2.0)

    def flat(u: dict) -> torch.Tensor:
        return torch.cat([u[key].double().reshape(-1) for key in FLOAT_KEYS])

    honest = flat(update)
    assert turning.poison_update(update, round=2, generator=gen()) is update
    sent = [flat(turning.poison_update(update, round=r, generator=gen())) for r in range(3, 8)]
    cosines = [float(torch.nn.functional.cosine_similarity(s, honest, dim=0)) for s in sent]
    assert cosines == pytest.approx([math.cos(math.pi * k / 4) for k in (1, 2, 3)] + [-1.0, -1.0], abs=1e-3)
    # Each reply is one quarter-turn step from the last, in one plane, at twice the honest norm.
    steps = [float(torch.nn.functional.cosine_similarity(a, b, dim=0)) for a, b in zip(sent, sent[1:3], strict=False)]
    assert steps == pytest.approx([math.cos(math.pi / 4)] * 2, abs=1e-3)
    assert [float(s.norm() / honest.norm()) for s in sent] == pytest.approx([2.0] * 5, rel=1e-3)
    assert all(turning.poison_update(update, round=3, generator=gen())[k].dtype == update[k].dtype for k in update)


def test_scaling_attacks_are_exact() -> None:
    update = make_update(gen())
    flipped = attacks.build("sign_flip", scale=3.0).poison_update(update, round=0, generator=gen())
    boosted = attacks.build("scaled").poison_update(update, round=0, generator=gen())
    zero = attacks.build("zero").poison_update(update, round=0, generator=gen())
    for key in FLOAT_KEYS:
        assert torch.equal(flipped[key], (update[key] * -3.0).to(update[key].dtype))
        assert torch.equal(boosted[key], (update[key] * 10.0).to(update[key].dtype))
        assert not zero[key].any()


@pytest.mark.parametrize(
    ("n", "f", "z"),
    # s = floor(n/2 + 1) - f, z = Phi^-1((n - s) / n): Phi^-1(13/20), Phi^-1(1/2), Phi^-1(6/7), Phi^-1(48/50)
    [(20, 4, 0.385320466), (10, 1, 0.0), (7, 3, 1.067570524), (50, 24, 1.750686071)],
)
def test_alie_z_follows_the_paper(n: int, f: int, z: float) -> None:
    assert attacks.alie_z(n, f) == pytest.approx(z, abs=1e-8)


def test_alie_refuses_a_byzantine_majority_without_z() -> None:
    with pytest.raises(ValueError, match=r"alie.*n=10, f=6"):
        attacks.alie_z(10, 6)
    honest = honest_rows(h=4)
    with pytest.raises(ValueError, match=r"alie.*n=10, f=6"):
        attacks.build("alie").craft(honest, f=6, generator=gen())
    assert attacks.build("alie", z=1.0).craft(honest, f=6, generator=gen()).shape == (6, D)


@given(seed=st.integers(0, 2**16), h=st.integers(5, 30), f_frac=st.floats(0.05, 0.4))
@settings(max_examples=25, deadline=None)
def test_alie_small_deviation_moves_mean(seed: int, h: int, f_frac: float) -> None:
    f = max(1, int(f_frac * h))
    honest = honest_rows(seed, h=h)
    row = attacks.build("alie").craft(honest, f=f, generator=gen())[0]
    sigma, mu = torch.std_mean(honest, dim=0)
    z = attacks.alie_z(h + f, f)
    assert 0 <= z < 1.5  # z = 0 when s = n/2 exactly: ALIE then sends the mean
    # Within z standard deviations of the honest mean in every coordinate (its point: a small deviation) ...
    assert ((row - mu).abs() <= z * sigma + 1e-5).all()
    torch.testing.assert_close(row, mu - z * sigma)
    # ... yet every coordinate is pushed the same way, so the mean of all n clients moves.
    if z > 0:
        shift = shift_norm(torch.cat([honest, row.expand(f, -1)]).mean(0), mu)
        assert shift == pytest.approx(f / (h + f) * z * float(sigma.double().norm()), rel=1e-4)


def test_alie_z_override() -> None:
    honest = honest_rows()
    row = attacks.build("alie", z=2.0).craft(honest, f=F, generator=gen())[0]
    sigma, mu = torch.std_mean(honest, dim=0)
    torch.testing.assert_close(row, mu - 2.0 * sigma)


def test_ipm_is_negative_scaled_mean() -> None:
    honest = honest_rows()
    for eps in (0.1, 100.0):
        row = attacks.build("ipm", epsilon=eps).craft(honest, f=F, generator=gen())[0]
        torch.testing.assert_close(row, -eps * honest.mean(0))
    row = attacks.build("ipm", epsilon=100.0).craft(honest, f=F, generator=gen())[0]
    assert float(torch.cat([honest, row.expand(F, -1)]).mean(0) @ honest.mean(0)) < 0


def test_mimic_copies_the_principal_direction_extreme() -> None:
    honest = honest_rows(seed=4)
    row = attacks.build("mimic").craft(honest, f=F, generator=gen())[0]
    centred = (honest - honest.mean(0)).double()
    top = torch.linalg.svd(centred, full_matrices=False).Vh[0]
    expected = int((centred @ top).abs().argmax())
    assert torch.equal(row, honest[expected])
    assert torch.equal(attacks.build("mimic", target=3).craft(honest, f=F, generator=gen())[0], honest[3])
    with pytest.raises(ValueError, match=r"mimic.*target=16.*h=16"):
        attacks.build("mimic", target=16).craft(honest, f=F, generator=gen())


def test_mimic_noise_moves_each_copy_by_its_fraction_of_the_typical_honest_distance() -> None:
    honest = honest_rows(seed=4)
    exact = attacks.build("mimic", target=3).craft(honest, f=F, generator=gen())
    noisy = attacks.build("mimic", target=3, noise=0.5).craft(honest, f=F, generator=gen())
    typical = torch.cdist(honest.double(), honest.double()).fill_diagonal_(math.inf).min(dim=1).values.median()
    moved = torch.linalg.vector_norm((noisy - exact).double(), dim=1)
    torch.testing.assert_close(moved, torch.full((F,), 0.5 * float(typical), dtype=torch.float64), rtol=1e-4, atol=0)
    assert torch.cdist(noisy.double(), noisy.double()).fill_diagonal_(math.inf).min() > 0.5 * typical  # apart
    assert torch.equal(noisy, attacks.build("mimic", target=3, noise=0.5).craft(honest, f=F, generator=gen()))


def sq_dists(a: Tensor, b: Tensor) -> Tensor:
    return torch.cdist(a.double(), b.double()) ** 2


@pytest.mark.parametrize("name", ["min_max", "min_sum"])
@given(
    seed=st.integers(0, 2**16),
    h=st.integers(2, 25),
    d=st.integers(1, 64),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    perturbation=st.sampled_from(["std", "unit_vec", "sign"]),
)
@settings(max_examples=25, deadline=None)
def test_shejwalkar_bound_holds_and_is_tight(
    name: str, seed: int, h: int, d: int, scale: float, perturbation: str
) -> None:
    g = gen(seed)
    honest = scale * (torch.randn(d, generator=g) + torch.randn(h, d, generator=g))
    row = attacks.build(name, perturbation=perturbation).craft(honest, f=3, generator=gen())[:1]
    to_honest, pairwise = sq_dists(row, honest)[0], sq_dists(honest, honest)
    if name == "min_max":
        value, bound = to_honest.max(), pairwise.max()
    else:
        value, bound = to_honest.sum(), pairwise.sum(1).max()
    assert value <= bound * (1 + 1e-5) + 1e-12
    # gamma is the largest allowed: the constraint is active (the paper's search converges to this point).
    assert value >= bound * (1 - 1e-4)


@pytest.mark.parametrize("name", ["min_max", "min_sum"])
def test_shejwalkar_moves_along_the_perturbation(name: str) -> None:
    honest = honest_rows()
    mu, std = honest.mean(0), honest.std(0)
    row = attacks.build(name).craft(honest, f=F, generator=gen())[0]
    gamma = float((mu - row) @ std / (std @ std))
    assert gamma > 0
    torch.testing.assert_close(row, mu - gamma * std)
    # Identical honest updates leave no direction to move in: the attack sends their mean.
    same = honest[:1].repeat(5, 1)
    torch.testing.assert_close(attacks.build(name).craft(same, f=2, generator=gen()), same[:2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu() -> None:
    # Draws come from the CPU generator, so an update on the GPU gets the same attack as one on the CPU.
    for name, params in CONFIGS:
        attack_cpu, attack_gpu = attacks.build(name, **params), attacks.build(name, **params)
        if attack_cpu.omniscient:
            honest = honest_rows().double()
            cpu = craft(attack_cpu, honest, f=F, generator=gen())
            gpu = craft(attack_gpu, honest.cuda(), f=F, generator=gen())
            assert gpu.device.type == "cuda", name
            torch.testing.assert_close(gpu.cpu(), cpu, msg=name)
            continue
        for r in range(3):
            update = honest_update(0, r)
            cpu_out = attack_cpu.poison_update(update, round=r, generator=gen(r))
            on_gpu = {k: t.cuda() for k, t in update.items()}
            gpu_out = attack_gpu.poison_update(on_gpu, round=r, generator=gen(r))
            assert list(gpu_out) == list(cpu_out), name
            for key, t in cpu_out.items():
                assert gpu_out[key].device.type == "cuda", name
                torch.testing.assert_close(gpu_out[key].cpu(), t, equal_nan=True, msg=f"{name} {key}")


# --------------------------------------------------------------------------- Fang et al. and the tuned attacks


def rule_shift(rule: str, f: int, honest: Tensor, byzantine: Tensor) -> float:
    """How far ``rule`` (with ``f``) on the honest and Byzantine rows lands from the honest mean."""
    out = aggregators.build(rule, f=f)(torch.cat([honest, byzantine]))
    return shift_norm(out, honest.mean(0))


def test_fang_krum_makes_krum_select_a_byzantine_row() -> None:
    # Honest updates whose common direction is small next to their spread, as in the paper's setting.
    g = gen(0)
    honest = 0.1 + torch.randn(16, 100, generator=g)
    byz = attacks.build("fang_krum").craft(honest, f=F, generator=gen())
    out = aggregators.build("krum", f=F)(torch.cat([honest, byz]))
    assert torch.equal(out, byz[0])
    s = torch.sign(honest.mean(0))
    lam = float(-(byz[0] @ s) / (s @ s))
    torch.testing.assert_close(byz[0], -lam * s)
    assert lam > 0.1  # found on the ladder, not the threshold fallback
    assert float(out @ honest.mean(0)) < 0  # the selected update points against the honest direction


def test_fang_krum_needs_enough_rows_for_krum() -> None:
    with pytest.raises(ValueError, match=r"fang_krum.*h >= f\+3.*h=6, f=4"):
        attacks.build("fang_krum").craft(honest_rows(h=6), f=4, generator=gen())


def test_fang_trimmed_mean_pushes_every_coordinate_against_its_direction() -> None:
    honest = honest_rows(seed=2).double()
    byz = attacks.build("fang_trimmed_mean", b=2.0).craft(honest, f=F, generator=gen())[0]
    mean, low, high = honest.mean(0), honest.min(0).values, honest.max(0).values
    up = mean > 0
    # Beyond the honest extreme opposite to the mean's sign, at the paper's bound.
    torch.testing.assert_close(byz[up], torch.where(low[up] > 0, low[up] / 2, low[up] * 2))
    torch.testing.assert_close(byz[~up], torch.where(high[~up] > 0, high[~up] * 2, high[~up] / 2))
    assert (byz[up] < low[up]).all() and (byz[~up] > high[~up]).all()
    # The trimmed mean then keeps the honest values on the far side only: every coordinate moves back.
    out = aggregators.build("trimmed_mean", f=F)(torch.cat([honest, byz.expand(F, -1)]))
    assert ((out - mean) * torch.sign(mean) < 0).all()


def test_fang_trimmed_mean_in_model_space_bounds_the_local_models() -> None:
    honest = honest_rows(seed=2).double()
    weights = global_model_for(honest)
    attack = attacks.build("fang_trimmed_mean", space="model")
    byz = craft(attack, honest, f=F, generator=gen())
    assert (byz == byz[0]).all()
    local, mean = honest + weights, honest.mean(0)
    low, high, up = local.min(0).values, local.max(0).values, mean > 0
    sent = byz[0] + weights  # the Byzantine local model
    torch.testing.assert_close(sent[up], torch.where(low[up] > 0, low[up] / 2, low[up] * 2))
    torch.testing.assert_close(sent[~up], torch.where(high[~up] > 0, high[~up] * 2, high[~up] / 2))
    # The bound scales weights, not updates: against a plain mean it reaches far beyond the update-space form.
    in_updates = attacks.build("fang_trimmed_mean").craft(honest, f=F, generator=gen())
    model_shift = shift_norm(torch.cat([honest, byz]).mean(0), mean)
    update_shift = shift_norm(torch.cat([honest, in_updates]).mean(0), mean)
    assert model_shift > 2 * update_shift


def test_fang_trimmed_mean_in_model_space_needs_the_global_model() -> None:
    attack, honest = attacks.build("fang_trimmed_mean", space="model"), honest_rows()
    assert attack.needs_global_model and not attacks.build("fang_trimmed_mean").needs_global_model
    with pytest.raises(ValueError, match=r"must be one of 'update', 'model', got 'modle' \(did you mean 'model'\?\)"):
        attacks.build("fang_trimmed_mean", space="modle")
    with pytest.raises(ValueError, match=r"fang_trimmed_mean.*space='model'.*craft_round\(\.\.\., global_model"):
        attack.craft(honest, f=F, generator=gen())
    rows, byzantine = honest_rows(h=H + F), torch.arange(H + F) >= H
    with pytest.raises(ValueError, match=r"needs the round's global model of shape \(\d+,\).*got None"):
        attack.craft_round(rows, byzantine, list(range(H + F)), generator=gen())
    with pytest.raises(ValueError, match=r"got \(\d+,\)"):
        attack.craft_round(rows, byzantine, list(range(H + F)), generator=gen(), global_model=rows[0, :-1])


@pytest.mark.parametrize(
    "rule",
    [
        "trimmed_mean", "median", "krum", "geometric_median", "dnc", "signguard", "clipped_clustering",
        "winsorize+nnm+trimmed_mean",
    ],
)
def test_optimal_alie_moves_the_rule_at_least_as_far_as_alie(rule: str) -> None:
    honest = honest_rows(seed=7)
    plain = rule_shift(rule, F, honest, attacks.build("alie").craft(honest, f=F, generator=gen()))
    tuned = rule_shift(rule, F, honest, attacks.build("optimal_alie", rule=rule).craft(honest, f=F, generator=gen()))
    assert tuned >= plain * (1 - 1e-6)
    if rule in ("trimmed_mean", "krum", "clipped_clustering"):
        assert tuned > 1.5 * plain  # ALIE's fixed z is far from the best one against these rules


def test_optimal_ipm_against_the_mean_takes_the_largest_epsilon() -> None:
    # Against a plain mean the shift f/n * (1 + epsilon) * |mu| grows with epsilon: the search must end at the top.
    honest = honest_rows(seed=3)
    row = attacks.build("optimal_ipm", rule="mean", max_scale=7.0).craft(honest, f=F, generator=gen())[0]
    torch.testing.assert_close(row, -7.0 * honest.mean(0))


def _extreme(honest: Tensor) -> Tensor:
    """Each coordinate's honest extreme opposite to the sign of its mean (Fang's direction)."""
    return torch.where(honest.mean(0) > 0, honest.min(0).values, honest.max(0).values)


@pytest.mark.parametrize(
    "rule", ["trimmed_mean", "median", "dnc", "signguard", "clipped_clustering", "direction+winsorize+nnm+trimmed_mean"]
)
def test_optimal_fang_moves_the_rule_at_least_as_far_as_rows_on_the_extreme(rule: str) -> None:
    honest = honest_rows(seed=5)
    row = attacks.build("optimal_fang", rule=rule).craft(honest, f=F, generator=gen())[0].double()
    mu, extreme = honest.double().mean(0), _extreme(honest).double()
    # The row lies on the line from the mean through the extreme, at some t in [0, max_scale].
    t = float((row - mu) @ (extreme - mu) / (extreme - mu).square().sum())
    assert 0.0 <= t <= 10.0
    torch.testing.assert_close(row, mu + t * (extreme - mu), rtol=0, atol=1e-5)
    on_extreme = rule_shift(rule, F, honest, extreme.float().expand(F, -1))
    assert rule_shift(rule, F, honest, row.float().expand(F, -1)) >= on_extreme * (1 - 1e-6)


def test_optimal_fang_gains_nothing_beyond_the_extreme_that_winsorizing_clamps_to() -> None:
    # Beyond the honest extreme, winsorizing clamps the rows back onto it: the best t is at least 1, and
    # moves the rule exactly as far as rows on the extreme (up to the float rounding of mu + t (e - mu)).
    honest = honest_rows(seed=6)
    rule = "winsorize+trimmed_mean"
    row = attacks.build("optimal_fang", rule=rule).craft(honest, f=F, generator=gen())[0]
    mu, extreme = honest.mean(0), _extreme(honest)
    assert float((row - mu) @ (extreme - mu) / (extreme - mu).square().sum()) >= 1 - 1e-6
    farther = rule_shift(rule, F, honest, (mu + 3.0 * (extreme - mu)).expand(F, -1))
    assert rule_shift(rule, F, honest, row.expand(F, -1)) == pytest.approx(farther, rel=1e-6)
    assert rule_shift(rule, F, honest, extreme.expand(F, -1)) == pytest.approx(farther, rel=1e-6)
    # Against the plain mean the shift only grows with t: the search ends at the top of the range.
    row = attacks.build("optimal_fang", rule="mean", max_scale=4.0).craft(honest, f=F, generator=gen())[0]
    mu = honest.mean(0)
    torch.testing.assert_close(row, mu + 4.0 * (_extreme(honest) - mu), rtol=0, atol=1e-5)


DEFAULT_RULE = "consistency+direction+dedup+winsorize+nnm+trimmed_mean"


def _round_rows(round_: int, h: int = 16, f: int = F) -> tuple[Tensor, Tensor]:
    """One round's rows: ``f`` Byzantine rows first (as their clients computed them), then ``h`` honest."""
    rows = honest_rows(seed=100 + round_, h=h + f)
    byzantine = torch.zeros(h + f, dtype=torch.bool)
    byzantine[:f] = True
    return rows, byzantine


@pytest.mark.parametrize("name", ["optimal_fang", "optimal_alie", "optimal_ipm", "optimal_search", "rop"])
def test_optimal_attack_with_memory_keeps_the_server_state(name: str) -> None:
    # The attacker's copy of the pipeline must hold the server's state after every round, or its
    # search would be against another rule than the one the server runs.
    server = aggregators.build(DEFAULT_RULE, f=F)
    attack = attacks.build(name, memory=True, grid=4, refine=2)
    clients = [7, 3, 11, 5, 0, 9, 2, 14, 1, 13, 6, 8, 4, 12, 10, 15, 16, 17, 18, 19]
    for round_ in range(1, 6):
        rows, byzantine = _round_rows(round_)
        crafted = attack.craft_round(rows, byzantine, clients, generator=gen(round_))
        assert crafted.shape == (F, rows.shape[1])
        rows[byzantine] = crafted
        server(rows, clients=clients)
        copy = attack._memory["state"]
        state = server.state_dict()
        assert copy.keys() == state.keys()
        assert all(torch.equal(copy[key], state[key]) for key in state)
    assert any(value.numel() > 0 for value in state.values())  # the memory is not empty


def test_optimal_attack_with_memory_shares_the_state_between_rounds_of_other_f() -> None:
    # A round with fewer Byzantine rows runs the pipeline for that f on the same state, as the server
    # does (RobustStrategy loads its state into the pipeline of the round's f and back).
    pipelines = {f: aggregators.build(DEFAULT_RULE, f=f) for f in (F - 1, F)}
    attack = attacks.build("optimal_alie", memory=True, grid=4, refine=2)
    clients = list(range(20))
    state = pipelines[F].state_dict()
    for round_, f in enumerate([F, F - 1, F, F - 1], start=1):
        rows, byzantine = _round_rows(round_, h=20 - f, f=f)
        rows[byzantine] = attack.craft_round(rows, byzantine, clients, generator=gen(round_))
        pipelines[f].load_state_dict({key: value.clone() for key, value in state.items()})
        pipelines[f](rows, clients=clients)
        state = pipelines[f].state_dict()
        copy = attack._memory["state"]
        assert copy.keys() == state.keys()
        assert all(torch.equal(copy[key], state[key]) for key in state)


def _shift_on(state: dict[str, Tensor], rows: Tensor, byzantine: Tensor, row: Tensor, clients: list[int]) -> float:
    """How far the default pipeline loaded with ``state`` lands from the honest mean, ``row`` in each
    Byzantine place."""
    trial = aggregators.build(DEFAULT_RULE, f=F)
    trial.load_state_dict({key: value.clone() for key, value in state.items()})
    placed = rows.clone()
    placed[byzantine] = row.expand(F, -1)
    return shift_norm(trial(placed, clients=clients), rows[~byzantine].mean(0))


def test_optimal_attack_with_memory_is_searched_against_the_server_state() -> None:
    # Round after round, the crafted rows move the server (with its state) at least as far as every
    # other row on the grid would: the objective it maximized is the server's own.
    server = aggregators.build(DEFAULT_RULE, f=F)
    attack = attacks.build("optimal_fang", memory=True, grid=6, refine=3, max_scale=2.0)
    clients = list(range(20))
    for round_ in range(1, 5):
        rows, byzantine = _round_rows(round_)
        before = {key: value.clone() for key, value in server.state_dict().items()}
        crafted = attack.craft_round(rows, byzantine, clients, generator=gen(round_))
        honest = rows[~byzantine]
        mu, extreme = honest.mean(0), _extreme(honest)
        best_on_grid = max(
            _shift_on(before, rows, byzantine, mu + t * (extreme - mu), clients)
            for t in (0.0, 0.4, 0.8, 1.0, 1.2, 1.6, 2.0)
        )
        assert _shift_on(before, rows, byzantine, crafted[0], clients) >= best_on_grid * (1 - 1e-5)
        rows[byzantine] = crafted
        server(rows, clients=clients)


def test_optimal_attack_without_memory_crafts_from_the_honest_rows_alone() -> None:
    rows, byzantine = _round_rows(1)
    attack = attacks.build("optimal_fang", grid=4, refine=2)
    by_round = attack.craft_round(rows, byzantine, list(range(20)), generator=gen())
    assert torch.equal(by_round, attack.craft(rows[~byzantine], f=F, generator=gen()))
    assert attack._memory == {}


def test_optimal_search_refines_an_interior_maximum() -> None:
    scale, value = maximize_scale(lambda t: -((t - 3.3) ** 2), default=0.1, max_scale=10.0, grid=11, refine=12)
    assert scale == pytest.approx(3.3, abs=0.01) and value <= 0
    # A maximum only at the default scale (off the grid) is found too, and ties keep the smaller scale.
    assert maximize_scale(lambda t: float(t == 0.37), default=0.37, max_scale=10.0, grid=11, refine=0)[0] == 0.37
    assert maximize_scale(lambda t: 1.0, default=0.37, max_scale=10.0, grid=11, refine=4)[0] == 0.0


def test_optimal_attack_needs_the_rows_its_rule_needs() -> None:
    with pytest.raises(ValueError, match=r"optimal_alie.*'krum' with f=4 needs n >= 11.*h=5"):
        attacks.build("optimal_alie", rule="krum").craft(honest_rows(h=5), f=4, generator=gen())
    with pytest.raises(ValueError, match=r"optimal_ipm.*'rule_params'.*centered_clipping.*tua"):
        attacks.build("optimal_ipm", rule="centered_clipping", rule_params={"tua": 1.0})


def test_simulation_gives_an_attack_with_memory_the_server_stage_parameters() -> None:
    from experiments import study
    from experiments.adversary import attack_for

    pipeline = "consistency+direction+dedup+winsorize+nnm+trimmed_mean"
    base = ["attack=optimal_fang", "+aggregator.pre_params.direction.z=1.5", "+aggregator.pre_params.dedup.tol=0.1"]
    configs = study.compose({"memory": [*base, "+attack.params.memory=true"], "plain": base})
    with_memory = attack_for(configs["memory"])
    assert with_memory.rule == pipeline  # type: ignore[attr-defined]
    assert with_memory.rule_pre_params == {"direction": {"z": 1.5}, "dedup": {"tol": 0.1}}  # type: ignore[attr-defined]
    # Its copy of the pipeline is the server's: the same stage parameters.
    copy = with_memory._rule(F)  # type: ignore[attr-defined]
    server = aggregators.build(
        "trimmed_mean", f=F, pre=["consistency", {"name": "direction", "z": 1.5}, {"name": "dedup", "tol": 0.1},
                                  "winsorize", "nnm"],
    )
    assert repr(copy) == repr(server) and copy.pre[1].z == 1.5 and copy.pre[2].tol == 0.1
    # Without memory the attack keeps its own model of the rule, as conf/attack gives it.
    assert attack_for(configs["plain"]).rule_pre_params == {}  # type: ignore[attr-defined]


def test_simulation_gives_an_attack_with_memory_the_stages_aggregator_pre_lists() -> None:
    from experiments import study
    from experiments.adversary import attack_for
    from fedrobust.run_setup import build_aggregator

    overrides = ["aggregator=trimmed_mean", "aggregator.pre=bucketing", "+aggregator.pre_params.bucketing.s=1",
                 "attack=optimal_alie", "+attack.params.memory=true"]
    cfg = study.compose({"run": overrides})["run"]
    attack = attack_for(cfg)
    assert attack.rule == "bucketing+trimmed_mean"  # type: ignore[attr-defined]
    assert repr(attack._rule(F)) == repr(build_aggregator(cfg))  # type: ignore[attr-defined]
    assert attack._rule(F).pre[0].s == 1  # type: ignore[attr-defined]


def test_rule_pre_params_must_name_stages_of_the_pipeline() -> None:
    with pytest.raises(ValueError, match=r"optimal_alie.*'rule_pre_params'.*stages of 'winsorize\+trimmed_mean'.*krum"):
        attacks.build("optimal_alie", rule="winsorize+trimmed_mean", rule_pre_params={"krum": {}})


@pytest.mark.parametrize("rule", ["trimmed_mean", "krum", "dnc", "signguard", DEFAULT_RULE])
def test_optimal_mix_moves_the_rule_at_least_as_far_as_any_grid_point_of_its_lines(rule: str) -> None:
    honest = honest_rows(seed=9)
    attack = attacks.build("optimal_mix", rule=rule, grid=6, refine=2)
    row = attack.craft(honest, f=F, generator=gen())[0]
    reached = rule_shift(rule, F, honest, row.expand(F, -1))
    lines = attack._lines(honest, F)  # type: ignore[attr-defined]
    assert len(lines) == 7  # three directions, three pairs, all three
    for base, direction, _ in lines:
        torch.testing.assert_close(
            torch.linalg.vector_norm(direction), torch.linalg.vector_norm(honest.std(0)), rtol=1e-4, atol=0
        )
        for t in (0.0, 2.0, 4.0, 6.0, 8.0, 10.0):
            assert reached >= rule_shift(rule, F, honest, (base + t * direction).expand(F, -1)) * (1 - 1e-6)


@pytest.mark.parametrize("rule", ["trimmed_mean", "krum", "signguard", DEFAULT_RULE])
def test_optimal_search_moves_the_rule_at_least_as_far_as_optimal_mix_and_tries_other_directions(rule: str) -> None:
    honest = honest_rows(seed=9)
    mix = attacks.build("optimal_mix", rule=rule, grid=6, refine=2).craft(honest, f=F, generator=gen())[0]
    search = attacks.build("optimal_search", rule=rule, grid=6, refine=2, directions=6, local=6)
    row = search.craft(honest, f=F, generator=gen())[0]
    assert rule_shift(rule, F, honest, row.expand(F, -1)) >= rule_shift(rule, F, honest, mix.expand(F, -1)) * (1 - 1e-6)
    # Every line it tries lies in the span of the three tuned directions and the top components.
    span = search._span(honest)  # type: ignore[attr-defined]
    assert span.shape[1] == 6 and torch.allclose(span.T @ span, torch.eye(6, dtype=torch.float64), atol=1e-9)
    offset = (row - honest.mean(0)).double()
    torch.testing.assert_close(span @ (span.T @ offset), offset, rtol=1e-4, atol=1e-5)
    # The random directions come from the round's generator: another draw, another search.
    again = attacks.build("optimal_search", rule=rule, grid=6, refine=2, directions=6, local=6)
    assert torch.equal(again.craft(honest, f=F, generator=gen())[0], row)


def test_optimal_search_finds_a_direction_the_seven_lines_miss() -> None:
    # Against the coordinate-wise median the best single row is not on any of optimal_mix's lines: the
    # search beyond them must move the rule strictly farther on some honest rows.
    gains = []
    for seed in range(4):
        honest = honest_rows(seed=seed)
        mix = attacks.build("optimal_mix", rule="median", grid=6, refine=2).craft(honest, f=F, generator=gen())[0]
        search = attacks.build("optimal_search", rule="median", grid=6, refine=2, directions=8, local=8)
        row = search.craft(honest, f=F, generator=gen(seed))[0]
        reached, by_mix = (rule_shift("median", F, honest, r.expand(F, -1)) for r in (row, mix))
        gains.append(reached / by_mix)
    assert min(gains) >= 1 - 1e-6 and max(gains) > 1.01, gains


def test_optimal_mix_with_identical_honest_rows_sends_them() -> None:
    honest = honest_rows(seed=1)[:1].expand(8, -1).contiguous()
    out = attacks.build("optimal_mix", rule="trimmed_mean", grid=3, refine=0).craft(honest, f=2, generator=gen())
    torch.testing.assert_close(out, honest[:2])


def test_simulation_tunes_an_attack_to_a_rule_of_the_users_own_not_to_the_name_it_stands_in_for() -> None:
    from experiments import study
    from experiments.adversary import attack_for
    from fedrobust.run_setup import build_aggregator

    mine = "tests.unit.test_study_arguments.CoordinateMedianOfAll"
    overrides = ["aggregator=mean", f"aggregator._target_={mine}", "aggregator.pre=bucketing", "attack=optimal_alie"]
    configs = study.compose({"plain": overrides, "memory": [*overrides, "+attack.params.memory=true",
                                                             "+aggregator.pre_params.bucketing.s=1"]})
    attack = attack_for(configs["plain"])
    # conf/attack's rule is aggregator.name, 'mean' here: the rule that runs is the user's, behind bucketing.
    assert attack.rule == f"bucketing+{mine}"  # type: ignore[union-attr]
    assert repr(attack._rule(F)) == repr(build_aggregator(configs["plain"]))  # type: ignore[union-attr]
    following = attack_for(configs["memory"])
    assert following.rule == f"bucketing+{mine}"  # type: ignore[union-attr]
    assert following.rule_pre_params == {"bucketing": {"s": 1}}  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"optimal_alie.*parameter 'rule' must be a rule that builds, got "
                                         r"'fr_no_such_pkg\.Rule': cannot import 'fr_no_such_pkg\.Rule'"):
        attacks.build("optimal_alie", rule="fr_no_such_pkg.Rule")
    # An attack tuned to a rule named in its own params keeps it.
    named = study.compose({"own": [*overrides, "attack.params.rule=krum"]})["own"]
    assert attack_for(named).rule == "krum"  # type: ignore[union-attr]
