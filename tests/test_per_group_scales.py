"""Per-group FP8 scaling kernels against the looping torch reference, bit for bit."""

from __future__ import annotations

import pytest
import torch
from helpers import KERNEL_DEVICES, bits, fresh_generator

from mxfp8_a2a import per_group_colwise_scales, per_group_rowwise_scales
from mxfp8_a2a.grouped import per_group_scales
from mxfp8_a2a.grouped.reference import (
    expert_column_reference,
    padded_token_reference,
    per_group_colwise_reference,
    per_group_rowwise_reference,
)

LAYOUTS = ("row_major", "column_major")


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
    x[5 % shape[0], 6] = 3e38  # huge
    x[6 % shape[0], 7] = 1e-40  # fp32 subnormal (bf16 keeps it)
    return x.to(dtype).to(device)


def _same(got, want):
    """Same bits, shape and memory layout (strides) of the data; same scales."""
    (dg, sg), (dw, sw) = got, want
    assert dg.shape == dw.shape and dg.stride() == dw.stride(), (dg.stride(), dw.stride())
    assert torch.equal(bits(dg), bits(dw))
    torch.testing.assert_close(sg, sw, rtol=0, atol=0, equal_nan=True)  # NaN's sign is free


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(
    "dtype, pow2", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)]
)
@pytest.mark.parametrize(
    "n_groups, kind",
    [(1, "uneven"), (16, "uneven"), (32, "with_empty"), (5, "one_holds_all"), (6, "aligned")],
)
def test_colwise_and_rowwise_match_reference(device, dtype, pow2, n_groups, kind):
    """Both kernels (colwise: of a row-major x; row-block: rowwise of a row-major x),
    odd sizes (203 rows: no block size divides it), jagged, empty and all-holding groups."""
    g = fresh_generator()
    m, k = (208 if kind == "aligned" else 203), 96
    x = _data((m, k), dtype, device, g)
    offs = _offsets(m, n_groups, g, kind).to(device)
    got = per_group_colwise_scales(x, offs, round_scales_to_power_of_2=pow2, backend="triton")
    _same(got, per_group_colwise_reference(x, offs, pow2))
    xt = x.t().contiguous()  # (N=96, M=203), groups along dim 1
    want = per_group_rowwise_reference(xt, offs, pow2)
    for method in ("direct", "transpose"):
        got = per_group_rowwise_scales(
            xt, offs, round_scales_to_power_of_2=pow2, backend="triton", method=method,
            validate=method != "direct",  # no host read of offs: same result
        )  # fmt: skip
        assert got[1].shape == (n_groups, 96)
        _same(got, want)


def _views(base: torch.Tensor, wide: torch.Tensor) -> dict[str, torch.Tensor]:
    """x in three memory layouts: row-major, a transposed view of a row-major x.t(), and
    every other column of a wider tensor (no axis contiguous)."""
    return {"contiguous": base, "transposed": base.t().contiguous().t(), "strided": wide[:, ::2]}


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["uneven", "aligned"])
def test_every_layout_and_method(device, layout, kind):
    """Inputs contiguous, transposed and strided, data row- or column-major, both kernels
    (methods "direct" and "transpose"), both functions: the reference's bits, the requested
    data layout. 104 x 48: not a multiple of the interpreter's colwise tiles (32 rows
    in the amax pass, 16 in the cast) or its 16-column strips."""
    g = fresh_generator()
    base = _data((104, 48), torch.bfloat16, device, g)
    wide = torch.zeros(104, 96, dtype=torch.bfloat16, device=device)
    wide[:, ::2] = base
    offs0 = _offsets(104, 5, g, kind).to(device)  # along the rows (colwise)
    offs1 = _offsets(48, 3, g, kind).to(device)  # along the columns (rowwise)
    for name, x in _views(base, wide).items():
        assert torch.equal(x.view(torch.int16), base.view(torch.int16)), name
        want0 = per_group_colwise_reference(x, offs0, False, layout)
        want1 = per_group_rowwise_reference(x, offs1, False, layout)
        for method in ("direct", "transpose"):
            kw = dict(backend="triton", method=method, data_layout=layout, validate=False)
            _same(per_group_colwise_scales(x, offs0, **kw), want0)
            _same(per_group_rowwise_scales(x, offs1, **kw), want1)


