"""Agreement with straightforward float64 references, robustness, and numerical properties."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedrobust import aggregators
from fedrobust.aggregators.pre import AdaptiveRobustClipping, Bucketing, Clipping, NearestNeighborMixing
from fedrobust.aggregators.rows import Basis, Rows

SETTINGS = settings(max_examples=30, deadline=None)


@st.composite
def matrices(draw, min_n: int = 1, max_n: int = 14, max_d: int = 40, f: int | None = None):
    """``(x, f)``: a float64 numpy matrix with ties and outliers likely, and an ``f`` it admits."""
    n = draw(st.integers(min_n, max_n))
    d = draw(st.integers(1, max_d))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["normal", "integers", "outliers"]))
    if kind == "normal":
        x = rng.standard_normal((n, d))
    elif kind == "integers":  # many exact ties
        x = rng.integers(-3, 4, size=(n, d)).astype(np.float64)
    else:
        x = rng.standard_normal((n, d))
        x[rng.random((n, d)) < 0.2] *= 1e6
    if f is None:
        f = draw(st.integers(0, (n - 1) // 2))
    return x, f


def reference_trimmed_mean(x: np.ndarray, f: int) -> np.ndarray:
    return np.sort(x, axis=0)[f : x.shape[0] - f].mean(axis=0)


def reference_krum_scores(x: np.ndarray, f: int) -> np.ndarray:
    n = x.shape[0]
    dist = ((x[:, None, :] - x[None, :, :]) ** 2).sum(axis=-1)
    k = n - f - 2
    return np.array([np.sort(np.delete(dist[i], i))[:k].sum() for i in range(n)])


def has_clear_order(scores: np.ndarray, count: int) -> bool:
    """The ``count`` lowest scores are separated from the rest (so rounding cannot swap them)."""
    s = np.sort(scores)
    return count == len(s) or s[count] - s[count - 1] > 1e-6 * max(1.0, abs(s[count]))


def to_tensor(x: np.ndarray, dtype=torch.float64) -> torch.Tensor:
    return torch.from_numpy(x).to(dtype)


@pytest.fixture(params=["numba", "torch"])
def backend(request, monkeypatch) -> str:
    if request.param == "torch":
        monkeypatch.setenv("FEDROBUST_NUMBA", "0")
    return request.param


# --------------------------------------------------------------------------- coordinate-wise rules


@SETTINGS
@given(matrices())
def test_median_matches_numpy(case):
    x, _ = case
    for dtype in (torch.float64, torch.float32):
        got = aggregators.build("median")(to_tensor(x, dtype)).double().numpy()
        want = np.median(x.astype(np.float32) if dtype == torch.float32 else x, axis=0)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


@SETTINGS
@given(matrices())
def test_trimmed_mean_matches_sort_and_drop(case):
    x, f = case
    got = aggregators.build("trimmed_mean", f=f)(to_tensor(x)).numpy()
    np.testing.assert_allclose(got, reference_trimmed_mean(x, f), rtol=1e-12, atol=1e-9)


def test_torch_path_matches_references(monkeypatch):
    monkeypatch.setenv("FEDROBUST_NUMBA", "0")
    x = np.random.default_rng(0).standard_normal((12, 50))
    np.testing.assert_allclose(aggregators.build("median")(to_tensor(x)).numpy(), np.median(x, axis=0))
    np.testing.assert_allclose(
        aggregators.build("trimmed_mean", f=3)(to_tensor(x)).numpy(), reference_trimmed_mean(x, 3), rtol=1e-12
    )


@pytest.mark.parametrize("trim", [0, 1, 2, 4, 5])
def test_trimmed_mean_cuts_trim_values_at_each_end(trim, backend):
    x = np.random.default_rng(trim).standard_normal((13, 300))
    got = aggregators.build("trimmed_mean", f=3, trim=trim)(to_tensor(x)).numpy()
    np.testing.assert_allclose(got, reference_trimmed_mean(x, trim), rtol=1e-12, atol=1e-12)


def test_trimmed_mean_trim_defaults_to_f(backend):
    x = torch.randn(11, 500, dtype=torch.float64)
    assert torch.equal(aggregators.build("trimmed_mean", f=3)(x), aggregators.build("trimmed_mean", f=3, trim=3)(x))


def test_trimmed_mean_with_f_zero_is_the_mean(backend):
    x = torch.randn(9, 1000, dtype=torch.float64)
    torch.testing.assert_close(aggregators.build("trimmed_mean", f=0)(x), x.mean(dim=0))


def test_trimmed_mean_keeps_honest_values_next_to_huge_ones(backend):
    """Summing the kept values (not total minus extremes) keeps honest digits next to 1e30 outliers."""
    x = torch.tensor([[1.0, 2.0], [2.0, 3.0], [3.0, 4.0], [1e30, -1e30], [-1e30, 1e30]])
    torch.testing.assert_close(aggregators.build("trimmed_mean", f=2)(x), torch.tensor([2.0, 3.0]))


# --------------------------------------------------------------------------- Krum family


@SETTINGS
@given(matrices(min_n=3, max_n=14, f=None))
def test_krum_matches_brute_force_scores(case):
    x, f = case
    n = x.shape[0]
    f = min(f, (n - 3) // 2)
    scores = reference_krum_scores(x, f)
    if not has_clear_order(scores, 1):
        return
    got = aggregators.build("krum", f=f)(to_tensor(x)).numpy()
    np.testing.assert_array_equal(got, x[np.argmin(scores)])


@SETTINGS
@given(matrices(min_n=3, max_n=14), st.data())
def test_multikrum_matches_brute_force(case, draw):
    x, f = case
    n = x.shape[0]
    f = min(f, (n - 3) // 2)
    m = draw.draw(st.one_of(st.none(), st.integers(1, n)))
    count = n - f if m is None else m
    scores = reference_krum_scores(x, f)
    if not has_clear_order(scores, count):
        return
    want = x[np.argsort(scores, kind="stable")[:count]].mean(axis=0)
    got = aggregators.build("multikrum", f=f, m=m)(to_tensor(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(x).max())


def test_multikrum_with_all_rows_and_f_zero_is_the_mean():
    x = torch.randn(8, 500, dtype=torch.float64)
    torch.testing.assert_close(aggregators.build("multikrum", f=0, m=8)(x), x.mean(dim=0))


def reference_bulyan(x: np.ndarray, f: int) -> np.ndarray:
    n = x.shape[0]
    dist = ((x[:, None, :] - x[None, :, :]) ** 2).sum(axis=-1)
    remaining, selected = list(range(n)), []
    for _ in range(n - 2 * f):
        sub = dist[np.ix_(remaining, remaining)]
        r = len(remaining)
        k = min(max(r - f - 2, 1), r - 1)
        scores = [np.sort(np.delete(sub[i], i))[:k].sum() for i in range(r)] if r > 1 else [0.0]
        # Ties (systematic with one neighbour) go to the smaller total distance, then the lower index.
        selected.append(remaining.pop(int(np.lexsort((np.arange(r), sub.sum(axis=1), scores))[0])))
    chosen = np.sort(x[sorted(selected)], axis=0)
    theta, beta = len(selected), len(selected) - 2 * f
    median = 0.5 * (chosen[(theta - 1) // 2] + chosen[theta // 2])
    out = np.empty(x.shape[1])
    for j in range(x.shape[1]):
        costs = [max(median[j] - chosen[s, j], chosen[s + beta - 1, j] - median[j]) for s in range(theta - beta + 1)]
        s = int(np.argmin(costs))
        out[j] = chosen[s : s + beta, j].mean()
    return out


@SETTINGS
@given(matrices(min_n=3, max_n=15, max_d=12))
def test_bulyan_matches_reference(case):
    x, f = case
    f = min(f, (x.shape[0] - 3) // 4)
    x = x + np.random.default_rng(x.shape[0]).standard_normal(x.shape) * 1e-3  # no exact score ties
    for backend in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FEDROBUST_NUMBA", backend)
            got = aggregators.build("bulyan", f=f)(to_tensor(x)).numpy()
        np.testing.assert_allclose(got, reference_bulyan(x, f), rtol=1e-9, atol=1e-9 * np.abs(x).max())


# --------------------------------------------------------------------------- iterative rules


def test_geometric_median_minimizes_the_sum_of_distances():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((9, 30))
    x[:2] += 20.0
    z = aggregators.build("geometric_median", f=2, iterations=500, tolerance=1e-14)(to_tensor(x)).numpy()
    objective = lambda y: np.linalg.norm(x - y, axis=1).sum()  # noqa: E731
    # Optimality: the gradient of the objective vanishes at z (no row coincides with z here).
    unit = (z - x) / np.linalg.norm(z - x, axis=1, keepdims=True)
    assert np.linalg.norm(unit.sum(axis=0)) < 1e-6
    assert objective(z) <= min(objective(x.mean(axis=0)), min(objective(row) for row in x))


def reference_centered_clipping(x: np.ndarray, center: np.ndarray, tau: float, iterations: int) -> np.ndarray:
    v = center.copy()
    for _ in range(iterations):
        diff = x - v
        norms = np.linalg.norm(diff, axis=1, keepdims=True)
        v = v + (diff * np.minimum(1.0, tau / norms)).mean(axis=0)
    return v


def test_centered_clipping_matches_reference_over_calls():
    rng = np.random.default_rng(2)
    agg = aggregators.build("centered_clipping", f=1, tau=1.5, iterations=3)
    center = np.zeros(20)
    for _ in range(3):
        x = rng.standard_normal((7, 20)) + 2.0
        center = reference_centered_clipping(x, center, 1.5, 3)
        np.testing.assert_allclose(agg(to_tensor(x)).numpy(), center, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(agg.state_dict()["center"].numpy(), center, rtol=1e-10)


def test_centered_clipping_with_a_large_radius_is_the_mean():
    x = torch.randn(6, 100, dtype=torch.float64)
    torch.testing.assert_close(aggregators.build("centered_clipping", tau=1e9)(x), x.mean(dim=0))


# --------------------------------------------------------------------------- pre-aggregators


def apply_pre(pre, x: torch.Tensor) -> torch.Tensor:
    basis = Basis(x, augmented=not pre.affine, chunk_size=None, owner="test", f=pre.f)
    return torch.cat([chunk for _, _, chunk in pre.apply(Rows(basis)).chunks()], dim=1)


def test_nnm_matches_reference():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((9, 15))
    f = 3
    dist = ((x[:, None] - x[None]) ** 2).sum(-1)
    want = np.stack([x[np.argsort(dist[i], kind="stable")[: 9 - f]].mean(axis=0) for i in range(9)])
    np.testing.assert_allclose(apply_pre(NearestNeighborMixing(f), to_tensor(x)).numpy(), want, rtol=1e-10)


def test_bucketing_partitions_rows():
    x = torch.randn(7, 10, dtype=torch.float64)
    out = apply_pre(Bucketing(0, s=1, seed=4), x)  # buckets of one: a permutation of the rows
    assert sorted(map(tuple, out.tolist())) == sorted(map(tuple, x.tolist()))
    out = apply_pre(Bucketing(0, s=3, seed=4), x)  # sizes 3, 3, 1 in shuffled order
    assert out.shape == (3, 10)
    torch.testing.assert_close(3 * out[0] + 3 * out[1] + out[2], x.sum(dim=0))
    again = apply_pre(Bucketing(0, s=3, seed=4), x)
    assert torch.equal(out, again)  # same seed, same first shuffle
    other = apply_pre(Bucketing(0, s=3, seed=5), x)
    assert not torch.equal(out, other)


def test_bucketing_draws_a_new_shuffle_each_call():
    pre = Bucketing(0, s=2, seed=0)
    x = torch.randn(10, 4, dtype=torch.float64)
    shuffles = {tuple(apply_pre(pre, x)[:, 0].tolist()) for _ in range(5)}
    assert len(shuffles) > 1


def test_clipping_caps_norms_and_keeps_directions():
    x = torch.randn(6, 20, dtype=torch.float64) * torch.tensor([0.1, 1, 5, 10, 0.5, 50], dtype=torch.float64)[:, None]
    out = apply_pre(Clipping(0, threshold=2.0), x)
    norms = x.norm(dim=1)
    want = x * (2.0 / norms).clamp(max=1.0)[:, None]
    torch.testing.assert_close(out, want)


def test_arc_clips_the_k_largest_to_the_next_norm():
    n, f = 10, 3
    k = int(2 * (f / n) * (n - f))  # floor(2 * 0.3 * 7) = 4
    scales = torch.tensor([1.0, 2, 3, 4, 5, 6, 7, 8, 9, 10], dtype=torch.float64)
    x = torch.randn(n, 30, dtype=torch.float64)
    x = x / x.norm(dim=1, keepdim=True) * scales[:, None]
    out = apply_pre(AdaptiveRobustClipping(f), x)
    torch.testing.assert_close(out.norm(dim=1), scales.clamp(max=scales.sort(descending=True).values[k]))
    torch.testing.assert_close(out[: n - k], x[: n - k])


def test_arc_with_f_zero_is_the_identity():
    x = torch.randn(5, 8, dtype=torch.float64)
    assert torch.equal(apply_pre(AdaptiveRobustClipping(0), x), x)


# --------------------------------------------------------------------------- weights


def test_weighted_mean_and_cap():
    x = torch.randn(5, 40, dtype=torch.float64)
    w = torch.tensor([1.0, 1, 1, 1, 96])
    torch.testing.assert_close(aggregators.build("mean")(x, w), (w.double() / w.sum()) @ x)
    capped = aggregators.build("mean", max_weight_fraction=0.4)(x, w)
    share = torch.tensor([0.15, 0.15, 0.15, 0.15, 0.4], dtype=torch.float64)
    torch.testing.assert_close(capped, share @ x)


def test_infeasible_cap_raises():
    agg = aggregators.build("mean", max_weight_fraction=0.3)
    with pytest.raises(ValueError, match=r"mean: max_weight_fraction=0.3 cannot be met by 3 rows.*n=5, f=0"):
        agg(torch.randn(5, 4), torch.tensor([1.0, 1, 1, 0, 0]))


# --------------------------------------------------------------------------- robustness


def attacked(n: int, f: int, d: int, kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, honest)``: ``n - f`` honest rows around 1 and ``f`` Byzantine rows of the given kind."""
    g = torch.Generator().manual_seed(seed)
    honest = 1.0 + 0.1 * torch.randn(n - f, d, generator=g, dtype=torch.float64)
    if kind == "huge":
        byz = 1e6 * torch.randn(f, d, generator=g, dtype=torch.float64)
    elif kind == "sign_flip":
        byz = -10.0 * honest[:f]
    else:  # "collude": all Byzantine rows at one point just outside the honest cloud
        byz = (honest.mean(0) + 3 * honest.std(0)).expand(f, d)
    return torch.cat([byz, honest]), honest


