"""grouped_mm with rows past offs[-1] (the static dispatch's padding): ignored, with zero
output and zero gradient there and nothing added to w's gradient, for every precision and
path: the public call (CPU: the loop op and the plain-torch reference; CUDA), the reference
itself, the CUDA code on CPU (torch._grouped_mm's CPU kernel, which leaves those rows
unwritten as the CUDA one does; the FP8 op with torch._scaled_grouped_mm emulated), and
torch.compile. The trailing rows of x and of grad_out hold garbage (NaN and inf among it).

    python -m pytest -q tests/test_grouped_mm_trailing.py
"""

from __future__ import annotations

import pytest
import torch
from emulated_gemm import _emulated_op
from grouped_mm_data import SM90, fr, gm, needs_interpreter
from helpers import KERNEL_DEVICES, fresh_generator

import mxfp8_a2a as mx
from mxfp8_a2a.grouped import grouped_mm_reference
from mxfp8_a2a.grouped.trailing import zero_trailing_rows_

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
# an empty middle group, an empty last group, 16-aligned groups, every row trailing
ENDS = [[5, 5, 21], [5, 21, 21], [0, 16, 32], [0, 0, 0]]
M, K, N, E = 40, 32, 48, 3


def _data(ends, device, dtype=torch.bfloat16):
    """x [M, K], w [E, K, N], offs, grad_out [M, N]; rows of x and grad_out from offs[-1] on:
    large random values, a NaN row and an inf row."""
    g = fresh_generator()
    x = torch.randn(M, K, generator=g)
    w = torch.randn(E, K, N, generator=g) * K**-0.5
    grad = torch.randn(M, N, generator=g)
    end = ends[-1]
    for t in (x, grad):
        t[end:] *= 1e3
        t[end] = float("nan")
        t[end + 1] = float("inf")
    offs = torch.tensor(ends, dtype=torch.int32)
    return x.to(device, dtype), w.to(device, dtype), offs.to(device), grad.to(device, dtype)


def _run(fn, x, w, offs, grad):
    x, w = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    out = fn(x, w, offs)
    out.backward(grad)
    return out.detach(), x.grad, w.grad


