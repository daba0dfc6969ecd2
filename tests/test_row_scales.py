"""Per-row FP8 scales (mxfp8_a2a.grouped.row_scales) against the per-group reference with one
group spanning each row: bit for bit on data of many magnitudes with NaN, inf, zeros, tiny
and huge values, widths around the powers of two, strided and transposed inputs, the path
for rows wider than the kernel's limit, and empty shapes."""

from __future__ import annotations

import pytest
import torch
from helpers import KERNEL_DEVICES, bits, fresh_generator
from per_group_data import make_input

from mxfp8_a2a import _config
from mxfp8_a2a.grouped import row_scales as rs
from mxfp8_a2a.grouped.reference import per_group_rowwise_reference


def _want(x, pow2=False):
    whole = torch.full((1,), x.shape[1], dtype=torch.int32, device=x.device)
    data, scales = per_group_rowwise_reference(x, whole, pow2)
    return data, scales.reshape(-1)


def _assert_same(got, want):
    (dg, sg), (dw, sw) = got, want
    assert dg.dtype == torch.float8_e4m3fn and dg.is_contiguous() and dg.shape == dw.shape
    assert torch.equal(bits(dg), bits(dw))
    torch.testing.assert_close(sg, sw, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "shape", [(37, 40), (5, 768), (9, 1000), (3, 9), (1, 2048), (70, 17), (3, 4097), (4, 7168)]
)
@pytest.mark.parametrize("pow2", [False, True])
def test_row_scales_match_reference(device, dtype, shape, pow2):
    x = make_input(shape, dtype, device, fresh_generator())
    _assert_same(rs.row_scales(x, pow2), _want(x, pow2))


@pytest.fixture
def paths(monkeypatch):
    """Which path each row_scales call took: "row" (the one-pass kernel) or "per_group"."""
    taken = []
    row_op, per_group = rs._row_scales_op, rs.per_group_rowwise_scales
    monkeypatch.setattr(rs, "_row_scales_op", lambda *a: taken.append("row") or row_op(*a))
    monkeypatch.setattr(
        rs,
        "per_group_rowwise_scales",
        lambda *a, **k: taken.append("per_group") or per_group(*a, **k),
    )
    return taken


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_row_scales_any_strides(device, paths):
    """The one-pass kernel for rows along the contiguous axis (a column slice, rows further
    apart than their width; every other row; rows of one value; rows that repeat, stride 0),
    the per-group kernels for a transposed tensor (rows strided by one element)."""
    g = fresh_generator()
    base = make_input((96, 50), torch.bfloat16, device, g)
    one = torch.randn(6, 1, generator=g).to(torch.bfloat16).to(device)  # rows of one value
    repeated = base[5:6].expand(7, 50)
    cases = ((base[:, 3:41], "row"), (base[::2], "row"), (one, "row"), (repeated, "row"),
             (base.t(), "per_group"))  # fmt: skip
    for x, path in cases:
        _assert_same(rs.row_scales(x), _want(x.contiguous()))
        assert paths.pop() == path and not paths


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_rows_wider_than_the_kernel_take_the_per_group_path(device, monkeypatch, paths):
    monkeypatch.setattr(_config, "ROW_SCALES_MAX_WIDTH", 64)
    g = fresh_generator()
    for width, path in ((64, "row"), (65, "per_group"), (100, "per_group")):
        x = make_input((11, width), torch.bfloat16, device, g)
        _assert_same(rs.row_scales(x), _want(x))
        assert paths.pop() == path and not paths


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_row_scales_64_bit_offsets(device, monkeypatch, paths):
    """The kernel's int64 offsets (forced: tensors past 2**31 elements do not fit in CI)."""
    monkeypatch.setattr(rs, "INT64_FROM", 1)
    x = make_input((40, 300), torch.bfloat16, device, fresh_generator())
    for pow2 in (False, True):
        _assert_same(rs.row_scales(x[:, 7:], pow2), _want(x[:, 7:].contiguous(), pow2))
        assert paths.pop() == "row" and not paths


def test_row_scales_reference_where_kernels_do_not_run(monkeypatch):
    """Without the kernels (CPU tensors outside the interpreter) the plain-torch reference."""
    monkeypatch.setattr(rs, "_kernels_run_on", lambda device: False)
    x = make_input((9, 70), torch.bfloat16, "cpu", fresh_generator())
    _assert_same(rs.row_scales(x.t(), True), _want(x.t().contiguous(), True))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_row_scales_empty(device):
    for shape in ((0, 64), (4, 0), (0, 0)):
        x = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        for pow2 in (False, True):
            _assert_same(rs.row_scales(x, pow2), _want(x, pow2))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_row_scales_inverse(device, monkeypatch):
    """inverse=True: the same data, the scales as torch.reciprocal gives them (bit for bit,
    inf for a zero scale, NaN for NaN), from the one-pass kernel, the per-group path for
    wide rows, and rows without columns."""
    x = make_input((70, 300), torch.bfloat16, device, fresh_generator())
    x[9, 0] = float("inf")  # a row whose scale is 0
    for width in (_config.ROW_SCALES_MAX_WIDTH, 64):
        monkeypatch.setattr(_config, "ROW_SCALES_MAX_WIDTH", width)
        data, scales = rs.row_scales(x)
        got = rs.row_scales(x, inverse=True)
        _assert_same(got, (data, scales.reciprocal()))
    empty = torch.zeros(3, 0, dtype=torch.bfloat16, device=device)
    _assert_same(
        rs.row_scales(empty, inverse=True),
        (rs.row_scales(empty)[0], rs.row_scales(empty)[1].reciprocal()),
    )


def test_row_scales_bad_input():
    with pytest.raises(ValueError, match="2-D bf16 or fp32"):
        rs.row_scales(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="2-D bf16 or fp32"):
        rs.row_scales(torch.zeros(2, 3, dtype=torch.int32))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_row_scales_op_passes_opcheck(device):
    """(finite data: opcheck's comparison of eager and traced outputs counts NaN as a
    difference)"""
    x = torch.randn(13, 48, generator=fresh_generator()).to(torch.bfloat16).to(device)
    torch.library.opcheck(rs._row_scales_op, (x, False))
