"""The Triton kernel of static_rows.slot_sum_decode_backward (combine's backward): for each
token, its gradient row times each slot's router weight, encoded for the wire into the
slot's row, and each slot's weight gradient (the dot product of the gradient row and the
slot's decoded forward row).

One program per tile of rows x columns reads its gradient tile once for the k slots; with
prefetch (STATIC_BACKWARD_TILES: tile and prefetch by row width) the slots' wire rows are
loaded one slot ahead (index and bytes), so that their latency overlaps the previous
slot's encoding and stores. Each slot's dot
product is summed within a lane of 32 columns, then over the lanes of a row (no reshape of
the whole tile). The helpers, numbers and layers are row_kernels.py's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import _config
from .._common import cdiv
from ..formats.bits import fp32_to_bf16, to_fp32
from ..formats.launch import launch
from .row_kernels import (
    _consts,
    _decoded,
    _lanes,
    _quantize,
    _rounded,
    _store_wire,
    _tile,
    _unit_cols,
    _weight,
    _weights,
    _wire_bytes,
    wire_shape,
)


@triton.jit
def _read_row(row, compact_row, COMPACT: tl.constexpr):
    """The forward's wire row of a slot: ``row`` (-1: none), or COMPACT its row t * K + j of a
    buffer of the slots' rows in order (push.py keeps such a copy)."""
    if COMPACT:
        return tl.where(row >= 0, compact_row, -1)
    else:
        return row


@triton.jit
def _slot_sum_decode_backward_kernel(
    grad_ptr, buf_ptr, rows_of_ptr, w_ptr, out_ptr, part_ptr, n_tokens, hidden, row_stride,
    out_stride, n_cb, cap,
    K: tl.constexpr, MX: tl.constexpr, IN_MX: tl.constexpr, RCEIL: tl.constexpr,
    HW_E8M0: tl.constexpr, BF16: tl.constexpr, SOFT: tl.constexpr, BLOCK_T: tl.constexpr,
    NB: tl.constexpr,
    W: tl.constexpr, PREFETCH: tl.constexpr, PUSH: tl.constexpr, COMPACT: tl.constexpr,
):  # fmt: skip
    """grad [n_tokens, hidden] -> out[rows_of[t, j]] = encode(w[t, j] * grad[t]) (product
    rounded to the working dtype; MX the out wire, IN_MX buf's, the lanes MX-tiled if either
    is; PUSH: out_ptr a table, _store_wire's) and part fp32
    [n_tokens, K, n_cb]: the dot product of grad[t] and decode(buf[rows_of[t, j]]) (COMPACT:
    buf[t * K + j]) over column block c (program (i, c)), summed over the blocks by the
    launcher."""
    first = tl.program_id(0).to(tl.int64) * BLOCK_T
    cb = tl.program_id(1)
    h0 = cb * (NB * W)
    t, c0, cols, lmask, mask = _lanes(first, h0, n_tokens, hidden, BLOCK_T, NB, W, MX or IN_MX)
    g = to_fp32(tl.load(grad_ptr + t[:, None] * hidden + cols, mask=mask, other=0.0), SOFT)
    tt = first + tl.arange(0, BLOCK_T)
    if PREFETCH:
        row_next = tl.load(rows_of_ptr + t * K, mask=lmask, other=-1)
        u_next, b_next = _wire_bytes(buf_ptr, _read_row(row_next, t * K, COMPACT), c0, cols,
                                     mask, hidden, row_stride, IN_MX)  # fmt: skip
        if K > 1:
            row_after = tl.load(rows_of_ptr + t * K + 1, mask=lmask, other=-1)
    for j in tl.static_range(K):
        if PREFETCH:
            row, u, b = row_next, u_next, b_next
            if j + 1 < K:  # the next slot's bytes and the index after it, before this slot's work
                row_next = row_after
                u_next, b_next = _wire_bytes(buf_ptr, _read_row(row_next, t * K + j + 1, COMPACT),
                                             c0, cols, mask, hidden, row_stride, IN_MX)  # fmt: skip
                if j + 2 < K:
                    row_after = tl.load(rows_of_ptr + t * K + j + 2, mask=lmask, other=-1)
        else:
            row = tl.load(rows_of_ptr + t * K + j, mask=lmask, other=-1)
            u, b = _wire_bytes(buf_ptr, _read_row(row, t * K + j, COMPACT), c0, cols, mask,
                               hidden, row_stride, IN_MX)  # fmt: skip
        lane = tl.sum(g * to_fp32(_decoded(u, b, IN_MX, BF16, SOFT), SOFT), axis=1)
        part = tl.sum(tl.reshape(lane, (BLOCK_T, NB)), axis=1)
        tl.store(part_ptr + (tt * K + j) * n_cb + cb, part, mask=tt < n_tokens)
        gr = _rounded(_weight(w_ptr, t * K + j, lmask, BF16, SOFT)[:, None] * g, BF16, SOFT)
        if MX:
            v, s = _quantize(gr, RCEIL, HW_E8M0, SOFT)
        elif BF16:
            v, s = fp32_to_bf16(gr, SOFT), c0
        else:
            v, s = gr, c0
        _store_wire(out_ptr, row, c0, cols, mask, v, s, hidden, out_stride, cap, MX, PUSH)


