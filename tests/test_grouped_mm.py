"""grouped_mm on CPU: the plain-torch reference, the CPU loop, the CUDA paths (traced with fake
CUDA tensors and run with torch._scaled_grouped_mm emulated) and the argument checks. The MoE
layer's experts on top: test_moe_experts.py; the GPU tests: test_grouped_mm_gpu.py.

    python -m pytest -q tests/test_grouped_mm.py
"""

from __future__ import annotations

import pytest
import torch
from emulated_gemm import _emulated_op
from grouped_mm_data import (
    KINDS,
    SQNR_FLOOR_DB,
    _close,
    _exact,
    _fwd_bwd,
    _inputs,
    _public,
    _reference,
    _representable_inputs,
    assert_bf16_grad_w,
    fr,
    gm,
    needs_interpreter,
)
from helpers import fresh_generator, sqnr_db
from torch._subclasses.fake_tensor import FakeTensorMode

import mxfp8_a2a as mx

# ---------------------------------------------------------------------------- emulation


@pytest.fixture
def emulated_gemm(monkeypatch):
    """The CUDA FP8 path callable on CPU tensors: torch._scaled_grouped_mm emulated."""
    monkeypatch.setattr(fr, "_scaled_gmm", _emulated_op)


@pytest.fixture
def fp8_call(emulated_gemm):
    """The CUDA FP8 path, (x, w, offs, cached, hp_grad_w) -> out: the custom op
    mxfp8_a2a::fp8_rowwise_grouped_mm (eager calls and torch.compile's traces alike)."""
    return fr.fp8_rowwise_grouped_mm


@pytest.fixture
def emulated(fp8_call):
    return lambda x, w, offs: fp8_call(x, w, offs, [], False)


class _Ctx:
    """What the Functions use of autograd's ctx (autograd itself aborts on fake CUDA)."""

    needs_input_grad = (True, True, False, False)

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


