"""The static dispatch/combine's exchanges over a PushBuffer (exchange/push.py): each
sender's encoder stores its wire rows straight into the receivers' buffers, at the place
all_to_all_single with equal splits ``cap`` would put them (source s's rows at
[s * cap, (s + 1) * cap) of each receiver), and each receiver decodes from its own buffer.

Only the rows a (token, slot) holds are stored: nothing padded crosses the wire, and rows a
rank keeps are stored into its own memory. The receivers read only rows the plan says were
sent (a buffer's other rows hold an earlier call's bytes and are never read). The bits are
those of the NCCL path: the same encoders and decoders, only the store addresses differ.

Each op is one exchange: barrier, stores, barrier, reads of this rank's buffer into new
tensors (so nothing returned aliases the buffer, and the next op may reuse it). The ops
take the buffer's key (custom ops take no Python objects); they are opaque to
torch.compile (register_fake gives shapes) and capturable in CUDA graphs (no host read, no
allocation outside the caching allocator).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._common import kernels_run_on
from ..exchange.push import PushBuffer, lookup
from . import row_kernels as sk
from . import row_kernels_backward as skb
from .rows import _op  # (ops named mxfp8_a2a::moe_*)


def check_fits(
    buf: PushBuffer, cap: int, hidden: int, dtype: torch.dtype, wires: tuple[str, ...],
    count_columns: int, device: torch.device,
) -> None:  # fmt: skip
    """A ValueError naming the fix unless a call of these sizes, its legs on ``wires``, fits
    ``buf`` (on this rank, before any exchange)."""
    buf._check_live()
    if dtype not in sk.DTYPES:
        raise ValueError(f"the push transport takes bf16 or fp32 rows, got {dtype}")
    if not kernels_run_on(device, sk._gather_decode_kernel):
        raise ValueError(f"the push transport runs Triton kernels: tensors on {device} need a "
                         "CUDA GPU (or TRITON_INTERPRET=1 on the CPU)")  # fmt: skip
    if buf.world * cap >= 2**31:
        raise ValueError(f"capacity {cap} x {buf.world} ranks: the push path takes < 2**31 rows")
    if device != buf.device:
        raise ValueError(f"x is on {device}, the PushBuffer on {buf.device}")
    for wire in dict.fromkeys(wires):  # (each leg's rows, in order)
        shape, wdt = sk.wire_shape(1, hidden, dtype, wire)
        row = shape[1] * wdt.itemsize
        need = cap * row
        if row % 16:
            raise ValueError(
                f"the push transport moves rows of a multiple of 16 bytes; {wire} rows of "
                f"hidden={hidden} ({dtype}) are {row}: use exchange='mxfp8' or transport='nccl'"
            )
        if need > buf.capacity * buf.row_bytes:
            raise ValueError(
                f"capacity {cap} of {wire} rows of hidden={hidden} ({dtype}) needs {need} bytes "
                f"per rank pair; the PushBuffer holds {buf.capacity * buf.row_bytes} (capacity "
                f"{buf.capacity}, hidden {buf.hidden}, exchange {buf.exchange!r}): build a "
                "larger one or lower capacity"
            )
    if count_columns > buf.count_columns:
        raise ValueError(
            f"num_experts / group size needs {count_columns - 1} count columns, the PushBuffer "
            f"has {buf.count_columns - 1} (built for num_experts={buf.num_experts})"
        )


def _exchange(key: int, cap: int, hidden: int, dtype: torch.dtype, wire: str, store):
    """One exchange of rows: barrier; ``store(table, row_stride)``, this rank's encoder
    writing into every receiver's buffer (skipped at cap 0: no slot holds a row); barrier.
    Returns (this rank's received rows [W * cap, row], store's result or None)."""
    buf = lookup(key)
    shape, wdt = sk.wire_shape(buf.world * cap, hidden, dtype, wire)
    table = buf.table("rows", cap, shape[1] * wdt.itemsize)
    buf.barrier()
    stored = store(table, shape[1]) if cap else None
    buf.barrier()
    return buf.received("rows", shape[0], shape[1], wdt), stored


def push_counts(msg: Tensor, key: int) -> Tensor:
    """msg int64 [W, C] (row d: for rank d) -> int64 [W, C] (row s: what rank s sent)."""
    buf = lookup(key)
    buf.barrier()
    buf.put_counts(msg)
    buf.barrier()
    return buf.received("counts", buf.world, msg.shape[1], torch.int64).clone()


def push_dispatch(x: Tensor, rows_of: Tensor, src_row: Tensor, key: int, cap: int, wire: str,
                  scaling_mode: str) -> Tensor:  # fmt: skip
    """Dispatch's forward: x [T, H] stored at rows_of [T, k] (send rows < W * cap), then
    out [N, H] = decode(received[src_row]) (zeros for -1)."""

    def store(table, stride):
        sk.scatter_encode_into(x, rows_of, table, stride, cap, wire, scaling_mode, True)

    own, _ = _exchange(key, cap, x.shape[1], x.dtype, wire, store)
    return sk.gather_decode(own, src_row, x.shape[1], x.dtype, wire)


def push_combine(y: Tensor, out_row: Tensor, rows_of: Tensor, weights: Tensor | None,
                 key: int, cap: int, wire: str, scaling_mode: str,
                 keep: bool) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Combine's forward (and dispatch's backward, weights None): row i of y's senders'
    rows, y[out_row[i]] for out_row int64 [W * cap], stored back to its source; then
    out [T, H] = sum_j w[t, j] * decode(received[rows_of[t, j]]). keep: also the received
    rows of the slots in order, [T * k, row] (combine's backward reads them), else [0, row]."""

    def store(table, stride):
        sk.gather_encode_into(y, out_row, table, stride, cap, wire, scaling_mode, True)

    own, _ = _exchange(key, cap, y.shape[1], y.dtype, wire, store)
    out = sk.slot_sum_decode(own, rows_of, weights, y.shape[1], y.dtype, wire)
    slots = rows_of.reshape(-1)
    if not keep or own.shape[0] == 0:  # (capacity 0: no slot holds a row)
        return out, own.new_zeros((slots.numel() if keep else 0, own.shape[1]))
    return out, own.index_select(0, slots.clamp(min=0)).masked_fill_((slots < 0)[:, None], 0)


