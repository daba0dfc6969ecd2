"""Combine's last step in one kernel each way: every token's k expert outputs, read where the
exchange returned them, summed with the router weights.

out[t] = sum_j w[t, j] * rows[pos[t, j]], with pos a permutation of the rows (combine's
inverse_order, viewed [T, k]). Gathering the slots into a [T, k, H] tensor first writes and
reads every row once more; here the forward reads each row once and writes the tokens, and
the backward reads the output gradient and the rows once and writes the rows' gradient
(grad_rows[pos[t, j]] = w[t, j] * grad[t]) and the weights' (grad_w[t, j] = <grad[t],
rows[pos[t, j]]>).

Numbers: the weights are rounded to the rows' dtype first (as w.to(rows.dtype) would), the
sums run in fp32 over j in order and round once. For bf16 rows every product is exact in
fp32, so the forward and grad_rows are bit for bit the plain-torch reference's; grad_w sums
over the hidden axis in tiles, in another order than torch (equal to fp32 rounding).

Layers: ``_slot_sum_kernel`` / ``_slot_sum_backward_kernel`` -> the custom ops
``mxfp8_a2a::slot_sum`` / ``slot_sum_backward`` (checks, allocation, grid; autograd
registered), which torch.compile traces -> :func:`slot_sum`, which takes the plain-torch
reference for rows other than
bf16 and where the kernels do not run. The forward kernel with unit weights is also
``mxfp8_a2a::row_sums`` -> :func:`row_sums` (the backward of dispatch's gather of k copies
per token, rows.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _config
from .._common import cdiv, kernels_run_on, next_pow2
from ..formats.bits import fp32_to_bf16, to_fp32
from ..formats.launch import launch

_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # exact in fp32


@triton.jit
def _weight(w_ptr, i, mask, SOFT: tl.constexpr):
    """The router weights at i, rounded to bf16, as fp32."""
    w = tl.load(w_ptr + i, mask=mask, other=0.0).to(tl.float32)
    return to_fp32(fp32_to_bf16(w, SOFT), SOFT)


@triton.jit
def _slot_sum_kernel(
    rows_ptr, pos_ptr, w_ptr, out_ptr, n_tokens, hidden,
    K: tl.constexpr, UNIT: tl.constexpr, SOFT: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):  # fmt: skip
    """rows bf16 [N, hidden], pos int64 [n_tokens, K], w [n_tokens, K] (UNIT: none, all 1)
    -> out bf16 [n_tokens, hidden]. Program (i, c): tokens [i * BLOCK_T, ...), columns
    [c * BLOCK_H, ...)."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tmask = t < n_tokens
    mask = tmask[:, None] & (h < hidden)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):
        p = tl.load(pos_ptr + t * K + j, mask=tmask, other=0)
        r = tl.load(rows_ptr + p[:, None] * hidden + h[None, :], mask=mask, other=0.0)
        if UNIT:
            acc += to_fp32(r, SOFT)
        else:
            acc += _weight(w_ptr, t * K + j, tmask, SOFT)[:, None] * to_fp32(r, SOFT)
    tl.store(out_ptr + t[:, None] * hidden + h[None, :], fp32_to_bf16(acc, SOFT), mask=mask)