def test_auto_reads_in_place(monkeypatch):
    """method="auto" runs the row-block kernel (group_dim 1) where the group axis is
    contiguous in x and in the data and the colwise kernels (group_dim 0) elsewhere, always on
    x's own storage (no copy). CPU, torch-free: the op is replaced by a recorder."""
    calls = []

    def record(x, offs, pow2, group_dim, column_major):
        calls.append((x.data_ptr(), tuple(x.stride()), group_dim, column_major))
        data = per_group_scales.empty_data(x.shape, LAYOUTS[column_major], x.device)
        return data.view(torch.float8_e4m3fn), x.new_empty((offs.numel(), x.shape[1 - group_dim]))

    monkeypatch.setattr(per_group_scales, "_per_group_op", record)
    # backend="triton" on CPU tensors, also where the interpreter is off (a GPU machine)
    monkeypatch.setattr(per_group_scales, "resolve_backend", lambda *args: "triton")
    go = torch.randn(64, 32)  # row-major (M, N), groups along M
    kw = dict(backend="triton", validate=False)
    cases = [  # (function, x, data layout) -> (strides seen by the kernel, group_dim, column_major)
        (per_group_colwise_scales, go, "column_major", ((32, 1), 0, True)),  # grad_w operands
        (per_group_rowwise_scales, go.t(), "row_major", ((32, 1), 0, True)),  # the same, transposed
        (per_group_colwise_scales, go, "row_major", ((32, 1), 0, False)),
        (per_group_rowwise_scales, go, "row_major", ((32, 1), 1, False)),  # row-block kernel
        (per_group_rowwise_scales, go, "column_major", ((1, 32), 0, False)),
        (per_group_colwise_scales, go.t(), "column_major", ((32, 1), 1, False)),
    ]
    for fn, x, layout, want in cases:
        calls.clear()
        extent = x.shape[0 if fn is per_group_colwise_scales else 1]
        offs = torch.tensor([16, extent], dtype=torch.int32)
        data, _ = fn(x, offs, data_layout=layout, **kw)
        assert calls == [(go.data_ptr(), *want)], (fn.__name__, layout, calls)
        assert data.shape == x.shape
        assert data.is_contiguous() == (layout == "row_major")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(
    "ends",
    [[5, 3, 150], [-7, 20, 400], [50, 60], [], [-5]],
    ids=["decreasing", "negative_and_past_end", "short", "none", "only_negative"],
)
def test_unvalidated_bad_offsets_defined(device, ends):
    """validate=False: every backend and kernel gives the reference's defined result for bad
    offsets (clamped into range, running maximum; indices past the last end zero; empty
    offs: zeros), the same on every call (no uninitialized memory)."""
    g = fresh_generator()
    x = _data((104, 40), torch.bfloat16, device, g)
    offs = torch.tensor(ends, dtype=torch.int32, device=device)
    for layout in LAYOUTS:
        want0 = per_group_colwise_reference(x, offs, False, layout)
        want1 = per_group_rowwise_reference(x.t(), offs, False, layout)
        for backend, method in (("torch", "auto"), ("triton", "direct"), ("triton", "transpose")):
            kw = dict(backend=backend, method=method, data_layout=layout, validate=False)
            _same(per_group_colwise_scales(x, offs, **kw), want0)
            _same(per_group_rowwise_scales(x.t(), offs, **kw), want1)
        data, scales = want0
        covered = min(max([0, *ends]), 104)
        assert not bits(data)[covered:].any()  # past the last end: zeros
        assert scales.shape == (len(ends), 40)
    # the same bits again: the data past the last end is written, not left as found
    again = per_group_colwise_scales(x, offs, backend="triton", validate=False)
    _same(again, per_group_colwise_reference(x, offs))
    if device == "cuda":
        torch.cuda.synchronize()  # an out-of-bounds access would surface here


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_empty_extents(device):
    """No rows, no columns, no groups: the reference's shapes and values, no launch errors."""
    for shape, ends in (((0, 8), [0, 0]), ((16, 0), [4, 16]), ((16, 8), []), ((0, 8), [])):
        x = torch.randn(shape, device=device)
        offs = torch.tensor(ends, dtype=torch.int32, device=device)
        for layout in LAYOUTS:
            for method in ("direct", "transpose"):
                kw = dict(backend="triton", method=method, data_layout=layout, validate=False)
                _same(
                    per_group_colwise_scales(x, offs, **kw),
                    per_group_colwise_reference(x, offs, False, layout),
                )


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("kind", ["uneven", "with_empty", "one_holds_all", "aligned"])
def test_padded_token_scales(device, kind):
    """The grad_w operand layout: rowwise of x.t() with each group's tokens from a multiple of
    16, at least 16 wide, zeros between, the padded ends out; the reference's numbers."""
    g = fresh_generator()
    m, k, n_groups = 203, 40, 7
    x = _data((m, k), torch.bfloat16, device, g)
    offs = _offsets(m, n_groups, g, kind).to(device)
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
    x = _data((37, 16), torch.bfloat16, device, g)
    for ends in ([40, 3, 50], [0, 0, 0], [2, -1, 37], [37]):
        offs = torch.tensor(ends, dtype=torch.int32, device=device)
        data, scales, pad = per_group_scales.padded_token_scales(x, offs)
        want = padded_token_reference(x, offs)
        assert torch.equal(bits(data), bits(want[0])) and torch.equal(pad, want[2]), ends
        torch.testing.assert_close(scales, want[1], rtol=0, atol=0, equal_nan=True)


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
    w = _data((e * k, n), torch.bfloat16, device, g)
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
    x = _data((37, int(ends[-1])), torch.bfloat16, device, g)
    got = per_group_rowwise_scales(x, ends.to(device), backend="triton", method="direct")
    _same(got, per_group_rowwise_reference(x, ends))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_64_bit_offsets(device, monkeypatch):
    """The 64-bit offset path of both kernels (tensors past 2^31 elements) gives the same
    bits; forced here on a small tensor."""
    monkeypatch.setattr(per_group_scales, "INT64_FROM", 0)
    g = fresh_generator()
    x = _data((40, 203), torch.bfloat16, device, g)
    offs = _offsets(203, 6, g, "aligned").to(device)
    for method in ("direct", "transpose"):
        got = per_group_rowwise_scales(x, offs, backend="triton", method=method)
        _same(got, per_group_rowwise_reference(x, offs))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_groups_longer_than_one_tile(dtype):
    """Groups past the row-block kernel's largest size class take its looping path."""
    g = fresh_generator()
    x = _data((24, 9000), dtype, "cuda", g)  # rowwise: a group 8500 columns wide
    offs = torch.tensor([500, 9000], dtype=torch.int32, device="cuda")
    _same(per_group_rowwise_scales(x, offs), per_group_rowwise_reference(x, offs))
    x = _data((200, 9000), dtype, "cuda", g)  # narrow groups (large items) and a wide one
    offs = torch.tensor([16 * i for i in range(1, 64)] + [9000], dtype=torch.int32, device="cuda")
    _same(per_group_rowwise_scales(x, offs), per_group_rowwise_reference(x, offs))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n_groups", [1, 16, 64])