# ---------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_loop_and_reference_match_exact_products(dtype, kind):
    g = fresh_generator()
    args = _inputs(203, 64, 48, 6, kind, dtype, "cpu", g)
    want = _exact(*args)
    ref = _fwd_bwd(_reference("bf16"), *args)
    got = _fwd_bwd(_public("bf16"), *args)
    tol = (2**-8, 1e-6) if dtype == torch.bfloat16 else (1e-5, 1e-6)
    for a, b, c in zip(got, ref, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the loop op is the reference
        torch.testing.assert_close(a.double(), c, rtol=tol[0], atol=tol[1] * c.abs().max())


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_reference_is_exact_on_representable_data(kind):
    """Scales of exactly 1: the FP8 reference gives the exact products, rounded to bf16 (so
    its scales are applied the right way round, to the right rows, columns and groups)."""
    args = _representable_inputs(93, 48, 32, 5, kind, torch.float32, fresh_generator())
    _close(_fwd_bwd(_reference("fp8_rowwise"), *args), _exact(*args), "fp8_rowwise")


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_reference_close_to_bf16(kind):
    args = _inputs(400, 64, 48, 6, kind, torch.bfloat16, "cpu", fresh_generator())
    fp8 = _fwd_bwd(_reference("fp8_rowwise"), *args)
    exact = _exact(*args)
    for name, a, b in zip(("out", "grad_x", "grad_w"), fp8, exact, strict=True):
        assert sqnr_db(b, a) >= SQNR_FLOOR_DB, (name, sqnr_db(b, a))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", KINDS)
def test_fp8_cuda_path_emulated_matches_reference(emulated, dtype, kind):
    """The CUDA FP8 code (operand casts, layouts, token padding, scale shapes) on CPU with
    torch._scaled_grouped_mm emulated: the reference's numbers up to fp32 summation order."""
    args = _inputs(203, 64, 48, 6, kind, dtype, "cpu", fresh_generator())
    got = _fwd_bwd(emulated, *args)
    _close(got, _fwd_bwd(_reference("fp8_rowwise"), *args), "fp8_rowwise")
    assert all(t.dtype == dtype for t in got)


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_gw_hp_is_fp8_forward_and_grad_x_with_bf16_grad_w(kind):
    """precision="fp8_rowwise_gw_hp": fp8_rowwise's output and grad_x bit for bit, bf16's
    grad_w bit for bit (references), and its CUDA path (emulated) the same up to fp32
    summation order."""
    args = _inputs(203, 64, 48, 6, kind, torch.bfloat16, "cpu", fresh_generator())
    hp = _fwd_bwd(_reference("fp8_rowwise_gw_hp"), *args)
    fp8, bf16 = _fwd_bwd(_reference("fp8_rowwise"), *args), _fwd_bwd(_reference("bf16"), *args)
    for a, b in zip(hp, (fp8[0], fp8[1], bf16[2]), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fp8_gw_hp_cuda_path_emulated_matches_reference(fp8_call):
    args = _inputs(203, 64, 48, 6, "with_empty", torch.bfloat16, "cpu", fresh_generator())
    got = _fwd_bwd(lambda x, w, o: fp8_call(x, w, o, [], True), *args)
    want = _fwd_bwd(_reference("fp8_rowwise_gw_hp"), *args)
    _close(got, want, "fp8_rowwise_gw_hp")
    # grad_w through torch._grouped_mm (its CPU fallback: a bf16 GEMM of its own order)
    for gw in (got[2], want[2]):
        assert_bf16_grad_w(gw, args[0], args[3], args[2])


def test_fp8_cuda_path_emulated_is_exact_on_representable_data(emulated):
    args = _representable_inputs(77, 32, 48, 4, "with_empty", torch.bfloat16, fresh_generator())
    _close(_fwd_bwd(emulated, *args), _exact(*args), "fp8_rowwise")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_paths_trace_with_fake_cuda_tensors(dtype):
    """Both CUDA paths, forward and backward, on fake CUDA tensors: the meta kernels of
    torch's grouped GEMMs accept every operand (dtype, layout, scale shapes)."""
    m, k, n, e = 45, 32, 48, 4
    with FakeTensorMode():
        x = torch.empty(m, k, device="cuda", dtype=dtype)
        w = torch.empty(e, k, n, device="cuda", dtype=dtype)
        offs = torch.empty(e, device="cuda", dtype=torch.int32)
        grad = torch.empty(m, n, device="cuda", dtype=dtype)
        out = fr._fp8_forward(x, w, offs, [])
        gx, gw = fr._fp8_grads(x, w, offs, grad, [], False, True, True)
        assert (out.shape, gx.shape, gw.shape) == ((m, n), (m, k), (e, k, n))
        assert out.dtype == gx.dtype == gw.dtype == dtype
        if dtype == torch.bfloat16:  # fp8_rowwise_gw_hp's grad_w, the bf16 path
            _, gw = fr._fp8_grads(x, w, offs, grad, [], True, False, True)
            assert gw.shape == (e, k, n) and gw.dtype == dtype
            ctx = _Ctx()
            out = gm._GroupedMM.forward(ctx, x, w, offs, False)
            gx, gw, *_ = gm._GroupedMM.backward(ctx, grad)
            assert (out.shape, gx.shape, gw.shape) == ((m, n), (m, k), (e, k, n))


def test_torch_compile_fullgraph_cpu():
    args = _inputs(70, 32, 16, 5, "with_empty", torch.bfloat16, "cpu", fresh_generator())
    compiled = torch.compile(_public("bf16"), fullgraph=True, backend="aot_eager")
    for a, b in zip(_fwd_bwd(compiled, *args), _fwd_bwd(_public("bf16"), *args), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@needs_interpreter
def test_torch_compile_fullgraph_fp8_cuda_path_emulated(emulated_gemm):
    """The CUDA FP8 path traces in one graph (per-group kernels through the interpreter,
    torch._scaled_grouped_mm emulated as a custom op with torch's meta as its fake)."""
    args = _inputs(40, 32, 16, 3, "with_empty", torch.bfloat16, "cpu", fresh_generator())
    torch._dynamo.reset()
    # dynamic=True: symbolic shapes and strides, as a recompile at new sizes gets them
    fn = lambda x, w, o: fr.fp8_rowwise_grouped_mm(x, w, o, [], False)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=True)
    _close(_fwd_bwd(compiled, *args), _fwd_bwd(_reference("fp8_rowwise"), *args), "fp8_rowwise")


@needs_interpreter
@pytest.mark.parametrize("m", [40, 0])
def test_fp8_op_passes_opcheck(emulated_gemm, m):
    """mxfp8_a2a::fp8_rowwise_grouped_mm: schema, fake, registered autograd and AOT dispatch
    (torch.library.opcheck), with rows and without."""
    x, w, offs, _ = _inputs(m, 32, 16, 3, "with_empty", torch.bfloat16, "cpu", fresh_generator())
    x, w = x.requires_grad_(True), w.requires_grad_(True)
    torch.library.opcheck(fr.fp8_rowwise_grouped_mm, (x, w, offs, [], False))
    torch.library.opcheck(fr.fp8_rowwise_grouped_mm, (x, w, offs, [], True))
    # with cached FP8 weights all but the schema test (it multiplies them: float8 cannot)
    cached = list(fr.fp8_rowwise_weights(w))
    checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(fr.fp8_rowwise_grouped_mm, (x, w, offs, cached, False), test_utils=checks)


@needs_interpreter
def test_fp8_weights_made_once_give_the_same_bits(fp8_call, emulated):
    """The CUDA FP8 path with fp8_rowwise_weights(w) made beforehand: the same bits as the
    path that casts w itself, forward and both gradients."""
    args = _inputs(61, 32, 48, 4, "with_empty", torch.bfloat16, "cpu", fresh_generator())
    fp8 = list(fr.fp8_rowwise_weights(args[1]))
    reused = _fwd_bwd(lambda x, w, o: fp8_call(x, w, o, fp8, False), *args)
    for a, b in zip(reused, _fwd_bwd(emulated, *args), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_fp8_weights_raise_clear_errors():
    x, w = torch.randn(8, 32), torch.randn(3, 32, 16)
    offs = torch.tensor([2, 5, 8], dtype=torch.int32)
    fp8 = fr.fp8_rowwise_weights(w)
    with pytest.raises(ValueError, match="is for precision='fp8_rowwise'"):
        mx.grouped_mm(x, w, offs, fp8_weights=fp8)
    other = fr.fp8_rowwise_weights(torch.randn(3, 32, 32))
    with pytest.raises(ValueError, match=r"fp8_rowwise_weights\(w\) of this w \[3, 32, 16\]"):
        mx.grouped_mm(x, w[..., :16], offs, precision="fp8_rowwise", fp8_weights=other)
    with pytest.raises(ValueError, match="fp8_rowwise_weights"):
        mx.grouped_mm(x, w, offs, precision="fp8_rowwise", fp8_weights=tuple(fp8))
    with pytest.raises(ValueError, match="3-D bf16 or fp32"):
        fr.fp8_rowwise_weights(w[0])


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
        ),
    ],
)
@pytest.mark.parametrize("precision", gm.PRECISIONS)
@pytest.mark.parametrize("m, k, n", [(0, 32, 16), (20, 0, 16), (20, 32, 0)])
def test_empty_sizes(device, precision, m, k, n):
    """No rows, K = 0 or N = 0: zeros (and zero gradients) of the right shapes."""
    dtype = (
        torch.bfloat16 if precision == "fp8_rowwise_gw_hp" or device == "cuda" else torch.float32
    )
    x = torch.randn(m, k, dtype=dtype, device=device, requires_grad=True)
    w = torch.randn(3, k, n, dtype=dtype, device=device, requires_grad=True)
    offs = torch.tensor([0, m // 2, m], dtype=torch.int32, device=device)
    out = mx.grouped_mm(x, w, offs, precision=precision)
    out.float().sum().backward()
    assert out.shape == (m, n) and out.dtype == dtype and not out.any()
    assert x.grad.shape == x.shape and not x.grad.any()
    assert w.grad.shape == w.shape and not w.grad.any()


def _bad(**change):
    args = dict(
        x=torch.randn(20, 32), w=torch.randn(3, 32, 16), offs=torch.tensor([5, 5, 20]).int()
    )
    args.update(change)
    return args


BAD = [
    (dict(precision="fp16"), ValueError, "precision must be one of"),
    (dict(x=torch.randn(2, 20, 32)), ValueError, "x must be a 2-D tensor"),
    (dict(w=torch.randn(32, 16)), ValueError, "w must be a 3-D tensor"),
    (dict(w=torch.randn(3, 48, 16)), ValueError, "x is .M, K=32. but w is .E, K=48"),
    (dict(w=torch.randn(3, 32, 16).double()), TypeError, "must share one dtype"),
    (dict(offs=torch.tensor([5, 5, 20])), ValueError, "offs must be an int32 tensor .E=3."),
    (dict(offs=torch.tensor([5, 20]).int()), ValueError, "offs must be an int32 tensor .E=3."),
    (dict(offs=torch.tensor([[5, 5, 20]]).int()), ValueError, "offs must be an int32 tensor"),
    (dict(offs=torch.tensor([5, 3, 20]).int()), ValueError, "non-decreasing and >= 0"),
    (dict(offs=torch.tensor([-1, 3, 20]).int()), ValueError, "non-decreasing and >= 0"),
    (dict(offs=torch.tensor([5, 5, 21]).int()), ValueError, r"offs\[-1\] must be at most x.shape"),
    (dict(offs=torch.tensor([5, 5, 20], device="meta").int()), ValueError, "one device"),
    (dict(precision="fp8_rowwise", w=torch.randn(3, 32, 24)), ValueError, "multiples of 16"),
    (
        dict(precision="fp8_rowwise", x=torch.randn(20, 40), w=torch.randn(3, 40, 16)),
        ValueError,
        "pad x's columns",
    ),
    (
        dict(precision="fp8_rowwise", x=torch.randn(20, 32).half(), w=torch.randn(3, 32, 16)),
        TypeError,
        "must share one dtype",
    ),
    (dict(precision="fp8_rowwise_gw_hp"), TypeError, r"\(torch.bfloat16,\) for precision="),
]


@pytest.mark.parametrize("change, exc, match", BAD)
def test_bad_arguments_raise_clear_errors(change, exc, match):
    args = _bad(**change)
    with pytest.raises(exc, match=match):
        mx.grouped_mm(args.pop("x"), args.pop("w"), args.pop("offs"), **args)


@pytest.mark.parametrize("grouped, scaled", [(True, True), (False, False)])
def test_paths_without_torch_grouped_gemms(monkeypatch, grouped, scaled):
    """Without torch's grouped GEMMs (neither torch.nn.functional's nor the private ops),
    CUDA inputs take the loop op (bf16) and the plain-torch reference (fp8_rowwise)."""
    monkeypatch.setattr(gm, "HAS_GROUPED_MM", grouped)
    monkeypatch.setattr(gm, "HAS_SCALED_GROUPED_MM", scaled)
    with FakeTensorMode():
        bf16 = torch.empty(8, 16, device="cuda", dtype=torch.bfloat16)
        fp32 = torch.empty(8, 16, device="cuda")
    assert gm.gemm_path(bf16, "bf16") == ("grouped" if grouped else "loop")
    assert gm.gemm_path(fp32, "bf16") == "loop"
    assert gm.gemm_path(bf16, "fp8_rowwise") == ("scaled" if scaled else "reference")
    assert gm.gemm_path(torch.empty(8, 16), "fp8_rowwise") == "reference"
    assert gm.gemm_path(torch.empty(8, 16, dtype=torch.bfloat16), "bf16") == "loop"
