"""UpdateMatrix (one-pass validate-and-copy of replies) and the zero-copy views on Flower arrays."""

from __future__ import annotations

import math
import os
import warnings

import flwr.app  # noqa: F401  imported before the warnings filters below: click warns on import
import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from fedrobust.strategies.reply_arrays import array_view, array_views
from fedrobust.tensors import flatten, float_keys
from fedrobust.update_matrix import UpdateMatrix
from fedrobust.validation import BLOCK, check_update

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _template(dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    """A small model: tensors larger than one block, odd sizes, a scalar and an int buffer."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"conv.weight": (8, 3, 3, 3), "fc.weight": (BLOCK + 17, 3), "fc.bias": (5,), "scale": ()}
    out: dict[str, torch.Tensor] = {}
    for key, shape in shapes.items():
        out[key] = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
        if key == "fc.weight":
            out["bn.num_batches_tracked"] = torch.tensor(7, dtype=torch.int64)
    return out


def _local(template: dict[str, torch.Tensor], seed: int, scale: float = 1e-2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        k: (v.double() + scale * torch.randn(v.shape, generator=g, dtype=torch.float64)).to(v.dtype)
        if v.is_floating_point()
        else v + 1
        for k, v in template.items()
    }


def _as_numpy(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in state.items()}


# ------------------------------------------------------------------ equality with the old path
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("full_weights", [True, False])
def test_rows_equal_the_old_path_bit_for_bit(dtype: torch.dtype, full_weights: bool) -> None:
    template = _template(dtype)
    keys = float_keys(template)
    matrix = UpdateMatrix(template, capacity=4)
    expected_updates = []
    for seed in range(3):
        local = _local(template, seed + 1)
        if full_weights:
            # The row is local - global in float32 (float64 for float64 templates), rounded once.
            wide = torch.float64 if dtype == torch.float64 else torch.float32
            update = {k: (local[k].to(wide) - template[k].to(wide)) for k in keys}
            sent = local
        else:
            update = {k: local[k] - template[k] for k in keys}  # a delta in the template's dtype
            sent = {**update, "bn.num_batches_tracked": template["bn.num_batches_tracked"]}
        if not full_weights:  # the old path checked the delta with check_update, then flattened it
            assert check_update(sent, template, num_examples=1, max_norm=0, max_num_examples=1) is None
        expected_updates.append(update)
        # numpy input for the dtypes NumPy has; torch tensors for bfloat16
        given = sent if dtype == torch.bfloat16 else _as_numpy(sent)
        assert matrix.add(given, full_weights=full_weights) is None
    expected = flatten(expected_updates, keys)
    assert expected.dtype == torch.float32
    assert torch.equal(matrix.rows(), expected)
    for i, update in enumerate(expected_updates):
        exact = math.sqrt(sum(float((u.double() ** 2).sum()) for u in update.values()))
        assert matrix.norms()[i].item() == pytest.approx(exact, rel=1e-6)


def test_norms_match_check_update_and_bound_agrees() -> None:
    template = _template()
    update = {k: v.clone() for k, v in _local(template, 3, scale=1.0).items()}
    update["bn.num_batches_tracked"] = template["bn.num_batches_tracked"]
    norm = math.sqrt(sum(float((v.double() ** 2).sum()) for v in update.values() if v.is_floating_point()))
    for bound, accepted in [(norm * (1 + 1e-5), True), (norm * (1 - 1e-5), False)]:
        matrix = UpdateMatrix(template, capacity=1, max_norm=bound)
        got = matrix.add(_as_numpy(update), full_weights=False)
        old = check_update(update, template, num_examples=1, max_norm=bound, max_num_examples=1)
        assert (got is None) == accepted == (old is None)
        if not accepted:
            assert got is not None and got.reason == old.reason == "norm_too_large"


# ------------------------------------------------------------------ every rejection reason
def _sent() -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    template = _template()
    return template, _as_numpy(_local(template, 1))


@pytest.mark.parametrize(
    "mutate,reason",
    [
        (lambda a: a.pop("fc.bias"), "wrong_keys"),
        (lambda a: a.update(extra=np.zeros(1, np.float32)), "wrong_keys"),
        (lambda a: a.pop("bn.num_batches_tracked"), "wrong_keys"),
        (lambda a: a.update({"fc.bias": np.zeros(6, np.float32)}), "wrong_shape"),
        (lambda a: a.update({"scale": np.zeros(1, np.float32)}), "wrong_shape"),
        (lambda a: a.update({"bn.num_batches_tracked": np.zeros(1, np.int64)}), "wrong_shape"),
        (lambda a: a.update({"fc.bias": np.zeros(5, np.float64)}), "wrong_dtype"),
        (lambda a: a.update({"bn.num_batches_tracked": np.array(3, np.int32)}), "wrong_dtype"),
        (lambda a: a.update({"fc.bias": np.zeros(5, np.int32)}), "wrong_dtype"),
        (lambda a: a["fc.weight"].__setitem__((BLOCK + 3, 1), np.nan), "non_finite"),
        (lambda a: a["conv.weight"].__setitem__((0, 0, 0, 0), -np.inf), "non_finite"),
        (lambda a: a.update({"scale": np.array(np.inf, np.float32)}), "non_finite"),
        # finite weights whose difference from the global model overflows float32
        (lambda a: a.update({"scale": np.array(3e38, np.float32)}), "none_or_non_finite"),
    ],
)
def test_each_defect_is_rejected_with_its_reason_and_the_row_is_reused(mutate, reason) -> None:
    template, sent = _sent()
    matrix = UpdateMatrix(template, capacity=2)
    arrays = {k: v.copy() for k, v in sent.items()}
    mutate(arrays)
    rejection = matrix.add(arrays, full_weights=True)
    if reason == "none_or_non_finite":
        # 3e38 - global(~1) is finite: accepted, and its square only overflows float32, not the norm.
        assert rejection is None and math.isfinite(matrix.norms()[0].item())
        assert matrix.norms()[0].item() == pytest.approx(3e38, rel=1e-6)
        return
    assert rejection is not None and rejection.reason == reason and rejection.detail
    assert len(matrix) == 0
    # The rejected row is free again: the next valid reply lands in row 0 and is correct.
    assert matrix.add(sent, full_weights=True) is None
    keys = float_keys(template)
    local = {k: torch.from_numpy(sent[k]) for k in keys}
    assert torch.equal(matrix.rows()[0], flatten([{k: local[k] - template[k] for k in keys}], keys)[0])


def test_difference_overflowing_float32_is_non_finite() -> None:
    template = _template()
    template["scale"] = torch.tensor(-3e38)
    arrays = _as_numpy(_local(template, 1))
    arrays["scale"] = np.array(3e38, np.float32)  # finite, but 3e38 - (-3e38) is not in float32
    assert UpdateMatrix(template, 1).add(arrays, full_weights=True).reason == "non_finite"
    # as a delta the same value is fine
    assert UpdateMatrix(template, 1).add(arrays, full_weights=False) is None


def test_norm_bound_and_disabled() -> None:
    template, sent = _sent()
    big = {**sent, "fc.bias": np.full(5, 100.0, np.float32)}
    assert UpdateMatrix(template, 1, max_norm=10.0).add(big, full_weights=False).reason == "norm_too_large"
    assert UpdateMatrix(template, 1, max_norm=0.0).add(big, full_weights=False) is None


def test_a_norm_rejection_says_how_much_the_running_statistics_make_up() -> None:
    """A batch norm's running variance follows the data's scale: the rejection says its share, so that a user
    whose honest nodes are rejected sees that the buffers, not the weights, crossed the bound."""
    template = {"bn.weight": torch.zeros(2), "bn.running_mean": torch.zeros(2), "bn.running_var": torch.zeros(2)}
    sent = {"bn.weight": np.full(2, 3.0, np.float32), "bn.running_mean": np.zeros(2, np.float32),
            "bn.running_var": np.full(2, 30.0, np.float32)}
    rejection = UpdateMatrix(template, 1, max_norm=10.0).add(sent, full_weights=False)
    assert rejection is not None and rejection.detail == (
        "L2 norm 42.64 > bound 10 (the batch norms' running statistics: 42.43 of it)")
    weights_only = {**sent, "bn.running_var": np.zeros(2, np.float32), "bn.weight": np.full(2, 30.0, np.float32)}
    rejection = UpdateMatrix(template, 1, max_norm=10.0).add(weights_only, full_weights=False)
    assert rejection is not None and rejection.detail == "L2 norm 42.43 > bound 10"


def test_full_weights_and_delta_differ_by_the_global_model() -> None:
    template, sent = _sent()
    matrix = UpdateMatrix(template, 2)
    assert matrix.add(sent, full_weights=True) is None
    assert matrix.add(sent, full_weights=False) is None
    rows = matrix.rows()
    torch.testing.assert_close(rows[1] - rows[0], matrix.global_flat(), rtol=0, atol=1e-6)
    assert not torch.equal(rows[0], rows[1])


def test_big_endian_and_fortran_ordered_input_give_the_same_row() -> None:
    template, sent = _sent()
    odd = dict(sent)
    odd["fc.weight"] = sent["fc.weight"].astype(">f4")
    odd["conv.weight"] = np.asfortranarray(sent["conv.weight"])
    matrix = UpdateMatrix(template, 2)
    assert matrix.add(sent, full_weights=True) is None and matrix.add(odd, full_weights=True) is None
    assert torch.equal(matrix.rows()[0], matrix.rows()[1])
    assert matrix.norms()[0].item() == matrix.norms()[1].item()


def test_full_matrix_raises() -> None:
    template, sent = _sent()
    matrix = UpdateMatrix(template, 1)
    assert matrix.add(sent, full_weights=True) is None
    with pytest.raises(ValueError, match="full"):
        matrix.add(sent, full_weights=True)


# ------------------------------------------------------------------ views, recheck, drop, unflatten
def test_rows_norms_and_global_are_views_without_copies() -> None:
    template, sent = _sent()
    matrix = UpdateMatrix(template, 3)
    for _ in range(2):
        assert matrix.add(sent, full_weights=True) is None
    rows = matrix.rows()
    assert rows.shape == (2, matrix.dim) and rows.dtype == torch.float32
    assert rows.data_ptr() == matrix.rows().data_ptr()
    rows[1, 0] = 123.0  # writes through: the same storage
    assert matrix.rows()[1, 0].item() == 123.0
    assert matrix.norms().shape == (2,) and matrix.norms().dtype == torch.float64


def test_unflatten_restores_shapes_dtypes_and_views_float32() -> None:
    for dtype in FLOAT_DTYPES:
        template = _template(dtype)
        matrix = UpdateMatrix(template, 1)
        state = matrix.unflatten(matrix.global_flat())
        assert list(state) == float_keys(template)
        for key, value in state.items():
            assert value.shape == template[key].shape and value.dtype == template[key].dtype
            if dtype == torch.float64:  # float32 vector of a float64 model: rounded once
                torch.testing.assert_close(value, template[key], rtol=1e-6, atol=0)
            else:
                assert torch.equal(value, template[key])
        if dtype == torch.float32:
            start = matrix.global_flat().data_ptr()
            assert state["fc.bias"].untyped_storage().data_ptr() == start


def test_recheck_sees_rewritten_rows_and_drop_compacts() -> None:
    template = _template()
    matrix = UpdateMatrix(template, 4, max_norm=50.0)
    for seed in range(4):
        assert matrix.add(_as_numpy(_local(template, seed)), full_weights=True) is None
    before = matrix.rows().clone()
    norm_3 = matrix.norms()[3].item()
    rows = matrix.rows()
    rows[1].fill_(1.0)  # norm sqrt(d) > 50
    rows[2, BLOCK + 5] = float("nan")
    assert matrix.recheck(0) is None
    assert matrix.recheck(1).reason == "norm_too_large"
    assert matrix.norms()[1].item() == pytest.approx(math.sqrt(matrix.dim), rel=1e-6)
    assert matrix.recheck(2).reason == "non_finite"
    matrix.drop([1, 2])
    assert len(matrix) == 2
    assert torch.equal(matrix.rows()[0], before[0]) and torch.equal(matrix.rows()[1], before[3])
    assert matrix.norms()[1].item() == norm_3
    assert matrix.add(_as_numpy(_local(template, 9)), full_weights=True) is None and len(matrix) == 3
    with pytest.raises(IndexError):
        matrix.drop([3])


# ------------------------------------------------------------------ Flower edge
def test_array_views_share_memory_with_the_array_bytes_and_are_read_only() -> None:
    template = _template()
    record = ArrayRecord(dict(template.items()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no torch "non-writable array" warning on the way
        views = array_views(record)
        matrix = UpdateMatrix(template, 1)
        assert matrix.add(views, full_weights=False) is None
    assert list(views) == list(template)
    for key, view in views.items():
        data = record[key].data
        assert np.shares_memory(view, np.frombuffer(data, dtype=np.uint8))
        assert not view.flags.writeable
        np.testing.assert_array_equal(view, record[key].numpy())
    assert torch.equal(matrix.rows()[0], flatten([template], float_keys(template))[0])


def test_array_view_of_fortran_and_big_endian_arrays_matches_flower() -> None:
    a = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    b = np.arange(5, dtype=">f8")
    for value in (a, b):
        array = Array(value)
        np.testing.assert_array_equal(array_view(array), array.numpy())
        assert array_view(array).dtype == array.numpy().dtype


@pytest.mark.parametrize(
    "corrupt,match",
    [
        (lambda a: setattr(a, "data", a.data[:-4]), "truncated"),
        (lambda a: setattr(a, "data", a.data + b"\0\0\0\0"), "needs"),
        (lambda a: setattr(a, "data", a.data[:20]), "npy"),
        (lambda a: setattr(a, "data", b"not an npy file at all"), "npy"),
        (lambda a: setattr(a, "stype", "torch.save"), "serialisation"),
        (lambda a: setattr(a, "shape", (2, 6)), "shape"),
        (lambda a: setattr(a, "dtype", "float64"), "dtype"),
    ],
)
def test_array_views_reject_what_does_not_parse(corrupt, match) -> None:
    record = ArrayRecord({"w": torch.ones(3, 4), "b": torch.zeros(2)})
    corrupt(record["w"])
    with pytest.raises(ValueError, match=match) as err:
        array_views(record)
    assert "'w'" in str(err.value)


def test_object_arrays_are_refused_without_unpickling() -> None:
    import io

    buffer = io.BytesIO()
    np.save(buffer, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    array = Array(dtype="object", shape=(1,), stype="numpy.ndarray", data=buffer.getvalue())
    with pytest.raises(ValueError, match="numeric"):
        array_view(array)


def test_reset_reuses_the_storage_with_the_new_global_model() -> None:
    template, sent = _sent()
    matrix = UpdateMatrix(template, 2)
    assert matrix.add(sent, full_weights=True) is None
    storage = matrix.rows().data_ptr()
    moved = {k: (v + 1.0 if v.is_floating_point() else v) for k, v in template.items()}
    matrix.reset(moved)
    assert len(matrix) == 0
    assert matrix.add(sent, full_weights=True) is None
    assert matrix.rows().data_ptr() == storage
    keys = float_keys(template)
    local = {k: torch.from_numpy(sent[k]) for k in keys}
    assert torch.equal(matrix.rows()[0], flatten([{k: local[k] - moved[k] for k in keys}], keys)[0])
    with pytest.raises(ValueError, match="differs"):
        matrix.reset({**template, "fc.bias": torch.zeros(6)})


def _resident_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_touch_makes_all_rows_resident_and_rows_are_written_as_before() -> None:
    template = {"w": torch.zeros(1 << 20)}  # 4 MiB a row
    matrix = UpdateMatrix(template, 16)  # 64 MiB reserved
    before = _resident_bytes()
    assert matrix.add({"w": np.ones(1 << 20, np.float32)}, full_weights=True) is None
    assert _resident_bytes() - before < 16 << 20  # reserved, not resident: one row was written
    matrix.reset(template)
    matrix.touch()
    assert _resident_bytes() - before > 56 << 20
    assert len(matrix) == 0
    assert matrix.add({"w": np.full(1 << 20, 2.0, np.float32)}, full_weights=True) is None
    assert torch.equal(matrix.rows(), torch.full((1, 1 << 20), 2.0))
    assert matrix.norms().tolist() == [2.0 * 1024]


def test_cached_headers_still_give_each_array_its_own_shape_and_dtype() -> None:
    arrays = [np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32), np.zeros((2, 3), np.float16)]
    for _ in range(2):  # the second pass hits the header cache
        for value in arrays:
            view = array_view(Array(value))
            assert view.shape == value.shape and view.dtype == value.dtype


def _wide_template() -> dict[str, torch.Tensor]:
    """Large enough (> 1M values, several segments) for the row to be written by several threads."""
    g = torch.Generator().manual_seed(5)
    return {f"layer{i}.weight": torch.randn(300_000 + 7 * i, generator=g) for i in range(5)}


def test_rows_and_norms_are_the_same_written_by_one_thread_or_several() -> None:
    template = _wide_template()
    replies = [_local(template, seed) for seed in range(3)]
    before = torch.get_num_threads()
    try:
        results = []
        for count in (1, 3):
            torch.set_num_threads(count)
            matrix = UpdateMatrix(template, capacity=3)
            for reply in replies:
                assert matrix.add({k: v.numpy() for k, v in reply.items()}, full_weights=True) is None
            results.append((matrix.rows().clone(), matrix.norms().clone()))
        # A NaN in the fourth segment is reported there, as the one-thread pass reports it.
        bad = dict(replies[0])
        bad["layer3.weight"] = bad["layer3.weight"].clone()
        bad["layer3.weight"][123] = float("nan")
        rejection = UpdateMatrix(template, capacity=1).add(bad, full_weights=True)
    finally:
        torch.set_num_threads(before)
    (rows_one, norms_one), (rows_three, norms_three) = results
    assert torch.equal(rows_one, rows_three) and torch.equal(norms_one, norms_three)
    assert rejection is not None and rejection.reason == "non_finite" and "layer3.weight" in rejection.detail


def test_a_reply_with_many_keys_wrong_names_three_and_counts_the_rest() -> None:
    from fedrobust.validation import WRONG_KEYS, check_structure

    template = {f"layer{i}.weight": torch.zeros(2) for i in range(6)}
    trainable_only = {k: v for k, v in template.items() if k in ("layer0.weight",)}
    rejection = check_structure(trainable_only, template)
    assert rejection is not None and rejection.reason == WRONG_KEYS
    assert rejection.detail == "missing layer1.weight, layer2.weight, layer3.weight and 2 more, unexpected none"
