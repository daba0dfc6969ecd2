"""Plain-torch definition of :func:`mxfp8_a2a.grouped_mm`, the arithmetic the GPU paths match.

A loop over expert groups (offsets read on the host); rows past offs[-1] belong to no group:
zero output rows, zero gradient rows, nothing added to grad_w. "bf16": each group's product
in fp32, rounded once to the inputs' dtype (what torch._grouped_mm computes). "fp8_rowwise":
the operands cast to e4m3 with the per-group scales of reference.py (exact casts), products and
sums in fp32, then ``(acc * scale_a) * scale_b`` with the reciprocal scales (the order of
torch._scaled_grouped_mm's epilogue), rounded to bf16, then cast to the inputs' dtype:

    forward   x one scale per row,              w one per (expert, output column)
    grad_x    grad_out one scale per row,       w one per (expert, row of K)
    grad_w    x^T one per (expert, row of K),   grad_out^T one per (expert, column of N),
              both along the expert's tokens

"fp8_rowwise_gw_hp": the same forward and grad_x, grad_w unscaled as for "bf16" (each
expert's x_e^T @ grad_out_e in fp32, rounded once to the inputs' dtype).

Differentiable in x and w (the FP8 backward is its own autograd Function).
"""

from __future__ import annotations

import torch

from .reference import per_group_colwise_reference, per_group_rowwise_reference


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends, strict=True))


def _whole(n: int, device: torch.device) -> torch.Tensor:
    return torch.full((1,), n, dtype=torch.int32, device=device)


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 copy of t [R, C] with one scale per row, and the reciprocal scales fp32 [R]."""
    data, scales = per_group_rowwise_reference(t, _whole(t.shape[1], t.device))
    return data, scales.reshape(-1).reciprocal()


def _scaled(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """bf16 of (a @ b in fp32) * sa[:, None] * sb[None, :], the scales applied in that order."""
    return ((a.float() @ b.float()) * sa[:, None] * sb[None, :]).to(torch.bfloat16)


def fp8_rowwise_forward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The FP8 rowwise forward in plain torch: bf16 [M, N]."""
    e, k, n = w.shape
    xq, xs = _rows(x)
    offs_k = torch.arange(1, e + 1, dtype=torch.int32, device=w.device) * k
    wq, ws = per_group_colwise_reference(w.reshape(e * k, n), offs_k)
    out = torch.zeros((x.shape[0], n), dtype=torch.bfloat16, device=x.device)
    for i, (lo, hi) in enumerate(_bounds(offs)):
        out[lo:hi] = _scaled(xq[lo:hi], wq[i * k : (i + 1) * k], xs[lo:hi], ws[i].reciprocal())
    return out


def fp8_rowwise_grad_x(g: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """grad_x = grad_out @ w[e]^T per group: bf16 [M, K]."""
    e, k, n = w.shape
    gq, gs = _rows(g)
    wq, ws = _rows(w.reshape(e * k, n))
    out = torch.zeros((g.shape[0], k), dtype=torch.bfloat16, device=g.device)
    for i, (lo, hi) in enumerate(_bounds(offs)):
        rows = slice(i * k, (i + 1) * k)
        out[lo:hi] = _scaled(gq[lo:hi], wq[rows].t(), gs[lo:hi], ws[rows])
    return out


def fp8_rowwise_grad_w(x: torch.Tensor, g: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """grad_w[e] = x_e^T @ grad_out_e, scaled per group along the tokens: bf16 [E, K, N]."""
    xt, sx = per_group_rowwise_reference(x.t(), offs)  # (K, M), (E, K)
    gt, sg = per_group_rowwise_reference(g.t(), offs)  # (N, M), (E, N)
    out = torch.zeros((offs.numel(), x.shape[1], g.shape[1]), dtype=torch.bfloat16, device=x.device)
    for i, (lo, hi) in enumerate(_bounds(offs)):
        out[i] = _scaled(xt[:, lo:hi], gt[:, lo:hi].t(), sx[i].reciprocal(), sg[i].reciprocal())
    return out


def hp_grad_w(x: torch.Tensor, g: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """grad_w[e] = x_e^T @ grad_out_e unscaled, in fp32, rounded to x's dtype: [E, K, N]."""
    out = x.new_zeros((offs.numel(), x.shape[1], g.shape[1]))
    for i, (lo, hi) in enumerate(_bounds(offs)):
        out[i] = (x[lo:hi].float().t() @ g[lo:hi].float()).to(x.dtype)
    return out


class _Fp8RowwiseReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs, hp):
        ctx.save_for_backward(x, w, offs)
        ctx.hp = hp
        return fp8_rowwise_forward(x, w, offs).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, w, offs = ctx.saved_tensors
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = fp8_rowwise_grad_x(grad, w, offs).to(x.dtype)
        if ctx.needs_input_grad[1] and ctx.hp:
            gw = hp_grad_w(x, grad, offs).to(w.dtype)
        elif ctx.needs_input_grad[1]:
            gw = fp8_rowwise_grad_w(x, grad, offs).to(w.dtype)
        return gx, gw, None, None


def grouped_mm_reference(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, precision: str = "bf16"
) -> torch.Tensor:
    """out[offs[e-1]:offs[e]] = x[offs[e-1]:offs[e]] @ w[e] in plain torch (see the module
    docstring for the arithmetic of each precision). x [M, K], w [E, K, N], offs int32 [E]
    end offsets (read on the host), non-decreasing, offs[-1] <= M: rows past offs[-1] are
    ignored (zero output, zero gradient, nothing added to w's gradient); differentiable in
    x and w. No argument checks: use :func:`mxfp8_a2a.grouped_mm`, which checks them and
    runs this on CPU for the FP8 precisions."""
    if precision in ("fp8_rowwise", "fp8_rowwise_gw_hp"):
        return _Fp8RowwiseReference.apply(x, w, offs, precision == "fp8_rowwise_gw_hp")
    if precision != "bf16":
        raise ValueError(
            f"precision must be 'bf16', 'fp8_rowwise' or 'fp8_rowwise_gw_hp', got {precision!r}"
        )
    bounds = _bounds(offs)
    end = bounds[-1][1] if bounds else 0  # rows from offs[-1] on: zeros, zero gradient
    parts = torch.split(x[:end], [hi - lo for lo, hi in bounds])
    outs = [
        (xe.float() @ we.float()).to(x.dtype) for xe, we in zip(parts, w.unbind(0), strict=True)
    ]
    if end < x.shape[0]:
        outs.append(x.new_zeros((x.shape[0] - end, w.shape[2])))
    return torch.cat(outs) if outs else x.new_empty((0, w.shape[2]))
