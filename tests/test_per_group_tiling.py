"""Per-group FP8 scaling for the GEMM operands and the kernels' tiling paths, against the
reference: the padded token scales (the grad_w operand layout) and the expert column scales
(the forward's weights); the tiling helpers (rows per row-block item, colwise tile rows),
group widths around the row-block kernel's size classes, the 64-bit offset path, and on a
GPU groups longer than one tile and the colwise kernels at scale."""

from __future__ import annotations

import pytest
import torch
from helpers import KERNEL_DEVICES, bits, fresh_generator
from per_group_data import LAYOUTS, assert_same, make_input, make_offsets

from mxfp8_a2a import per_group_colwise_scales, per_group_rowwise_scales
from mxfp8_a2a.grouped import per_group_scales
from mxfp8_a2a.grouped.reference import (
    expert_column_reference,
    padded_token_reference,
    per_group_colwise_reference,
    per_group_rowwise_reference,
)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("kind", ["uneven", "with_empty", "one_holds_all", "aligned"])
def test_padded_token_scales(device, kind):
    """The grad_w operand layout: rowwise of x.t() with each group's tokens from a multiple of
    16, at least 16 wide, zeros between, the padded ends out; the reference's numbers."""
    g = fresh_generator()
    m, k, n_groups = 203, 40, 7
    x = make_input((m, k), torch.bfloat16, device, g)
    offs = make_offsets(m, n_groups, g, kind).to(device)
    data, scales, pad = per_group_scales.padded_token_scales(x, offs)
    want_data, want_scales = per_group_rowwise_reference(x.t(), offs)
    torch.testing.assert_close(scales, want_scales, rtol=0, atol=0, equal_nan=True)
    cap = per_group_scales.padded_length(m, n_groups)
    assert data.shape == (k, cap) and data.is_contiguous() and pad.dtype == torch.int32
    ends, pad_ends = offs.tolist(), pad.tolist()
    assert pad_ends[-1] == cap
    want = torch.zeros(k, cap, dtype=torch.uint8)
    for s, e, p, r in zip([0] + ends[:-1], ends, [0] + pad_ends[:-1], pad_ends, strict=True):
        assert p % 16 == 0 and r - p >= max(16, e - s), (p, r, s, e)
        want[:, p : p + e - s] = bits(want_data[:, s:e]).cpu()
    assert torch.equal(bits(data).cpu(), want)
    ref = padded_token_reference(x, offs)  # the plain-torch version (CPU without Triton)
    assert torch.equal(bits(ref[0]), bits(data)) and torch.equal(ref[2], pad)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("int64", [False, True])