def _check(fn, x, w, offs, grad, exact_grad_w=True):
    """Rows from offs[-1] on: zero output and grad_x; the rows before, and grad_w, the same
    bits as fn on x[:offs[-1]] (exact_grad_w=False: grad_w the same bits as with zero
    trailing rows, and close to the call without them)."""
    end = int(offs[-1])
    out, gx, gw = _run(fn, x, w, offs, grad)
    assert out.shape == (M, N) and gx.shape == (M, K) and gw.shape == (E, K, N)
    assert not out[end:].any() and not gx[end:].any()  # zeros (NaN would count as nonzero)
    want_out, want_gx, want_gw = _run(fn, x[:end], w, offs, grad[:end])
    assert torch.equal(out[:end], want_out) and torch.equal(gx[:end], want_gx)
    if exact_grad_w:
        assert torch.equal(gw, want_gw)
    else:  # the FP8 grad_w: a longer padded token axis (zeros) could change the fp32 sum
        # order of an emulated GEMM (on an H200 and here it gave the same bits)
        zeroed = [t.clone() for t in (x, grad)]
        for t in zeroed:
            t[end:] = 0
        assert torch.equal(gw, _run(fn, zeroed[0], w, offs, zeroed[1])[2])
        torch.testing.assert_close(gw, want_gw, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", gm.PRECISIONS)
@pytest.mark.parametrize("ends", ENDS)
def test_public_ignores_trailing_rows(device, precision, ends):
    if device == "cuda" and precision != "bf16" and not SM90:
        pytest.skip(f"{precision} needs an sm_90+ GPU")
    fn = lambda x, w, o: mx.grouped_mm(x, w, o, precision=precision)  # noqa: E731
    _check(fn, *_data(ends, device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_loop_ignores_trailing_rows(dtype):
    """The per-expert loop op in other dtypes (fp16 only for "bf16")."""
    _check(mx.grouped_mm, *_data([5, 5, 21], "cpu", dtype))


@pytest.mark.parametrize("precision", gm.PRECISIONS)
@pytest.mark.parametrize("ends", ENDS)
def test_reference_ignores_trailing_rows(precision, ends):
    fn = lambda x, w, o: grouped_mm_reference(x, w, o, precision=precision)  # noqa: E731
    _check(fn, *_data(ends, "cpu"))


@needs_interpreter
@pytest.mark.skipif(not gm.HAS_GROUPED_MM, reason="this torch has no grouped GEMM")
@pytest.mark.parametrize("ends", ENDS)
def test_grouped_gemm_path_zeroes_unwritten_rows(ends):
    """The CUDA bf16 path (torch's grouped GEMM, then the zeroing kernel) on CPU tensors."""
    _check(lambda x, w, o: gm._GroupedMM.apply(x, w, o, False), *_data(ends, "cpu"))


@needs_interpreter
@pytest.mark.parametrize(  # (interpreted kernels: about 2 s a forward and backward)
    "ends, hp", [([5, 21, 21], False), ([0, 16, 32], True), ([0, 0, 0], False)]
)
def test_fp8_cuda_path_emulated_ignores_trailing_rows(monkeypatch, ends, hp):
    """The CUDA FP8 code (per-group kernels through the interpreter, the GEMM emulated and
    leaving rows past offs[-1] unwritten): the custom op, forward and backward."""
    monkeypatch.setattr(fr, "_scaled_gmm", _emulated_op)
    f = fr.fp8_rowwise_grouped_mm
    _check(lambda x, w, o: f(x, w, o, [], hp), *_data(ends, "cpu"), exact_grad_w=hp)


def test_torch_compile_fullgraph_cpu():
    compiled = torch.compile(mx.grouped_mm, fullgraph=True, backend="aot_eager")
    args = _data([5, 21, 21], "cpu")
    for a, b in zip(_run(compiled, *args), _run(mx.grouped_mm, *args), strict=True):
        assert torch.equal(a, b)
    _check(compiled, *args)


@needs_interpreter
@pytest.mark.skipif(not gm.HAS_GROUPED_MM, reason="this torch has no grouped GEMM")
def test_torch_compile_fullgraph_grouped_gemm_path():
    """The zeroing op (it mutates the GEMM's output) traced in one graph, forward and
    backward."""
    torch._dynamo.reset()
    fn = lambda x, w, o: gm._GroupedMM.apply(x, w, o, False)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    args = _data([5, 21, 21], "cpu")
    for a, b in zip(_run(compiled, *args), _run(fn, *args), strict=True):
        assert torch.equal(a, b)


@CUDA
@pytest.mark.parametrize("precision", gm.PRECISIONS)
def test_gpu_torch_compile_fullgraph(precision):
    if precision != "bf16" and not SM90:
        pytest.skip(f"{precision} needs an sm_90+ GPU")
    fn = lambda x, w, o: mx.grouped_mm(x, w, o, precision=precision)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, backend="inductor")
    args = _data([5, 21, 21], "cuda")
    for a, b in zip(_run(compiled, *args), _run(fn, *args), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("layout", ["rows", "columns"])  # the kernel / the masked fill
@pytest.mark.parametrize("ends", [[], [0], [3, 16], [17], [37], [5, 40]])
def test_zero_trailing_rows(device, layout, ends):
    """Rows from offs[-1] on (all without groups) zeroed, the rows before untouched; rows not
    a multiple of the kernel's 16 and columns over its 256."""
    t = torch.randn(37, 300, device=device)
    t = t if layout == "rows" else t.t().contiguous().t()
    want = t.clone()
    want[min(ends[-1], 37) if ends else 0 :] = 0
    offs = torch.tensor(ends, dtype=torch.int32, device=device)
    assert zero_trailing_rows_(t, offs) is t and torch.equal(t, want)


def test_validate_accepts_trailing_rows_and_refuses_overrun():
    x, w, offs, _ = _data([5, 5, 21], "cpu", torch.float32)
    mx.grouped_mm(x, w, offs, validate=True)
    with pytest.raises(ValueError, match=r"offs\[-1\] must be at most x.shape\[0\] = 8.*pad x"):
        mx.grouped_mm(x[:8], w, torch.tensor([4, 4, 9], dtype=torch.int32))
