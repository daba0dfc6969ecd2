"""Per-group FP8 scaling kernels against the looping torch reference, bit for bit: both
kernels over odd sizes, jagged and empty groups, every input and data layout and method,
unvalidated bad offsets, empty extents, argument errors and torch.compile. The GEMM operand
layouts and the tiling paths are in test_per_group_tiling.py."""

from __future__ import annotations

import pytest
import torch
from helpers import KERNEL_DEVICES, bits, fresh_generator
from per_group_data import LAYOUTS, assert_same, make_input, make_offsets

from mxfp8_a2a import per_group_colwise_scales, per_group_rowwise_scales
from mxfp8_a2a.grouped import per_group_scales
from mxfp8_a2a.grouped.reference import (
    per_group_colwise_reference,
    per_group_rowwise_reference,
)


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
    odd sizes (203 rows: no block size divides it), jagged, empty and all-holding groups.
    48 columns: three of the interpreter's 16-column colwise strips (96 ran six, no other
    path; the interpreter's time goes with the strips)."""
    g = fresh_generator()
    m, k = (208 if kind == "aligned" else 203), 48
    x = make_input((m, k), dtype, device, g)
    offs = make_offsets(m, n_groups, g, kind).to(device)
    got = per_group_colwise_scales(x, offs, round_scales_to_power_of_2=pow2, backend="triton")
    assert_same(got, per_group_colwise_reference(x, offs, pow2))
    xt = x.t().contiguous()  # (N=48, M=203), groups along dim 1
    want = per_group_rowwise_reference(xt, offs, pow2)
    for method in ("direct", "transpose"):
        got = per_group_rowwise_scales(
            xt, offs, round_scales_to_power_of_2=pow2, backend="triton", method=method,
            validate=method != "direct",  # no host read of offs: same result
        )  # fmt: skip
        assert got[1].shape == (n_groups, k)
        assert_same(got, want)


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
    base = make_input((104, 48), torch.bfloat16, device, g)
    wide = torch.zeros(104, 96, dtype=torch.bfloat16, device=device)
    wide[:, ::2] = base
    offs0 = make_offsets(104, 5, g, kind).to(device)  # along the rows (colwise)
    offs1 = make_offsets(48, 3, g, kind).to(device)  # along the columns (rowwise)
    for name, x in _views(base, wide).items():
        assert torch.equal(x.view(torch.int16), base.view(torch.int16)), name
        want0 = per_group_colwise_reference(x, offs0, False, layout)
        want1 = per_group_rowwise_reference(x, offs1, False, layout)
        for method in ("direct", "transpose"):
            kw = dict(backend="triton", method=method, data_layout=layout, validate=False)
            assert_same(per_group_colwise_scales(x, offs0, **kw), want0)
            assert_same(per_group_rowwise_scales(x, offs1, **kw), want1)


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
    x = make_input((104, 40), torch.bfloat16, device, g)
    offs = torch.tensor(ends, dtype=torch.int32, device=device)
    for layout in LAYOUTS:
        want0 = per_group_colwise_reference(x, offs, False, layout)
        want1 = per_group_rowwise_reference(x.t(), offs, False, layout)
        for backend, method in (("torch", "auto"), ("triton", "direct"), ("triton", "transpose")):
            kw = dict(backend=backend, method=method, data_layout=layout, validate=False)
            assert_same(per_group_colwise_scales(x, offs, **kw), want0)
            assert_same(per_group_rowwise_scales(x.t(), offs, **kw), want1)
        data, scales = want0
        covered = min(max([0, *ends]), 104)
        assert not bits(data)[covered:].any()  # past the last end: zeros
        assert scales.shape == (len(ends), 40)
    # the same bits again: the data past the last end is written, not left as found
    again = per_group_colwise_scales(x, offs, backend="triton", validate=False)
    assert_same(again, per_group_colwise_reference(x, offs))
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
                assert_same(
                    per_group_colwise_scales(x, offs, **kw),
                    per_group_colwise_reference(x, offs, False, layout),
                )


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
    x = make_input((48, 40), torch.bfloat16, device, g)
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
        x = make_input((rows, 40), torch.bfloat16, device, g)
        offs[-1] = rows
        got, want = compiled(x, offs), both(x, offs)
        assert_same(got[0], want[0])
        assert_same(got[1], want[1])


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_strided_offsets_match_contiguous(device):
    """offs as a strided view gives the groups its values say (the kernels read a copy)."""
    g = fresh_generator()
    x = make_input((40, 32), torch.bfloat16, device, g)
    base = torch.tensor([8, 0, 8, 0, 30, 0, 40, 0], dtype=torch.int32, device=device)
    offs = base[::2]
    kw = dict(backend="triton", validate=False)
    assert_same(
        per_group_colwise_scales(x, offs, **kw), per_group_colwise_scales(x, offs.clone(), **kw)
    )
    assert_same(
        per_group_rowwise_scales(x.t(), offs, **kw),
        per_group_rowwise_scales(x.t(), offs.clone(), **kw),
    )
