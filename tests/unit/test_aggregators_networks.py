"""Comparator networks: exhaustive checks by the 0-1 principle, and the kernels on awkward layouts."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from fedrobust import aggregators
from fedrobust.aggregators._networks import sorting_network, window_network
from fedrobust.aggregators._order import numba_kernels


def run(network: tuple[np.ndarray, np.ndarray], values: np.ndarray) -> np.ndarray:
    """Apply a network to a batch ``[m, batch]`` of columns."""
    v = values.copy()
    for a, b in zip(*network, strict=True):
        lo, hi = np.minimum(v[a], v[b]), np.maximum(v[a], v[b])
        v[a], v[b] = lo, hi
    return v


def all_binary(m: int) -> np.ndarray:
    return np.array(list(itertools.product((0, 1), repeat=m)), dtype=np.int8).T


@pytest.mark.parametrize("m", range(1, 13))
def test_sorting_network_sorts_every_binary_input(m):
    """0-1 principle: a comparator network sorts all inputs iff it sorts all 0/1 inputs."""
    values = all_binary(m)
    assert (np.diff(run(sorting_network(m), values), axis=0) >= 0).all()


@pytest.mark.parametrize("m", range(1, 13))
def test_window_networks_hold_the_window_multiset(m):
    values = all_binary(m)
    want = np.sort(values, axis=0)
    windows = {(k, m - k) for k in range((m + 1) // 2)} | {((m - 1) // 2, m // 2 + 1), (m // 2, m // 2 + 1)}
    for lo, hi in windows:
        if lo >= hi or hi > m:
            continue
        got = np.sort(run(window_network(m, lo, hi), values)[lo:hi], axis=0)
        np.testing.assert_array_equal(got, want[lo:hi], err_msg=f"m={m} window=[{lo}, {hi})")


@pytest.mark.parametrize("m", [20, 31, 50])
def test_window_networks_on_random_values(m):
    values = np.random.default_rng(m).standard_normal((m, 2000))
    want = np.sort(values, axis=0)
    for lo, hi in [(m // 4, m - m // 4), ((m - 1) // 2, m // 2 + 1)]:
        got = np.sort(run(window_network(m, lo, hi), values)[lo:hi], axis=0)
        np.testing.assert_array_equal(got, want[lo:hi])


def test_pruning_pays_off():
    full = len(sorting_network(20)[0])
    assert len(window_network(20, 9, 11)[0]) < full
    assert len(window_network(20, 1, 19)[0]) < full // 2


def test_kernel_reads_column_ranges_and_row_subsets():
    kernels = numba_kernels(torch.device("cpu"))
    assert kernels is not None
    x = np.random.default_rng(0).standard_normal((9, 5000)).astype(np.float32)
    rows = np.array([8, 0, 5, 2, 7], dtype=np.int64)
    out = np.empty(4000, np.float32)
    a, b = window_network(5, 2, 3)
    # Columns 3 .. 4002: neither the start nor the length is aligned to a block.
    assert kernels.launch(kernels.window_mean, x.ravel(), 5000, 3, out, rows, a, b, 2, 3, kernels.block_size(5, 4))
    np.testing.assert_array_equal(out, np.median(x[rows, 3:4003], axis=0))
    x[5, 100] = np.nan
    assert not kernels.launch(kernels.window_mean, x.ravel(), 5000, 3, out, rows, a, b, 2, 3, 64)


@pytest.mark.parametrize(("m", "lo", "hi"), [(5, 1, 4), (20, 4, 16), (50, 11, 39), (7, 0, 7)])
def test_window_bounds_kernel_gives_the_window_s_smallest_and_largest(m: int, lo: int, hi: int) -> None:
    """Winsorizing's bounds: sorted positions lo and hi - 1 of each column, from one network pass."""
    kernels = numba_kernels(torch.device("cpu"))
    assert kernels is not None
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m + 3, 5000)).astype(np.float32)
    x[:, 10] = 1.0  # ties
    rows = rng.permutation(m + 3)[:m].astype(np.int64)
    out = np.empty((4000, 2), np.float32)
    a, b = window_network(m, lo, hi)
    assert kernels.launch(kernels.window_bounds, x.ravel(), 5000, 3, out, rows, a, b, lo, hi, kernels.block_size(m, 4))
    ordered = np.sort(x[rows, 3:4003], axis=0)
    np.testing.assert_array_equal(out[:, 0], ordered[lo])
    np.testing.assert_array_equal(out[:, 1], ordered[hi - 1])
    x[rows[0], 100] = np.inf
    assert not kernels.launch(kernels.window_bounds, x.ravel(), 5000, 3, out, rows, a, b, lo, hi, 64)


def test_load_kernels_says_which_devices_the_compiled_kernels_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    from fedrobust import aggregators

    assert aggregators.load_kernels("cpu") is True
    assert aggregators.load_kernels("meta") is False
    monkeypatch.setenv("FEDROBUST_NUMBA", "0")  # the torch path chosen on the CPU too
    assert aggregators.load_kernels("cpu") is False


