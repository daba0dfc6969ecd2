"""Shared inputs and checks of the grouped_mm tests (test_grouped_mm.py, test_grouped_mm_gpu.py):
jagged groups of several kinds, exact float64 products, inputs on which every FP8 cast is
exact, and the tolerance table of each precision."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import fresh_generator

import mxfp8_a2a as mx
from mxfp8_a2a.grouped import fp8_rowwise as fr  # noqa: F401 (the tests take it from here)
from mxfp8_a2a.grouped import gemm as gm  # noqa: F401 (the tests take it from here)
from mxfp8_a2a.grouped import grouped_mm_reference

CUDA = torch.cuda.is_available()
SM90 = CUDA and torch.cuda.get_device_capability() >= (9, 0)
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
needs_sm90 = pytest.mark.skipif(not SM90, reason="fp8_rowwise needs an sm_90+ GPU")
needs_interpreter = pytest.mark.skipif(  # conftest sets it before mxfp8_a2a is imported
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels on CPU need TRITON_INTERPRET=1",
)

# (rtol, atol as a fraction of max |reference|) of a GPU path against the reference: both
# round an fp32 accumulation to bf16 once (FP8: of the same e4m3 operands), so they differ
# by the order of the fp32 sums (and Hopper's FP8 accumulation), about a bf16 ulp.
TOLERANCES = {"bf16": (2**-7, 2**-9), "fp8_rowwise": (2**-6, 2**-7)}
TOLERANCES["fp8_rowwise_gw_hp"] = TOLERANCES["fp8_rowwise"]
SQNR_FLOOR_DB = 25.0
KINDS = ["uneven", "with_empty", "one_holds_all", "aligned"]


def _offsets(m: int, e: int, kind: str, g: torch.Generator) -> torch.Tensor:
    if kind == "one_holds_all":  # a middle expert takes every row
        ends = [0] * (e // 2) + [m] * (e - e // 2)
    elif kind == "aligned":
        cuts = sorted(torch.randint(0, m // 16 + 1, (e - 1,), generator=g).tolist())
        ends = [16 * c for c in cuts] + [m]
    else:
        ends = sorted(torch.randint(0, m + 1, (e - 1,), generator=g).tolist()) + [m]
        if kind == "with_empty":  # the first, the last and a middle expert empty
            if e < 3:  # (with fewer the three overlap and the ends would decrease)
                raise ValueError(f"kind 'with_empty' needs 3 or more experts, got {e}")
            ends[0] = 0
            ends[e // 2] = ends[e // 2 - 1]
            ends[-2] = m
    return torch.tensor(ends, dtype=torch.int32)


def _inputs(m, k, n, e, kind, dtype, device, g):
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(e, k, n, generator=g) * k**-0.5).to(dtype)
    grad = torch.randn(m, n, generator=g).to(dtype)
    offs = _offsets(m, e, kind, g)
    return x.to(device), w.to(device), offs.to(device), grad.to(device)


def _fwd_bwd(fn, x, w, offs, grad):
    x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    out = fn(x, w, offs)
    out.backward(grad)
    return out.detach(), x.grad, w.grad


def _exact(x, w, offs, grad):
    """float64 out, grad_x, grad_w per group."""
    x, w, grad = x.double(), w.double(), grad.double()
    out, gx, gw = x.new_zeros(x.shape[0], w.shape[2]), torch.zeros_like(x), torch.zeros_like(w)
    for e, (lo, hi) in enumerate(zip([0] + offs.tolist()[:-1], offs.tolist(), strict=True)):
        out[lo:hi] = x[lo:hi] @ w[e]
        gx[lo:hi] = grad[lo:hi] @ w[e].t()
        gw[e] = x[lo:hi].t() @ grad[lo:hi]
    return out, gx, gw


def assert_bf16_grad_w(gw, x, grad, offs):
    """gw [E, K, N] is x^T grad per group as a bf16 GEMM does it: one fp32 accumulation in
    any order (products of bf16 values are exact in fp32), then one rounding to bf16. The
    bound that arithmetic guarantees against the float64 product, whatever the order."""
    ends = offs.tolist()
    for e, (lo, hi) in enumerate(zip([0] + ends[:-1], ends, strict=True)):
        xd, gd = x[lo:hi].double(), grad[lo:hi].double()
        exact, mag = xd.t() @ gd, xd.abs().t() @ gd.abs()
        bound = max(hi - lo - 1, 0) * 2**-24 * (1 + 2**-8) * mag + 2**-8 * exact.abs()
        assert bool(((gw[e].double() - exact).abs() <= bound).all()), e


def _close(got, want, precision):
    rtol, atol = TOLERANCES[precision]
    for a, b in zip(got, want, strict=True):
        b = b.to(a.dtype)
        scale = b.abs().max().item() if b.numel() else 0.0
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol * scale + 1e-30)


def _reference(precision):
    return lambda x, w, o: grouped_mm_reference(x, w, o, precision=precision)


def _public(precision):
    return lambda x, w, o: mx.grouped_mm(x, w, o, precision=precision)


def _representable(x_shape, offs, g, amax_rows=True):
    """e4m3-representable values whose every row, and every (group, column), holds +-448, so
    that each rowwise and per-group scale is exactly 1 and the FP8 casts lose nothing
    (_representable_inputs then scales each group by its own power of two)."""
    m, k = x_shape
    x = (torch.randn(m, k, generator=g) * 64).clamp(-447, 447).to(torch.float8_e4m3fn).float()
    sign = torch.where(torch.rand(m, k, generator=g) < 0.5, -448.0, 448.0)
    cols = torch.arange(k)
    if amax_rows:
        rows = torch.arange(m)
        x[rows, rows % k] = sign[rows, rows % k]
    if offs is not None:
        for lo, hi in zip([0] + offs.tolist()[:-1], offs.tolist(), strict=True):
            if hi > lo:
                r = lo + cols % (hi - lo)
                x[r, cols] = sign[r, cols]
    return x


def _group_powers(t, offs, g):
    """t with each group's rows times its own power of two (2^-8 .. 2^8)."""
    for lo, hi in zip([0] + offs.tolist()[:-1], offs.tolist(), strict=True):
        t[lo:hi] *= 2.0 ** torch.randint(-8, 9, (), generator=g).item()
    return t


def _representable_inputs(m, k, n, e, kind, dtype, g):
    """Inputs on which every FP8 cast is exact, with per-group (x, grad) and per-expert (w)
    powers of two, so that every scale differs from 1 and from its neighbours' (a scale
    applied to the wrong rows, groups or experts, or the wrong way round, shows)."""
    offs = _offsets(m, e, kind, g)
    x = _group_powers(_representable((m, k), offs, g), offs, g)
    grad = _group_powers(_representable((m, n), offs, g), offs, g)
    w = torch.stack([_representable((k, n), None, g) for _ in range(e)])
    rows = torch.arange(k)
    cols = torch.arange(n)
    w[:, cols % k, cols] = 448.0  # every (expert, column) and (expert, row) holds 448
    w[:, rows, rows % n] = -448.0
    w *= torch.exp2(torch.randint(-8, 9, (e, 1, 1), generator=g).float())
    return x.to(dtype), w.to(dtype), offs, grad.to(dtype)


def _gpu_inputs(kind, dtype=torch.bfloat16, m=1003, k=256, n=384, e=8):
    return _inputs(m, k, n, e, kind, dtype, "cuda", fresh_generator())