def test_colwise_kernels_at_scale(n_groups):
    """Thousands of programs in flight: the atomics under real concurrency, every layout the
    grad_w GEMM uses."""
    g = fresh_generator()
    x = _data((8200, 2048), torch.bfloat16, "cuda", g)
    offs = _offsets(8200, n_groups, g, "aligned" if n_groups != 16 else "uneven").cuda()
    for layout in LAYOUTS:
        want = per_group_colwise_reference(x, offs, False, layout)
        for _ in range(3):
            _same(per_group_colwise_scales(x, offs, data_layout=layout, validate=False), want)
        want = per_group_rowwise_reference(x.t(), offs, False, layout)
        _same(per_group_rowwise_scales(x.t(), offs, data_layout=layout, validate=False), want)


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
        (torch.tensor([], dtype=torch.int32), "no groups"),
        (torch.tensor([3, 10], dtype=torch.int64), "int32"),
    ],
)
def test_bad_offsets(offs, match):
    x = torch.randn(10, 32)
    with pytest.raises((ValueError, TypeError), match=match):
        per_group_colwise_scales(x, offs)
    with pytest.raises((ValueError, TypeError), match=match):
        per_group_rowwise_scales(x.t(), offs)


def test_bad_arguments():
    x, offs = torch.randn(10, 32), torch.tensor([10], dtype=torch.int32)
    with pytest.raises(ValueError, match="data_layout"):
        per_group_colwise_scales(x, offs, data_layout="col")
    with pytest.raises(ValueError, match="method"):
        per_group_rowwise_scales(x.t(), offs, method="copy")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_torch_compile_fullgraph(device):
    """The custom op traces (fake shapes and strides match) and gives the eager result."""
    g = fresh_generator()
    x = _data((48, 40), torch.bfloat16, device, g)
    offs = torch.tensor([16, 16, 48], dtype=torch.int32, device=device)

    def both(x, offs):
        kw = dict(backend="triton", validate=False)
        col = per_group_colwise_scales(x, offs, data_layout="column_major", **kw)
        row = per_group_rowwise_scales(x.t(), offs, **kw)
        return col, row

    backend = "inductor" if device == "cuda" else "aot_eager"
    torch._dynamo.reset()
    # dynamic=True: symbolic shapes and strides, as a recompile at new sizes gets them
    compiled = torch.compile(both, fullgraph=True, backend=backend, dynamic=True)
    for rows in (48, 64):
        x = _data((rows, 40), torch.bfloat16, device, g)
        offs[-1] = rows
        got, want = compiled(x, offs), both(x, offs)
        _same(got[0], want[0])
        _same(got[1], want[1])


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_strided_offsets_match_contiguous(device):
    """offs as a strided view gives the groups its values say (the kernels read a copy)."""
    g = fresh_generator()
    x = _data((40, 32), torch.bfloat16, device, g)
    base = torch.tensor([8, 0, 8, 0, 30, 0, 40, 0], dtype=torch.int32, device=device)
    offs = base[::2]
    kw = dict(backend="triton", validate=False)
    _same(per_group_colwise_scales(x, offs, **kw), per_group_colwise_scales(x, offs.clone(), **kw))
    _same(
        per_group_rowwise_scales(x.t(), offs, **kw),
        per_group_rowwise_scales(x.t(), offs.clone(), **kw),
    )
