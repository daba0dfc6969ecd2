"""Per-group FP8 scaling kernels against the looping torch reference, bit for bit."""

from __future__ import annotations

import pytest
import torch
from helpers import KERNEL_DEVICES, bits, fresh_generator

from mxfp8_a2a import per_group_colwise_scales, per_group_rowwise_scales
from mxfp8_a2a.grouped import per_group_scales
from mxfp8_a2a.grouped.reference import per_group_colwise_reference, per_group_rowwise_reference


def _offsets(total: int, n_groups: int, g: torch.Generator, kind: str) -> torch.Tensor:
    if kind == "one_holds_all":
        ends = [0] * (n_groups - 1) + [total]
    elif kind == "with_empty":
        cuts = sorted(torch.randint(0, total + 1, (n_groups - 1,), generator=g).tolist())
        cuts[: len(cuts) // 3] = [cuts[0]] * (len(cuts) // 3)  # several empty groups
        ends = cuts + [total]
    elif kind == "aligned":  # multiples of 16, as MoE token counts often are
        cuts = sorted(torch.randint(0, total // 16 + 1, (n_groups - 1,), generator=g).tolist())
        ends = [16 * c for c in cuts] + [total]
    else:  # uneven
        ends = sorted(torch.randint(0, total + 1, (n_groups - 1,), generator=g).tolist()) + [total]
    return torch.tensor(ends, dtype=torch.int32)


def _data(shape, dtype, device, g):
    x = torch.randn(shape, generator=g) * torch.exp2(
        torch.randint(-20, 20, (shape[0], 1), generator=g).float()
    )
    x[0, 0] = float("nan")
    x[1 % shape[0], 2] = float("inf")
    x[2 % shape[0], :] = 0.0
    x[3 % shape[0], 5:9] = 1e-13
    x[4 % shape[0], 3] = -float("inf")  # in a row without NaN: -inf * 0 scale is NaN
    return x.to(dtype).to(device)


def _same(a, b):
    (da, sa), (db, sb) = a, b
    assert torch.equal(bits(da.contiguous()), bits(db.contiguous()))
    torch.testing.assert_close(sa, sb, rtol=0, atol=0, equal_nan=True)  # NaN's sign is free


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize(
    "n_groups, kind",
    [(1, "uneven"), (16, "uneven"), (64, "with_empty"), (5, "one_holds_all"), (6, "aligned")],
)
def test_colwise_and_rowwise_match_reference(device, dtype, pow2, n_groups, kind):
    g = fresh_generator()
    m, k = (208 if kind == "aligned" else 203), 96  # 203: not a multiple of any block size
    x = _data((m, k), dtype, device, g)
    offs = _offsets(m, n_groups, g, kind).to(device)
    _same(
        per_group_colwise_scales(x, offs, round_scales_to_power_of_2=pow2, backend="triton"),
        per_group_colwise_reference(x, offs, pow2),
    )
    xt = x.t().contiguous()  # (N=96, M=203), groups along dim 1
    want = per_group_rowwise_reference(xt, offs, pow2)
    for method in ("direct", "transpose", "auto"):
        got = per_group_rowwise_scales(
            xt, offs, round_scales_to_power_of_2=pow2, backend="triton", method=method,
            validate=method != "direct",  # no host read of offs: same result
        )  # fmt: skip
        assert got[0].shape == xt.shape and got[1].shape == (n_groups, 96)
        _same(got, want)


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
    """Groups of many widths on both sides of the largest size class (128 columns
    interpreted, 512 on the GPU) and its smaller classes, over a row count that fills no
    tile evenly."""
    g = fresh_generator()
    ends = torch.tensor(widths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    x = _data((37, int(ends[-1])), torch.bfloat16, device, g)
    got = per_group_rowwise_scales(x, ends.to(device), backend="triton", method="direct")
    _same(got, per_group_rowwise_reference(x, ends))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_rowwise_64_bit_offsets(device, monkeypatch):
    """The 64-bit offset path (tensors past 2^31 elements) gives the same bits; forced here
    on a small tensor."""
    monkeypatch.setattr(per_group_scales, "INT64_FROM", 0)
    g = fresh_generator()
    x = _data((40, 203), torch.bfloat16, device, g)
    offs = _offsets(203, 6, g, "aligned").to(device)
    got = per_group_rowwise_scales(x, offs, backend="triton", method="direct")
    _same(got, per_group_rowwise_reference(x, offs))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_rowwise_strided_input(device):
    """Rowwise on views whose group axis is not contiguous (a transpose, every other column of
    a wider tensor): the unaligned path, same bits as the reference."""
    g = fresh_generator()
    base = _data((203, 96), torch.bfloat16, device, g)
    wide = _data((40, 406), torch.bfloat16, device, g)
    for x in (base.t(), wide[:, ::2]):  # (96, 203) stride (1, 96); (40, 203) stride (406, 2)
        offs = _offsets(203, 7, g, "uneven").to(device)
        got = per_group_rowwise_scales(x, offs, backend="triton", method="direct")
        _same(got, per_group_rowwise_reference(x, offs))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_groups_longer_than_one_tile(dtype):
    """Groups past the largest size class (GPU tiling) take the looping path."""
    g = fresh_generator()
    x = _data((2100, 80), dtype, "cuda", g)  # colwise: a group of 1500 rows
    offs = torch.tensor([300, 300, 1800, 2100], dtype=torch.int32, device="cuda")
    _same(per_group_colwise_scales(x, offs), per_group_colwise_reference(x, offs))
    x = _data((24, 9000), dtype, "cuda", g)  # rowwise: a group 8500 columns wide
    offs = torch.tensor([500, 9000], dtype=torch.int32, device="cuda")
    _same(per_group_rowwise_scales(x, offs), per_group_rowwise_reference(x, offs))
    x = _data((200, 9000), dtype, "cuda", g)  # narrow groups (large items) and a wide one
    offs = torch.tensor([16 * i for i in range(1, 64)] + [9000], dtype=torch.int32, device="cuda")
    _same(per_group_rowwise_scales(x, offs), per_group_rowwise_reference(x, offs))


def test_reference_formula():
    x = torch.tensor([[1.0, -3.0], [2.0, 0.5], [100.0, 0.0]])
    data, scales = per_group_colwise_reference(x, torch.tensor([2, 2, 3], dtype=torch.int32))
    s = torch.tensor([[448 / 2, 448 / 3], [448 / 1e-12, 448 / 1e-12], [448 / 100, 448 / 1e-12]])
    torch.testing.assert_close(scales, s.float(), rtol=0, atol=0)
    assert data.float()[0, 0] == 224.0 and data.float()[0, 1] == -448.0
    _, s2 = per_group_colwise_reference(x, torch.tensor([3], dtype=torch.int32), True)
    assert s2.tolist() == [[4.0, 128.0]]  # 448/100 -> 4, 448/3 -> 128


@pytest.mark.parametrize(
    "offs, match",
    [
        (torch.tensor([5, 3, 10], dtype=torch.int32), "non-decreasing"),
        (torch.tensor([3, 9], dtype=torch.int32), "offs\\[-1\\] must equal"),
        (torch.tensor([3, 10], dtype=torch.int64), "int32"),
    ],
)
def test_bad_offsets(offs, match):
    x = torch.randn(10, 32)
    with pytest.raises((ValueError, TypeError), match=match):
        per_group_colwise_scales(x, offs)
    with pytest.raises((ValueError, TypeError), match=match):
        per_group_rowwise_scales(x.t(), offs)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_unvalidated_bad_offsets_stay_in_bounds(device):
    """validate=False: offsets are clamped in the kernel (decreasing, negative, past the end)."""
    x = torch.randn(40, 24, device=device)
    for ends in ([5, 3, 40], [-7, 20, 400], [50, 60]):
        offs = torch.tensor(ends, dtype=torch.int32, device=device)
        for fn, arg in ((per_group_colwise_scales, x), (per_group_rowwise_scales, x.t())):
            data, scales = fn(arg, offs, backend="triton", validate=False)
            assert data.shape == arg.shape and scales.shape == (len(ends), 24)
    if device == "cuda":
        torch.cuda.synchronize()  # an out-of-bounds access would surface here


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_torch_compile_fullgraph(device):
    """The custom op traces (fake shapes match) and gives the eager result."""
    g = fresh_generator()
    x = _data((48, 40), torch.bfloat16, device, g)
    offs = torch.tensor([16, 16, 48], dtype=torch.int32, device=device)

    def both(x, offs):
        col = per_group_colwise_scales(x, offs, backend="triton", validate=False)
        row = per_group_rowwise_scales(x.t(), offs, backend="triton", validate=False)
        return col, row

    backend = "inductor" if device == "cuda" else "aot_eager"
    got = torch.compile(both, fullgraph=True, backend=backend)(x, offs)
    want = both(x, offs)
    _same(got[0], want[0])
    _same(got[1], want[1])