@triton.jit
def _slot_sum_backward_kernel(
    grad_ptr, rows_ptr, pos_ptr, w_ptr, grad_rows_ptr, grad_w_ptr, n_tokens, hidden,
    K: tl.constexpr, KP: tl.constexpr, SOFT: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):  # fmt: skip
    """grad bf16 [n_tokens, hidden] -> grad_rows bf16 [N, hidden] (rows at pos), grad_w fp32
    [n_tokens, K]. Program i: tokens [i * BLOCK_T, ...), the hidden axis in BLOCK_H tiles,
    each tile of grad read once for the K slots."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < n_tokens
    slot = tl.arange(0, KP)
    dots = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = tmask[:, None] & (h < hidden)[None, :]
        g = tl.load(grad_ptr + t[:, None] * hidden + h[None, :], mask=mask, other=0.0)
        g = to_fp32(g, SOFT)
        for j in tl.static_range(K):
            p = tl.load(pos_ptr + t * K + j, mask=tmask, other=0)
            at = p[:, None] * hidden + h[None, :]
            r = to_fp32(tl.load(rows_ptr + at, mask=mask, other=0.0), SOFT)
            part = tl.sum(g * r, axis=1)
            dots += tl.where(slot[None, :] == j, part[:, None], 0.0)
            gr = _weight(w_ptr, t * K + j, tmask, SOFT)[:, None] * g
            tl.store(grad_rows_ptr + at, fp32_to_bf16(gr, SOFT), mask=mask)
    wmask = tmask[:, None] & (slot < K)[None, :]
    tl.store(grad_w_ptr + t[:, None] * K + slot[None, :], dots, mask=wmask)


def slot_sum_reference(rows: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor):
    """The plain-torch definition: rows [N, H], pos int64 [T, k], weights [T, k] -> [T, H]
    in rows' dtype, sums over j in order in fp32 (fp64 for fp64 rows)."""
    acc_dtype = torch.promote_types(rows.dtype, torch.float32)
    w = weights.to(rows.dtype).to(acc_dtype)
    if pos.shape[1] == 0:  # zeros, still a function of rows and weights (empty sums)
        return (rows.to(acc_dtype).sum(0) + w.sum(1, keepdim=True)).to(rows.dtype)
    acc = rows.new_zeros((pos.shape[0], rows.shape[1]), dtype=acc_dtype)
    for j in range(pos.shape[1]):
        acc = acc + w[:, j : j + 1] * rows.index_select(0, pos[:, j]).to(acc_dtype)
    return acc.to(rows.dtype)


def _grid_sizes(hidden: int, soft: bool) -> tuple[int, int]:
    if soft:
        return _config.INTERPRET_SLOT_SUM_BLOCK_T, min(next_pow2(hidden), 64)
    return _config.SLOT_SUM_BLOCK_T, min(next_pow2(hidden), _config.SLOT_SUM_BLOCK_H)


def _forward(rows: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor | None):
    """The forward kernel's launch: out [T, H] bf16; weights None: all 1 (row_sums)."""
    n_tokens, k = pos.shape
    out = rows.new_empty((n_tokens, rows.shape[1]))
    if out.numel() == 0 or k == 0:
        return out.zero_()
    soft = rows.device.type == "cpu"
    bt, bh = _grid_sizes(rows.shape[1], soft)
    launch(
        _slot_sum_kernel, (cdiv(n_tokens, bt), cdiv(rows.shape[1], bh)),
        (rows, pos, rows if weights is None else weights, out, n_tokens, rows.shape[1]),
        dict(K=k, UNIT=weights is None, SOFT=soft, BLOCK_T=bt, BLOCK_H=bh),
        _config.SLOT_SUM_NUM_WARPS,
    )  # fmt: skip
    return out