def slot_sum_decode_backward(
    grad: Tensor, buf: Tensor, rows_of: Tensor, weights: Tensor, n_rows: int, wire: str,
    scaling_mode: str, buf_wire: str,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """grad bf16/fp32 [T, H], buf (the forward's wire rows, ``buf_wire``), rows_of int64
    [T, k] (values < n_rows), weights floating [T, k] -> (``wire`` buffer [n_rows] with
    encode(w[t, j] * grad[t]) at rows_of[t, j], others unwritten; grad_w fp32 [T, k], 0 where
    rows_of is -1)."""
    shape, dtype = wire_shape(n_rows, grad.shape[1], grad.dtype, wire)
    out = torch.empty(shape, dtype=dtype, device=grad.device)
    if n_rows == 0:
        return out, grad.new_zeros(rows_of.shape, dtype=torch.float32)
    grad_w = slot_sum_decode_backward_into(grad, buf, rows_of, weights, out, out.stride(0), 1,
                                           wire, scaling_mode, False, False, buf_wire)  # fmt: skip
    return out, grad_w


def slot_sum_decode_backward_into(
    grad: Tensor, buf: Tensor, rows_of: Tensor, weights: Tensor, dest: Tensor, out_stride: int,
    cap: int, wire: str, scaling_mode: str, push: bool, compact: bool, buf_wire: str,
) -> Tensor:  # fmt: skip
    """The kernel into ``dest`` (push: a table, as row_kernels.scatter_encode_into) with
    buf the forward's rows of ``buf_wire`` (compact: buf[t * k + j] for slot (t, j));
    returns grad_w."""
    (t, h), k = grad.shape, rows_of.shape[1]
    if min(t, k, h, buf.shape[0]) == 0:  # (without rows, every slot is -1)
        return torch.zeros((t, k), dtype=torch.float32, device=grad.device)
    soft = grad.device.type == "cpu"
    elems, prefetch = next((e, p) for min_h, e, p in _config.STATIC_BACKWARD_TILES if h >= min_h)
    bt, nb, w = _tile(h, t, "mxfp8" in (wire, buf_wire), soft, elems)
    n_cb = cdiv(h, nb * w)
    part = torch.empty((t, k, n_cb), dtype=torch.float32, device=grad.device)
    buf, rows_of = _unit_cols(buf), rows_of.contiguous()
    args = (grad.contiguous(), buf, rows_of, _weights(weights, grad.dtype), dest, part, t, h,
            buf.stride(0), out_stride, n_cb, cap)  # fmt: skip
    consts = dict(K=k, IN_MX=buf_wire == "mxfp8", **_consts(wire, grad.device, scaling_mode))
    consts.update(BF16=grad.dtype == torch.bfloat16, SOFT=soft, BLOCK_T=bt, NB=nb, W=w,
                  PREFETCH=prefetch, PUSH=push, COMPACT=compact)  # fmt: skip
    # (fp fusion off: no FMA may round a product that the references round)
    launch(_slot_sum_decode_backward_kernel, (cdiv(t, bt), n_cb), args, consts,
           _config.STATIC_ROWS_NUM_WARPS, enable_fp_fusion=False)  # fmt: skip
    # (a sum over the column blocks, not atomics: the same bits in every run)
    return part.sum(-1).masked_fill_(rows_of < 0, 0)