KINDS = ["huge", "sign_flip", "collude"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["median", "trimmed_mean", "bulyan"])
def test_coordinate_rules_stay_in_the_honest_range(name, kind, backend):
    f = 3
    x, honest = attacked(4 * f + 3, f, 50, kind)
    out = aggregators.build(name, f=f)(x)
    assert (out >= honest.min(0).values - 1e-12).all() and (out <= honest.max(0).values + 1e-12).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pre", [(), ("nnm",)])
def test_krum_selects_an_honest_row(kind, pre):
    f = 3
    x, honest = attacked(2 * f + 3 + 2, f, 50, kind)
    out = aggregators.build("krum", f=f, pre=list(pre))(x)
    if pre:
        # After NNM each row is a mix; the selected one must be close to the honest cloud.
        assert (out - honest.mean(0)).norm() < 3 * (honest - honest.mean(0)).norm(dim=1).max()
    else:
        assert any(torch.equal(out, row) for row in honest)


@pytest.mark.parametrize("kind", KINDS)
def test_multikrum_averages_honest_rows(kind):
    f = 3
    x, honest = attacked(2 * f + 3 + 2, f, 50, kind)
    out = aggregators.build("multikrum", f=f, m=5)(x)
    assert (out - honest.mean(0)).norm() < (honest - honest.mean(0)).norm(dim=1).max()


