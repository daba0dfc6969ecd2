"""The FP8-rowwise grouped GEMM of grouped_mm(precision="fp8_rowwise"): its operands' casts
(the per-group kernels of per_group_scales.py), torch's FP8 grouped GEMM (torch_gemms.py:
torch.nn.functional.scaled_grouped_mm, the private op as its fallback), and the custom op
``mxfp8_a2a::fp8_rowwise_grouped_mm`` with its autograd (traced by torch.compile);
``Fp8Weights`` / ``fp8_rowwise_weights``, the weights' casts made once for several calls.
gemm.py says which layouts torch's FP8 grouped GEMM needs and how they are met.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._common import contiguous
from .per_group_scales import expert_column_scales, padded_token_scales
from .row_scales import row_scales
from .torch_gemms import grouped_gemm, scaled_grouped_gemm
from .trailing import zero_trailing_rows_
from .weight_scales import weight_scales

_FP8_DTYPES = (torch.bfloat16, torch.float32)


def _scaled_gmm(a, b, scale_a, scale_b, offs) -> torch.Tensor:
    """torch's FP8 grouped GEMM: a e4m3 row-major, b e4m3 column-major, fp32 multipliers."""
    return scaled_grouped_gemm(a, b, scale_a, scale_b, offs)


def _scale_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, C] -> e4m3 [R, C] row-major with one scale per row, reciprocal scales fp32 [R]."""
    return row_scales(t, inverse=True)


def _weights_per_column(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, K, N] -> e4m3 [E, K, N] column-major, one scale per (expert, column of N):
    reciprocals fp32 [E, N] (the forward's mat_b)."""
    return expert_column_scales(w, True)