def push_combine_backward(grad: Tensor, kept: Tensor, rows_of: Tensor, weights: Tensor,
                          src_row: Tensor, key: int, cap: int, kept_wire: str, wire: str,
                          scaling_mode: str) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Combine's backward: encode(w[t, j] * grad[t]) stored as ``wire`` rows at rows_of[t, j]'s
    place in its expert rank's buffer, then grad_y [N, H] = decode(received[src_row]); and
    grad_w fp32 [T, k] from push_combine's kept rows (``kept_wire``; zero at cap 0: no slot
    holds a row)."""
    h = grad.shape[1]

    def store(table, stride):
        return skb.slot_sum_decode_backward_into(grad, kept, rows_of, weights, table, stride,
                                                 cap, wire, scaling_mode, True, True,
                                                 kept_wire)  # fmt: skip

    own, grad_w = _exchange(key, cap, h, grad.dtype, wire, store)
    if grad_w is None:
        grad_w = grad.new_zeros(rows_of.shape, dtype=torch.float32)
    return sk.gather_decode(own, src_row, h, grad.dtype, wire), grad_w


push_counts_op = _op("push_counts", push_counts)
push_dispatch_op = _op("push_dispatch", push_dispatch)
push_combine_op = _op("push_combine", push_combine)
push_combine_backward_op = _op("push_combine_backward", push_combine_backward)
if hasattr(torch.fx.node, "has_side_effect"):  # (graph passes keep them even if unused: every
    for _name in ("counts", "dispatch", "combine", "combine_backward"):  # rank runs them all)
        torch.fx.node.has_side_effect(getattr(torch.ops.mxfp8_a2a, f"moe_push_{_name}").default)


@push_counts_op.register_fake
def _(msg, key):
    return torch.empty_like(msg)


@push_dispatch_op.register_fake
def _(x, rows_of, src_row, key, cap, wire, scaling_mode):
    return x.new_empty((src_row.shape[0], x.shape[1]))


@push_combine_op.register_fake
def _(y, out_row, rows_of, weights, key, cap, wire, scaling_mode, keep):
    shape, wdt = sk.wire_shape(rows_of.numel() if keep else 0, y.shape[1], y.dtype, wire)
    return y.new_empty((rows_of.shape[0], y.shape[1])), y.new_empty(shape, dtype=wdt)


@push_combine_backward_op.register_fake
def _(grad, kept, rows_of, weights, src_row, key, cap, kept_wire, wire, scaling_mode):
    return grad.new_empty((src_row.shape[0], grad.shape[1])), grad.new_empty(
        rows_of.shape, dtype=torch.float32
    )