@pytest.mark.parametrize("kind", KINDS)
def test_geometric_median_stays_near_the_honest_mean(kind):
    f = 4
    x, honest = attacked(2 * f + 3, f, 50, kind)
    out = aggregators.build("geometric_median", f=f)(x)
    spread = (honest - honest.mean(0)).norm(dim=1).max()
    assert (out - honest.mean(0)).norm() < 2 * spread


def test_centered_clipping_bounds_each_rows_pull():
    f, tau = 2, 0.5
    x, honest = attacked(7, f, 50, "huge")
    agg = aggregators.build("centered_clipping", f=f, tau=tau)
    agg.load_state_dict({"center": honest.mean(0)})
    out = agg(x)
    assert (out - honest.mean(0)).norm() <= tau + 1e-9  # every row moves the center by at most tau/n


# --------------------------------------------------------------------------- offsets and precision


def grid_data(n: int, d: int, seed: int) -> torch.Tensor:
    """Float32 values on a 1/16 grid in [-8, 8]: x and x + 1e4 are both exact in float32."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g) * 2).clamp(-8, 8).mul(16).round().div(16)


@pytest.mark.parametrize("seed", range(3))
def test_distances_do_not_change_with_a_constant_offset(seed):
    """The centered Gram matrix makes the distance matrix bitwise identical after a shift."""
    x = grid_data(11, 2000, seed)
    dist = lambda y: Rows(Basis(y, owner="test", f=0)).sq_distances()  # noqa: E731
    assert torch.equal(dist(x), dist(x + 1e4))
    # The textbook |a|^2 + |b|^2 - 2<a, b> in float32 loses these distances entirely.
    y = x + 1e4
    norms = (y * y).sum(1)
    naive = norms[:, None] + norms[None, :] - 2 * y @ y.T
    assert not torch.allclose(naive.double(), dist(x), rtol=1e-2)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("name", "pre"), [("krum", ()), ("multikrum", ()), ("bulyan", ()), ("krum", ("nnm",))])
def test_selection_is_unchanged_by_a_constant_offset(name, pre, seed):
    f = 2
    x = grid_data(4 * f + 3, 500, seed)
    x[:f] += 3.0  # Byzantine rows a little apart, so the selection is not trivial
    base = aggregators.build(name, f=f, pre=list(pre))(x)
    shifted = aggregators.build(name, f=f, pre=list(pre))(x + 1e4) - 1e4
    if name == "krum" and not pre:
        assert torch.equal(shifted, base)
    else:
        # Only rounding of the shifted inputs' mean remains (ulp(1e4) ~ 1e-3); a different
        # selection would move some coordinate by >= 1/16 / 9.
        torch.testing.assert_close(shifted, base, rtol=0, atol=4e-3)


@pytest.mark.parametrize("bounded", [False, True], ids=["plain", "winsorized"])
def test_reused_chunks_hold_the_same_values_in_one_storage(bounded: bool) -> None:
    """A pass's chunks with ``reuse``: the values of fresh chunks, written into one storage (no page
    faults per chunk), for mixed rows read through winsorizing bounds too."""
    x = torch.randn(12, 3000)
    bounds = torch.stack([torch.full((3000,), -0.5), torch.full((3000,), 0.7)]) if bounded else None
    rows = Rows(Basis(x, chunk_size=700, bounds=bounds, owner="test", f=2), mix=torch.rand(12, 12))
    fresh = [(start, stop, chunk.clone()) for start, stop, chunk in rows.chunks()]
    reused, held = [], []
    for start, stop, chunk in rows.chunks(reuse=True):
        held.append(chunk)  # kept alive: fresh chunks could not share an address
        reused.append((start, stop, chunk.clone()))
    assert [(a, b) for a, b, _ in reused] == [(a, b) for a, b, _ in fresh] and len(fresh) == 5
    for (_, _, want), (_, _, got) in zip(fresh, reused, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len({chunk.untyped_storage().data_ptr() for chunk in held}) == 1
    expected = (rows.mix @ (x.clamp(bounds[0], bounds[1]) if bounded else x))
    torch.testing.assert_close(torch.cat([c for _, _, c in fresh], dim=1), expected)
