"""Contract checks that every registered rule and pre-aggregator must pass.

In the manner of scikit-learn's estimator checks: one list of pipelines covering every registered
component, and one check per property, parametrized over that list. A component added to the
registry without an entry in RULE_PARAMS / PRE_PARAMS fails ``test_every_component_is_covered``.
A key ``name/variant`` checks the rule ``name`` once more with other parameters (another code path).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from fedrobust import aggregators

F = 1
RULE_PARAMS: dict[str, dict] = {
    "mean": {},
    "median": {},
    "trimmed_mean": {},
    "krum": {},
    "multikrum": {},
    "geometric_median": {},
    "centered_clipping": {"tau": 2.0},
    "bulyan": {},
    "dnc": {"niters": 3, "sub_dim": 20, "seed": 1},
    "signguard": {},
    "clipped_clustering": {},
    "foolsgold": {},
    "fltrust": {},
    "centered_clipping/auto": {"tau": "auto"},
}
PRE_PARAMS: dict[str, dict] = {
    "nnm": {},
    "bucketing": {"s": 2, "seed": 3},
    "clipping": {"threshold": 3.0},
    "arc": {},
    "winsorize": {},
    "direction": {},
    "dedup": {},
    "consistency": {},
    "dnc": {"sub_dim": 20, "niters": 2},
}
# Rules after a pre-aggregator: one distance-based and one coordinate-wise rule.
PIPELINES = [(rule, ()) for rule in RULE_PARAMS] + [(rule, (pre,)) for pre in PRE_PARAMS for rule in ("krum", "median")]
# Properties that hold for some pipelines only.
TRANSLATION_EQUIVARIANT = {"mean", "median", "trimmed_mean", "krum", "multikrum", "geometric_median", "bulyan", "dnc"}
# Keep translation equivariance; clipping, ARC and the direction filter (it reads norms) do not.
# The consistency filter drops nothing without the rows' clients (which these calls do not give).
AFFINE_PRES = {"nnm", "bucketing", "winsorize", "dnc", "dedup", "consistency"}
PERMUTATION_DEPENDENT_PRES = {"bucketing"}  # which rows share a bucket depends on the row order
# Rules whose state (a center, a generator) survives a call; the others must report an empty state.
STATEFUL = {"centered_clipping", "dnc"}


def rule_name(label: str) -> str:
    """The registered name behind a RULE_PARAMS key (``centered_clipping/auto`` -> ``centered_clipping``)."""
    return label.split("/")[0]


class WithServerUpdate(aggregators.Aggregator):
    """The set-up of rules that need the server's own update (FLTrust): before each call, a server update.

    The server here trains "like the clients": its update is the mean of the rows (non-finite entries
    read as 0, so that the non-finite checks still test the rows). It depends on the rows only as a set
    (permutation invariant), is the row itself when all rows are equal, and is the same for a half
    precision input and its float32 upcast: the properties of the suite hold with it.
    """

    def __call__(self, updates, weights=None):
        if isinstance(updates, torch.Tensor) and updates.dim() == 2 and updates.numel():
            self.set_server_update(updates.detach().double().nan_to_num(0.0, 0.0, 0.0).mean(dim=0))
        return super().__call__(updates, weights)


def make(rule: str, pres: tuple[str, ...] = (), f: int = F, **extra) -> aggregators.Aggregator:
    agg = aggregators.build(
        rule_name(rule), f=f, pre=[{"name": p, **PRE_PARAMS[p]} for p in pres], **{**RULE_PARAMS[rule], **extra}
    )
    return WithServerUpdate(agg.rule, agg.pre) if agg.needs_server_update else agg


def pipeline_id(case: tuple[str, tuple[str, ...]]) -> str:
    rule, pres = case
    return "+".join((*pres, rule))


def data(n: int, d: int = 64, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype)


def sample_size(agg: aggregators.Aggregator) -> int:
    return max(agg.min_n(), 9)


@pytest.fixture(params=PIPELINES, ids=pipeline_id)
def pipeline(request) -> tuple[str, tuple[str, ...]]:
    return request.param


@pytest.fixture(params=["numba", "torch"])
def backend(request, monkeypatch) -> str:
    """Run a check on the numba CPU kernels and on the pure-torch path used for other devices."""
    if request.param == "torch":
        monkeypatch.setenv("FEDROBUST_NUMBA", "0")
    return request.param


def test_every_component_is_covered():
    assert set(aggregators.names()) == {rule_name(label) for label in RULE_PARAMS}
    assert set(aggregators.pre_names()) == set(PRE_PARAMS)
    assert aggregators.names()[:3] == ["mean", "median", "trimmed_mean"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_shape_dtype_device_and_input_untouched(pipeline, dtype):
    agg = make(*pipeline)
    x = data(sample_size(agg), dtype=dtype)
    before = x.clone()
    out = agg(x)
    assert out.shape == (x.shape[1],)
    assert out.dtype == dtype
    assert out.device == x.device
    assert torch.isfinite(out).all()
    assert torch.equal(x, before)


def test_half_precision_is_reduced_in_float32(pipeline):
    """fp16/bf16 results match the float32 result on the same (upcast) values, up to output rounding."""
    for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)):
        x = data(sample_size(make(*pipeline)), dtype=dtype)
        got = make(*pipeline)(x).float()
        want = make(*pipeline)(x.float())
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_deterministic(pipeline, backend):
    x = data(sample_size(make(*pipeline)))
    assert torch.equal(make(*pipeline)(x), make(*pipeline)(x))


def test_chunked_equals_unchunked(pipeline, backend):
    x = data(sample_size(make(*pipeline)), d=300)
    whole = make(*pipeline)(x)
    chunked = make(*pipeline, chunk_size=7)(x)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)


def test_numba_and_torch_paths_agree(pipeline, monkeypatch):
    x = data(sample_size(make(*pipeline)), d=300)
    compiled = make(*pipeline)(x)
    monkeypatch.setenv("FEDROBUST_NUMBA", "0")
    torch.testing.assert_close(make(*pipeline)(x), compiled, rtol=1e-6, atol=1e-6)


def test_permutation_invariance(pipeline):
    _, pres = pipeline
    x = data(sample_size(make(*pipeline)), seed=1)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(5))
    a, b = make(*pipeline)(x), make(*pipeline)(x[perm])
    if PERMUTATION_DEPENDENT_PRES & set(pres):
        # With a fixed seed the same shuffle is drawn, so other rows share buckets: what holds is that
        # the result depends on which rows share a bucket, not on their order inside one. The seeded
        # shuffle sends input rows order[0] and order[1] to the first bucket: swapping them changes
        # nothing, while moving a row into another bucket does.
        s = PRE_PARAMS["bucketing"]["s"]
        shuffle = torch.Generator().manual_seed(PRE_PARAMS["bucketing"]["seed"])
        order = torch.randperm(x.shape[0], generator=shuffle).tolist()
        same_bucket, other_bucket = x.clone(), x.clone()
        same_bucket[[order[0], order[1]]] = x[[order[1], order[0]]]
        other_bucket[[order[0], order[s]]] = x[[order[s], order[0]]]
        torch.testing.assert_close(make(*pipeline)(same_bucket), a, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(make(*pipeline)(other_bucket), a)
        assert not torch.allclose(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bucketing_with_mean_is_order_free():
    """Equal buckets of s rows: the mean of the bucket means is the mean, whatever the shuffle."""
    x = data(12, seed=2)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    agg = aggregators.build("mean", pre=[{"name": "bucketing", "s": 3, "seed": 7}])
    torch.testing.assert_close(agg(x[perm]), x.mean(dim=0), rtol=1e-5, atol=1e-6)


def test_translation_equivariance(pipeline):
    rule, pres = pipeline
    if rule not in TRANSLATION_EQUIVARIANT or not set(pres) <= AFFINE_PRES:
        pytest.skip(f"{pipeline_id(pipeline)} is not translation equivariant")
    x = data(sample_size(make(*pipeline)), dtype=torch.float64, seed=3)
    shift = torch.linspace(-50.0, 80.0, x.shape[1], dtype=torch.float64)
    torch.testing.assert_close(make(*pipeline)(x + shift), make(*pipeline)(x) + shift, rtol=1e-9, atol=1e-9)


def test_identical_rows_give_that_row(pipeline):
    rule, pres = pipeline
    if rule_name(rule) == "centered_clipping" or {"clipping", "arc"} & set(pres):
        pytest.skip("clipping shrinks a row towards the center")
    agg = make(*pipeline)
    row = data(1, seed=4)[0]
    out = agg(row.expand(sample_size(agg), -1).contiguous())
    torch.testing.assert_close(out, row, rtol=1e-6, atol=1e-6)


def test_too_few_rows_raise_naming_rule_n_f_and_requirement(pipeline):
    rule = rule_name(pipeline[0])
    agg = make(*pipeline)
    n = agg.min_n()
    agg(data(n))  # the minimum is accepted
    if n == 1:
        pytest.skip(f"{pipeline_id(pipeline)} takes a single row: no smaller input to refuse")
    with pytest.raises(ValueError) as err:
        agg(data(n - 1))
    message = str(err.value)
    assert rule in message and f"n={n - 1}" in message and f"f={F}" in message
    assert re.search(r"requires n >= \S+", message) and f"n >= {n}" in message


@pytest.mark.parametrize(
    "bad",
    [
        torch.zeros(5),
        torch.zeros(2, 3, 4),
        torch.zeros(0, 8),
        torch.zeros(9, 0),
        torch.zeros(9, 8, dtype=torch.int64),
        [[0.0] * 8] * 9,
    ],
    ids=["1d", "3d", "no-rows", "no-columns", "int", "list"],
)
def test_invalid_input_raises_value_error_naming_rule(pipeline, bad):
    rule = rule_name(pipeline[0])
    with pytest.raises(ValueError, match=rule) as err:
        make(*pipeline)(bad)
    assert f"f={F}" in str(err.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises(pipeline, backend, value):
    rule = rule_name(pipeline[0])
    agg = make(*pipeline)
    x = data(sample_size(agg), d=40)
    x[1, 17] = value
    with pytest.raises(ValueError, match=rf"{rule}.*non-finite.*n={x.shape[0]}, f={F}"):
        agg(x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=str)
def test_non_finite_half_and_double_input_raises(pipeline, dtype):
    agg = make(*pipeline)
    x = data(sample_size(agg), d=40, dtype=dtype)
    x[-1, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        agg(x)


def test_unknown_names_and_parameters_list_the_valid_ones():
    with pytest.raises(ValueError, match=r"valid names: mean, median, trimmed_mean.*; or pre-aggregators and then a "
                                         r"rule joined with '\+'.*; or your own rule: a callable or a dotted path"):
        aggregators.build("medain")
    with pytest.raises(ValueError, match="valid names: nnm, bucketing, clipping, arc"):
        aggregators.build("mean", pre=["nmm"])
    with pytest.raises(ValueError, match=r"krum: unknown parameter.*tua.*valid parameters: chunk_size"):
        aggregators.build("krum", f=1, tua=3)
    with pytest.raises(ValueError, match=r"bucketing: unknown parameter.*size.*valid parameters: s, seed"):
        aggregators.build("mean", pre=[{"name": "bucketing", "size": 2}])
    with pytest.raises(ValueError, match=r"clipping: missing required parameter.*threshold"):
        aggregators.build("mean", pre=["clipping"])


def test_a_pre_list_written_as_one_string_says_how_to_write_it():
    with pytest.raises(ValueError, match=r"unknown pre-aggregator 'clipping,nnm': give the stages as a list, e\.g\. "
                                         r"pre=\['clipping', 'nnm'\]"):
        aggregators.build("krum", f=1, pre="clipping,nnm")
    with pytest.raises(ValueError, match=r"pre=\['winsorize', 'nnm'\]"):
        aggregators.build("krum", f=1, pre="winsorize+nnm")
    # A list is the caller's own: it may repeat a stage, with its parameters or others.
    clip = {"name": "clipping", "threshold": 5.0}
    twice = aggregators.build("mean", pre=[clip, "nnm", {**clip, "threshold": 2.0}, "nnm"])
    assert [p.name for p in twice.pre] == ["clipping", "nnm", "clipping", "nnm"]


def test_a_pipeline_name_builds_its_stages_in_order():
    x = data(12, d=40, dtype=torch.float32)
    joined = aggregators.build("winsorize+nnm+trimmed_mean", f=2)
    listed = aggregators.build("trimmed_mean", f=2, pre=["winsorize", "nnm"])
    assert [p.name for p in joined.pre] == ["winsorize", "nnm"] and joined.label == listed.label
    torch.testing.assert_close(joined(x), listed(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="unknown pre-aggregator 'nmm'; valid names: nnm"):
        aggregators.build("nmm+krum")
    with pytest.raises(ValueError, match="unknown aggregation rule 'krumm'"):
        aggregators.build("nnm+krumm")
    with pytest.raises(ValueError, match=r"names its pre-aggregators itself.*'clipping\+nnm\+krum'"):
        aggregators.build("nnm+krum", pre=[{"name": "clipping", "threshold": 1.0}])


@pytest.mark.parametrize("name", list(RULE_PARAMS))
def test_negative_or_non_integer_f_raises(name):
    for f in (-1, 1.5, True):
        with pytest.raises(ValueError, match=rf"{rule_name(name)}: f must be an integer >= 0"):
            aggregators.build(rule_name(name), f=f, **RULE_PARAMS[name])


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("geometric_median", {"iterations": 0}),
        ("geometric_median", {"eps": 0.0}),
        ("centered_clipping", {"tau": -1.0}),
        ("centered_clipping", {"tau": float("inf")}),
        ("centered_clipping", {"tau": "automatic"}),
        ("centered_clipping", {"tau": "auto", "radius_quantile": 0.0}),
        ("centered_clipping", {"radius_quantile": 0.5}),
        ("dnc", {"niters": 0}),
        ("dnc", {"sub_dim": 0}),
        ("dnc", {"c": -1.0}),
        ("dnc", {"seed": -1}),
        ("signguard", {"lower": 1.5}),
        ("signguard", {"upper": 0.5}),
        ("signguard", {"min_gap": -0.1}),
        ("foolsgold", {"confidence": 0.0}),
        ("multikrum", {"m": 0}),
        ("trimmed_mean", {"trim": -1}),
        ("trimmed_mean", {"trim": 1.5}),
        ("mean", {"max_weight_fraction": 1.5}),
        ("krum", {"chunk_size": 0}),
    ],
)
def test_invalid_parameter_values_raise(name, params):
    with pytest.raises(ValueError, match=rf"{name}: parameter {list(params)[-1]}"):
        aggregators.build(name, f=1, **params)


def test_min_n_of_each_rule():
    expected = {
        "mean": 1,
        "median": 2 * F + 1,
        "trimmed_mean": 2 * F + 1,
        "krum": 2 * F + 3,
        "multikrum": 2 * F + 3,
        "geometric_median": 2 * F + 1,
        "centered_clipping": 2 * F + 1,
        "bulyan": 4 * F + 3,
        "dnc": 2 * F + 1,
        "signguard": 2 * F + 1,
        "clipped_clustering": 2 * F + 1,
        "foolsgold": 2 * F + 1,
        "fltrust": 1,
        "centered_clipping/auto": 2 * F + 1,
    }
    assert {name: make(name).min_n() for name in RULE_PARAMS} == expected
    assert aggregators.build("multikrum", f=1, m=9).min_n() == 9
    assert aggregators.build("trimmed_mean", f=2, trim=1).min_n() == 5
    assert aggregators.build("trimmed_mean", f=1, trim=3).min_n() == 7
    assert aggregators.build("mean", max_weight_fraction=0.3).min_n() == 4
    # DnC drops floor(c * f) rows per iteration and needs one more row than that.
    assert aggregators.build("dnc", f=2, c=3.0).min_n() == 7
    assert aggregators.build("dnc", f=2, c=2.4).min_n() == 5


def test_min_n_accounts_for_bucketing():
    agg = aggregators.build("krum", f=1, pre=[{"name": "bucketing", "s": 2}])
    assert agg.min_n() == 9  # ceil(9 / 2) = 5 = 2f+3 buckets
    with pytest.raises(ValueError, match=r"krum requires n >= 2f\+3 on the 4 rows left"):
        agg(data(8))


def test_weights_only_where_supported():
    x = data(6)
    with pytest.raises(ValueError, match=r"krum.*weights are not supported"):
        aggregators.build("krum", f=1)(x, torch.ones(6))
    with pytest.raises(ValueError, match=r"mean \(after bucketing\).*weights are not supported"):
        aggregators.build("mean", pre=["bucketing"])(x, torch.ones(6))
    assert aggregators.build("mean").supports_weights
    assert aggregators.build("mean", pre=["nnm"]).supports_weights
    assert not aggregators.build("median").supports_weights


@pytest.mark.parametrize(
    "weights",
    [
        torch.ones(5),
        torch.ones(6, 1),
        torch.tensor([1.0, -1, 1, 1, 1, 1]),
        torch.zeros(6),
        torch.tensor([1.0, float("nan"), 1, 1, 1, 1]),
    ],
    ids=["short", "2d", "negative", "zero-sum", "nan"],
)
def test_bad_weights_raise(weights):
    with pytest.raises(ValueError, match="mean: weights"):
        aggregators.build("mean")(data(6), weights)


def test_state_is_empty_for_stateless_pipelines(pipeline):
    rule, pres = pipeline
    agg = make(*pipeline)
    agg(data(sample_size(agg)))
    state = agg.state_dict()
    stateful = STATEFUL & {rule_name(rule)} or {"bucketing", "dnc", "direction"} & set(pres)
    assert bool(state) == bool(stateful)
    assert all(isinstance(v, torch.Tensor) for v in state.values())


def test_state_round_trip_resumes_exactly(pipeline):
    """Checkpoint after one call, restore into a fresh aggregator: the next calls agree bitwise."""
    agg = make(*pipeline)
    n = sample_size(agg)
    agg(data(n, seed=10))
    restored = make(*pipeline)
    restored.load_state_dict(agg.state_dict())
    for seed in (11, 12):
        x = data(n, seed=seed)
        assert torch.equal(agg(x), restored(x))


def test_load_state_rejects_unknown_keys():
    with pytest.raises(ValueError, match="centered_clipping: unknown state keys"):
        aggregators.build("centered_clipping").load_state_dict({"centre": torch.zeros(3)})
    with pytest.raises(ValueError, match="krum: stateless"):
        aggregators.build("krum").load_state_dict({"center": torch.zeros(3)})
    with pytest.raises(ValueError, match="non-finite"):
        aggregators.build("centered_clipping").load_state_dict({"center": torch.tensor([np.nan])})


def test_centered_clipping_rejects_a_changed_model_size():
    agg = aggregators.build("centered_clipping", tau=1.0)
    agg(data(3, d=10))
    with pytest.raises(ValueError, match=r"centered_clipping: the center has 10 coordinates but .*d=12"):
        agg(data(3, d=12))


def test_requires_grad_input_is_accepted():
    x = data(7).requires_grad_()
    out = aggregators.build("krum", f=1)(x)
    assert not out.requires_grad