@torch.library.custom_op("mxfp8_a2a::slot_sum", mutates_args=())
def _slot_sum_op(rows: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return _forward(rows, pos, weights)


@_slot_sum_op.register_fake
def _(rows, pos, weights):
    return rows.new_empty((pos.shape[0], rows.shape[1]))


def _slot_sum_backward_impl(
    grad: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    n_tokens, k = pos.shape
    grad_rows = torch.empty_like(rows)
    if grad_rows.numel() == 0:  # (the kernel writes every grad_w entry where it runs)
        return grad_rows, torch.zeros((n_tokens, k), dtype=torch.float32, device=rows.device)
    grad_w = torch.empty((n_tokens, k), dtype=torch.float32, device=rows.device)
    soft = rows.device.type == "cpu"
    bt, bh = _grid_sizes(rows.shape[1], soft)
    launch(
        _slot_sum_backward_kernel, cdiv(n_tokens, bt),
        (grad.contiguous(), rows, pos, weights, grad_rows, grad_w, n_tokens, rows.shape[1]),
        dict(K=k, KP=max(2, next_pow2(k)), SOFT=soft, BLOCK_T=bt, BLOCK_H=bh),
        _config.SLOT_SUM_NUM_WARPS,
    )  # fmt: skip
    return grad_rows, grad_w


_slot_sum_backward_op = torch.library.custom_op(
    "mxfp8_a2a::slot_sum_backward", _slot_sum_backward_impl, mutates_args=()
)


@_slot_sum_backward_op.register_fake
def _(grad, rows, pos, weights):
    return torch.empty_like(rows), rows.new_empty(pos.shape, dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    rows, pos, weights = inputs
    ctx.save_for_backward(rows, pos, weights)


def _backward(ctx, grad):
    """The op's backward, through the backward op (which tracers, AOTAutograd and compiled
    autograd, meet with fake tensors)."""
    rows, pos, weights = ctx.saved_tensors
    grad_rows, grad_w = _slot_sum_backward_op(grad, rows, pos, weights)
    return grad_rows, None, grad_w.to(weights.dtype)


_slot_sum_op.register_autograd(_backward, setup_context=_setup_context)


def _check(rows: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor | None) -> None:
    """Shapes, dtypes and devices (pos's values are not read: the caller builds it)."""
    if rows.dim() != 2 or pos.dim() != 2 or pos.dtype != torch.int64:
        raise ValueError(
            f"rows must be [N, H] and pos int64 [T, k], got rows {tuple(rows.shape)}, pos "
            f"{pos.dtype} {tuple(pos.shape)}"
        )
    if pos.numel() != rows.shape[0] or pos.device != rows.device:
        raise ValueError(
            f"pos [T, k] must hold one index per row of rows (T * k = {pos.numel()}, rows "
            f"{rows.shape[0]}) on rows' device ({pos.device} vs {rows.device})"
        )
    if weights is not None and (
        weights.shape != pos.shape or weights.device != rows.device
        or not weights.dtype.is_floating_point
    ):  # fmt: skip
        raise ValueError(
            f"weights must be a floating [T, k] = {tuple(pos.shape)} tensor on {rows.device}, "
            f"got {weights.dtype} {tuple(weights.shape)} on {weights.device}"
        )


def slot_sum(rows: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * rows[pos[t, j]], differentiable in rows and weights.

    rows: [N, H] (N = T * k); pos: int64 [T, k], a permutation of range(N) (not checked:
    combine builds it); weights: floating [T, k], rounded to rows' dtype before the products.
    Returns [T, H] in rows' dtype. bf16 rows with fp32, bf16 or fp16 weights on CUDA (or on
    CPU under TRITON_INTERPRET=1) take the kernels, anything else the plain-torch reference
    (``slot_sum_reference``). Wrong shapes, dtypes or devices raise ValueError.
    """
    _check(rows, pos, weights)
    if (
        rows.dtype == torch.bfloat16
        and weights.dtype in _WEIGHT_DTYPES
        and kernels_run_on(rows.device, _slot_sum_kernel)
    ):
        return _slot_sum_op(rows.contiguous(), pos.contiguous(), weights.contiguous())
    return slot_sum_reference(rows, pos, weights)


def _row_sums_impl(rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return _forward(rows, pos, None)


_row_sums_op = torch.library.custom_op("mxfp8_a2a::row_sums", _row_sums_impl, mutates_args=())


@_row_sums_op.register_fake
def _(rows, pos):
    return rows.new_empty((pos.shape[0], rows.shape[1]))


def row_sums(rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j rows[pos[t, j]] (not differentiable; take_rows' backward): rows [N, H],
    pos int64 [T, k] (indices into rows, not checked) -> [T, H] in rows' dtype. bf16 rows take
    the kernel (fp32 sums over j in order, one rounding), others index_select and a sum."""
    _check(rows, pos, None)
    if rows.dtype == torch.bfloat16 and kernels_run_on(rows.device, _slot_sum_kernel):
        return _row_sums_op(rows.contiguous(), pos.contiguous())
    t, k = pos.shape
    return rows.index_select(0, pos.reshape(-1)).view(t, k, *rows.shape[1:]).sum(1)