def test_importing_the_rules_leaves_scipy_out() -> None:
    """Every simulated client and ServerApp imports the rules; only ClippedClustering needs scipy.cluster
    (about 0.35 s of CPU to import), so it imports it when it runs."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from fedrobust import aggregators\n"
        "before = 'scipy' in sys.modules\n"
        "aggregators.build('clipped_clustering', f=1)(torch.randn(6, 10))\n"
        "print(before, 'scipy.cluster' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False True", done.stdout


@pytest.fixture
def threads() -> Iterator[Callable[[int], None]]:
    """Set torch's thread count for the test; restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


# Every rule but FLTrust (it needs the server's own update), pipelines, and each pre-aggregator in front of
# the trimmed mean. On an Intel Xeon with 16 cores, MKL's gemv made the mean, Multi-Krum, the geometric
# median and five more rules differ in their last bits between one thread and three (not on an AMD EPYC).
_KERNEL_RULES = {"trimmed_mean", "median", "krum", "geometric_median", "winsorize+nnm+trimmed_mean"}
_PRE_PARAMS: dict[str, dict[str, float]] = {"clipping": {"threshold": 1.0}}
_THREAD_CASES = [(rule, ()) for rule in aggregators.names() if rule != "fltrust"] + [
    (pipeline, ()) for pipeline in (
        "winsorize+nnm+trimmed_mean", "consistency+direction+dedup+winsorize+nnm+trimmed_mean", "arc+nnm+median",
        "nnm+geometric_median",
    )
] + [("trimmed_mean", ({"name": pre, **_PRE_PARAMS.get(pre, {})},)) for pre in aggregators.pre_names()]


@pytest.mark.parametrize(("rule", "pre"), _THREAD_CASES, ids=[f"{r}{''.join('-' + p['name'] for p in pre)}"
                                                                 for r, pre in _THREAD_CASES])
def test_rules_give_the_same_bytes_on_one_thread_and_on_several(rule: str, pre: tuple, threads, monkeypatch) -> None:
    from fedrobust.aggregators import _kernels  # compiles or loads the kernels: only in the tests that run them

    # 50 rows: each 8 MiB column span is narrower than a threaded launch, so only a launch over all the
    # columns uses the threads. Wide enough for several spans of the Gram matrix.
    x = torch.randn(50, 300_000, generator=torch.Generator().manual_seed(3))
    threads(1)
    one = aggregators.build(rule, f=4, pre=pre)(x)
    requested: list[int] = []
    real_pool = _kernels.pool

    def recording_pool(count: int):
        requested.append(count)
        return real_pool(count)

    monkeypatch.setattr(_kernels, "pool", recording_pool)
    threads(3)
    several = aggregators.build(rule, f=4, pre=pre)(x)
    assert set(requested) <= {3}  # the kernels did use the pool of three threads
    assert requested or pre or rule not in _KERNEL_RULES, "the compiled kernels were not run"
    assert torch.equal(one, several)
    threads(16)  # more threads than this machine may have cores: MKL splits its work differently again
    assert torch.equal(one, aggregators.build(rule, f=4, pre=pre)(x))


@pytest.mark.parametrize("clamp", [False, True], ids=["plain", "winsorized"])
def test_gram_over_many_blocks_and_spans_matches_float64(clamp: bool) -> None:
    """The Gram kernel's block loop, its zero-padded last block, spans, extras, the reference row and bounds."""
    from fedrobust.aggregators import _kernels

    n, extras_count, ref_row = 9, 2, 4
    k = n + extras_count + 1  # augmented: the reference row itself comes last
    block = _kernels.block_size(k + 3, 4)
    d = 5 * block + 37  # several whole blocks and a partial one, in every span
    gen = np.random.default_rng(11)
    rows = np.zeros((n, d + 3), np.float32)  # row stride d + 3: rows are views into one buffer
    rows[:, :d] = gen.standard_normal((n, d), dtype=np.float32) * 0.01 + 0.5
    extras = gen.standard_normal((extras_count, d), dtype=np.float32) * 0.01 + 0.5
    spans = [(0, 2 * block + 11), (2 * block + 11, d)]
    bounds = np.stack([np.full(d, 0.495, np.float32), np.full(d, 0.505, np.float32)]) if clamp else None
    got = _kernels.gram(rows.ravel(), d + 3, spans, n, ref_row, extras, True, bounds)[:k, :k]

    x = rows[:, :d].astype(np.float64)
    if bounds is not None:
        x = np.clip(x, bounds[0].astype(np.float64), bounds[1].astype(np.float64))
    ref = x[ref_row]
    stacked = np.concatenate([x - ref, extras.astype(np.float64) - ref, ref[None]])
    want = stacked @ stacked.T
    # float32 products summed in float32 over one block, then in float64: the error is a few float32
    # roundings of the sum of the terms' magnitudes (the result itself can be much smaller).
    scale = np.abs(stacked) @ np.abs(stacked).T
    lower = np.tril(np.ones((k, k), dtype=bool))
    assert (np.abs(got - want)[lower] <= 1e-6 * scale[lower]).all()
    assert np.abs(got - want)[lower].max() > 0  # really the float32 kernel, not a float64 copy


def test_the_reference_rows_inner_products_are_the_same_on_any_thread_count(threads) -> None:
    from fedrobust.aggregators.rows import inner_products

    sample = torch.randn(50, 1024, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    threads(1)
    one = inner_products(sample)
    torch.testing.assert_close(one, sample @ sample.T)
    assert torch.equal(one, one.T)
    for count in (3, 16):
        threads(count)
        assert torch.equal(inner_products(sample), one), count