def test_padded_token_scales_defined_for_bad_offsets(device, int64, monkeypatch):
    """Offsets past M, decreasing, negative or all zero (validate=False callers): the kernel
    gives the plain-torch reference's defined result; also on the 64-bit offset path."""
    if int64:
        monkeypatch.setattr(per_group_scales, "INT64_FROM", 0)
    g = fresh_generator()
    x = make_input((37, 16), torch.bfloat16, device, g)
    for ends in ([40, 3, 50], [0, 0, 0], [2, -1, 37], [37]):
        offs = torch.tensor(ends, dtype=torch.int32, device=device)
        data, scales, pad = per_group_scales.padded_token_scales(x, offs)
        want = padded_token_reference(x, offs)
        assert torch.equal(bits(data), bits(want[0])) and torch.equal(pad, want[2]), ends
        torch.testing.assert_close(scales, want[1], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_grouped_gemm_operands_inverse(device):
    """inverse=True: the same data and offsets, the scales as torch.reciprocal gives them."""
    g = fresh_generator()
    x = make_input((203, 40), torch.bfloat16, device, g)
    x[5, 3] = float("inf")  # a zero scale: an inf multiplier
    offs = make_offsets(203, 7, g, "with_empty").to(device)
    plain, inv = (per_group_scales.padded_token_scales(x, offs, i) for i in (False, True))
    assert torch.equal(bits(plain[0]), bits(inv[0])) and torch.equal(plain[2], inv[2])
    torch.testing.assert_close(inv[1], plain[1].reciprocal(), rtol=0, atol=0, equal_nan=True)
    w = x[:200].reshape(5, 40, 40)
    plain, inv = (per_group_scales.expert_column_scales(w, i) for i in (False, True))
    assert torch.equal(bits(plain[0]), bits(inv[0])) and plain[0].stride() == inv[0].stride()
    torch.testing.assert_close(inv[1], plain[1].reciprocal(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_padded_token_scales_without_columns_or_groups(device):
    """K = 0 still gives the padded offsets; no groups give all-zero data."""
    x = torch.randn(37, 0, dtype=torch.bfloat16, device=device)
    offs = torch.tensor([5, 37], dtype=torch.int32, device=device)
    data, scales, pad = per_group_scales.padded_token_scales(x, offs)
    assert data.shape == (0, 80) and scales.shape == (2, 0) and pad.tolist() == [16, 80]
    x = torch.randn(37, 16, dtype=torch.bfloat16, device=device)
    data, scales, pad = per_group_scales.padded_token_scales(x, offs[:0])
    assert data.shape == (16, 48) and not bits(data).any() and pad.numel() == scales.numel() == 0


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_expert_column_scales(device):
    """The forward's weights: per (expert, column) over K, each expert column-major."""
    g = fresh_generator()
    e, k, n = 3, 72, 40
    w = make_input((e * k, n), torch.bfloat16, device, g)
    offs = torch.arange(1, e + 1, dtype=torch.int32, device=device) * k
    data, scales = per_group_scales.expert_column_scales(w.view(e, k, n))
    want_data, want_scales = per_group_colwise_reference(w, offs)
    assert data.shape == (e, k, n) and data.stride() == (n * k, 1, k)
    torch.testing.assert_close(scales, want_scales, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(bits(data.reshape(e * k, n)), bits(want_data))
    ref = expert_column_reference(w.view(e, k, n))
    assert ref[0].stride() == data.stride() and torch.equal(bits(ref[0]), bits(data))


def test_row_block_size():
    """Rows per rowwise item: about tiling.item elements for a group of average width, a
    power of two, never more than the tensor's rows (rounded up) or MAX_ROW_BLOCK."""
    from mxfp8_a2a._config import RowBlockTiling
    from mxfp8_a2a.grouped.per_group_scales import MAX_ROW_BLOCK, _row_block

    t = RowBlockTiling(tile=4096, item=8192, min_group=32, max_class=512, num_warps=4)
    assert _row_block(t, 16640, 8192, 1) == 1  # one group 8192 wide: one row
    assert _row_block(t, 16640, 8192, 16) == 16  # 512 wide on average
    assert _row_block(t, 16640, 8192, 64) == 64
    assert _row_block(t, 16640, 8000, 64) == 128  # 125 wide: 65.5 rows, rounded up
    assert _row_block(t, 5, 8192, 64) == 8  # 5 rows
    assert _row_block(t, 16640, 64, 64) == MAX_ROW_BLOCK  # groups of one column


def test_colwise_rows():
    """Colwise tile rows: the tiling's, halved (not below 4 * sub) while a launch would have
    fewer than min_programs programs; min_programs 0 keeps them."""
    from mxfp8_a2a._config import ColwiseTiling
    from mxfp8_a2a.grouped.per_group_scales import _colwise_rows

    c = ColwiseTiling(128, 512, 128, 32, 4, min_programs=2048)
    assert _colwise_rows(c, 512, 16640, 64) == 512  # 33 chunks x 64 strips: 2112 programs
    assert _colwise_rows(c, 512, 2048, 16 * 6) == 128  # 4 chunks x 96 strips: halved twice
    assert _colwise_rows(c, 512, 32768, 16) == 256  # 64 x 16 = 1024, then 2048
    assert _colwise_rows(c, 512, 100, 1) == 128  # never below 4 * sub
    assert _colwise_rows(c._replace(min_programs=0), 512, 100, 1) == 512


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(
    "widths",
    [
        [1, 15, 16, 17, 31, 33, 0, 48, 100, 127, 128, 129, 130, 200, 511, 512, 513, 600, 5],
        [16, 32, 48, 112, 128, 144, 0, 496, 512, 528, 1024, 16],
    ],
    ids=["uneven", "aligned"],
)
def test_rowwise_group_widths(device, widths):
    """Groups of many widths on both sides of the row-block kernel's largest size class (128
    columns interpreted, 512 on the GPU) and its smaller classes, over a row count that fills
    no tile evenly."""
    g = fresh_generator()
    ends = torch.tensor(widths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    x = make_input((37, int(ends[-1])), torch.bfloat16, device, g)
    got = per_group_rowwise_scales(x, ends.to(device), backend="triton", method="direct")
    assert_same(got, per_group_rowwise_reference(x, ends))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_64_bit_offsets(device, monkeypatch):
    """The 64-bit offset path of both kernels (tensors past 2^31 elements) gives the same
    bits; forced here on a small tensor."""
    monkeypatch.setattr(per_group_scales, "INT64_FROM", 0)
    g = fresh_generator()
    x = make_input((40, 203), torch.bfloat16, device, g)
    offs = make_offsets(203, 6, g, "aligned").to(device)
    for method in ("direct", "transpose"):
        got = per_group_rowwise_scales(x, offs, backend="triton", method=method)
        assert_same(got, per_group_rowwise_reference(x, offs))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_groups_longer_than_one_tile(dtype):
    """Groups past the row-block kernel's largest size class take its looping path."""
    g = fresh_generator()
    x = make_input((24, 9000), dtype, "cuda", g)  # rowwise: a group 8500 columns wide
    offs = torch.tensor([500, 9000], dtype=torch.int32, device="cuda")
    assert_same(per_group_rowwise_scales(x, offs), per_group_rowwise_reference(x, offs))
    x = make_input((200, 9000), dtype, "cuda", g)  # narrow groups (large items) and a wide one
    offs = torch.tensor([16 * i for i in range(1, 64)] + [9000], dtype=torch.int32, device="cuda")
    assert_same(per_group_rowwise_scales(x, offs), per_group_rowwise_reference(x, offs))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n_groups", [1, 16, 64])
def test_colwise_kernels_at_scale(n_groups):
    """Thousands of programs in flight: the atomics under real concurrency, every layout the
    grad_w GEMM uses."""
    g = fresh_generator()
    x = make_input((8200, 2048), torch.bfloat16, "cuda", g)
    offs = make_offsets(8200, n_groups, g, "aligned" if n_groups != 16 else "uneven").cuda()
    for layout in LAYOUTS:
        want = per_group_colwise_reference(x, offs, False, layout)
        for _ in range(3):
            assert_same(per_group_colwise_scales(x, offs, data_layout=layout, validate=False), want)
        want = per_group_rowwise_reference(x.t(), offs, False, layout)
        assert_same(per_group_rowwise_scales(x.t(), offs, data_layout=layout, validate=False), want)