def _weights_per_row(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, K, N] -> w^T e4m3 [E, N, K] column-major (w's own row-major storage), one scale
    per (expert, row of K): reciprocals fp32 [E, K] (grad_x's mat_b)."""
    e, k, n = w.shape
    data, inv = _scale_rows(w.reshape(e * k, n))
    return data.view(e, k, n).transpose(1, 2), inv.view(e, k)


def _fp8_grad_w(x: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """grad_w [E, K, N] bf16: x^T (K, M) and grad^T (N, M) scaled per (group, row) along the
    tokens, written with 16-aligned non-empty token groups, then one 2-D x 2-D FP8 GEMM.
    Rows past offs[-1] (the static dispatch's padding) are ignored: the per-group kernels
    read only the rows inside groups (amax and cast spans end at each group's end) and write
    zeros for the rest of the last group's padded region, so those rows reach neither the
    scales nor the GEMM, whatever they hold."""
    a, sx, pad_offs = padded_token_scales(x, offs, True)  # (K, cap) row-major, 1 / scales
    b, sg, _ = padded_token_scales(grad, offs, True)  # (N, cap) row-major: b.t() column-major
    return _scaled_gmm(a, b.t(), sx.reshape(-1), sg.reshape(-1), pad_offs)


class Fp8Weights(NamedTuple):
    """The FP8 copies of expert weights w [E, K, N] that precision="fp8_rowwise" uses, made
    once (``fp8_rowwise_weights``) for several grouped_mm calls on the same, unchanged w (the
    micro-batches of one optimizer step: ExpertParallelMoE.fp8_weight_reuse).

    by_column: e4m3 [E, K, N], each expert column-major, one scale per (expert, column of N);
    column_inv: fp32 [E, N], its dequantization multipliers (the forward's operand).
    by_row: e4m3 [E, N, K] (w^T, each expert column-major), one scale per (expert, row of K);
    row_inv: fp32 [E, K] (grad_x's operand).
    """

    by_column: torch.Tensor
    column_inv: torch.Tensor
    by_row: torch.Tensor
    row_inv: torch.Tensor


def fp8_rowwise_weights(w: torch.Tensor) -> Fp8Weights:
    """w [E, K, N] bf16 or fp32 (CUDA, or CPU) -> its Fp8Weights, the casts fp8_rowwise
    grouped_mm otherwise makes on every call (2 bytes per element of w in all, plus the
    scales). Outside autograd: w's gradient still flows through grouped_mm's w."""
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.dtype not in _FP8_DTYPES:
        what = (tuple(w.shape), w.dtype) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"fp8_rowwise_weights: w must be a 3-D bf16 or fp32 tensor, got {what}")
    with torch.no_grad():
        return Fp8Weights(*weight_scales(w.detach().contiguous(), inverse=True))


def _fp8_forward(x, w, offs, cached: list[torch.Tensor]) -> torch.Tensor:
    """out [M, N] in x's dtype: x per row and w per (expert, output column) in e4m3 (``cached``:
    an Fp8Weights' tensors, or empty). Rows past offs[-1] get their own row scales (unused)
    and the GEMM leaves them unwritten: zeroed after it (grad_x the same)."""
    if x.shape[0] == 0:
        return x.new_empty((0, w.shape[2]))
    xq, xs = _scale_rows(x)
    wq, ws = cached[:2] if cached else _weights_per_column(w)
    return zero_trailing_rows_(_scaled_gmm(xq, wq, xs, ws, offs).to(x.dtype), offs)


def _fp8_grads(
    x, w, offs, grad, by_row: list[torch.Tensor], hp_grad_w: bool, need_x: bool, need_w: bool
):
    """(grad_x [M, K] in x's dtype or None, grad_w [E, K, N] in w's dtype or None); by_row:
    an Fp8Weights' by_row and row_inv, or empty; with ``hp_grad_w`` grad_w unscaled in bf16
    (torch's bf16 grouped GEMM of x^T and grad_out)."""
    if x.shape[0] == 0:
        return torch.zeros_like(x), torch.zeros_like(w)
    grad = contiguous(grad)
    gx = gw = None
    if need_x:
        gq, gs = _scale_rows(grad)
        wq, ws = by_row if by_row else _weights_per_row(w)
        gx = zero_trailing_rows_(_scaled_gmm(gq, wq, gs, ws, offs).to(x.dtype), offs)
    # x^T column-major, grad row-major: 2-D x 2-D, as for bf16 (tokens past offs[-1] unread)
    if need_w and hp_grad_w:
        gw = grouped_gemm(x.t(), grad, offs)
    elif need_w:
        gw = _fp8_grad_w(x, grad, offs).to(w.dtype)
    return gx, gw


# A custom op with its autograd registered, not an autograd.Function: torch 2.11's
# torch.compile traced such a Function's output, made from FP8 operands that require no
# grad, as non-differentiable and gave zero gradients (seen on an H200, 2026-12-01).
@torch.library.custom_op("mxfp8_a2a::fp8_rowwise_grouped_mm", mutates_args=())
def fp8_rowwise_grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    cached: list[torch.Tensor],
    hp_grad_w: bool,
) -> torch.Tensor:
    """x [M, K], w [E, K, N] contiguous, offs int32 [E], cached: the four tensors of w's
    Fp8Weights or none -> [M, N] in x's dtype through torch's FP8 grouped GEMM;
    differentiable in x and w (``hp_grad_w``: grad_w unscaled in bf16, x and w bf16)."""
    return _fp8_forward(x, w, offs, cached)


@fp8_rowwise_grouped_mm.register_fake
def _(x, w, offs, cached, hp_grad_w):
    return x.new_empty((x.shape[0], w.shape[2]))


def _fp8_setup_context(ctx, inputs, output) -> None:
    x, w, offs, cached, hp_grad_w = inputs
    ctx.save_for_backward(x, w, offs, *cached[2:])  # grad_x's copy of w, not the forward's
    ctx.n_cached = len(cached)
    ctx.hp_grad_w = hp_grad_w


def _fp8_backward(ctx, grad):
    x, w, offs, *by_row = ctx.saved_tensors
    gx, gw = _fp8_grads(x, w, offs, grad, by_row, ctx.hp_grad_w, *ctx.needs_input_grad[:2])
    return gx, gw, None, [None] * ctx.n_cached, None  # one entry per input, lists as lists


fp8_rowwise_grouped_mm.register_autograd(_fp8_backward, setup_context=_fp8_setup_context)


def check_fp8_weights(w: torch.Tensor, fp8: Fp8Weights, precision: str) -> None:
    if not precision.startswith("fp8_rowwise"):
        raise ValueError(
            f"grouped_mm: fp8_weights is for precision='fp8_rowwise' or 'fp8_rowwise_gw_hp', "
            f"got {precision!r}"
        )
    e, k, n = w.shape
    want = ((e, k, n), (e, n), (e, n, k), (e, k))
    dtypes = (torch.float8_e4m3fn, torch.float32) * 2
    # the layouts torch's FP8 grouped GEMM reads: each expert column-major
    strides = ((n * k, 1, k), (n, 1), (n * k, 1, n), (k, 1))
    if not isinstance(fp8, Fp8Weights) or any(
        t.shape != shape or t.dtype != dt or t.device != w.device or t.stride() != st
        for t, shape, dt, st in zip(fp8, want, dtypes, strides, strict=True)
    ):
        raise ValueError(
            f"grouped_mm: fp8_weights must be fp8_rowwise_weights(w) of this w [{e}, {k}, {n}] "
            f"on {w.device}"
        )
