"""The row engine under both dispatch front ends: tokens encoded for the wire straight into
their slots of a send buffer, the buffer exchanged, rows decoded straight into their place
in the experts' layout; combine the reverse, ending in each token's weighted sum.

The front ends differ only in the plan (plan.py) and in how a buffer travels (:class:`Route`):

- dispatch_static (fixed slots): ``capacity`` rows per rank pair, every buffer W * capacity
  rows, all_to_all_single with equal splits (no host sync), or a PushBuffer's kernels
  storing the rows straight into the receivers' buffers;
- dispatch (packed, host-synced): the pairs' exact counts, buffers of exactly the rows that
  travel, all_to_all_single with those splits, or an MXFP8 Transport object (which
  quantizes and dequantizes itself: the buffers then hold the rows in their own dtype).

Autograd: :func:`dispatch_rows` is differentiable in x (the backward sends the gradient
back on the dispatch's backward wire and sums each token's k copies), :func:`combine_rows`
in the expert outputs and the weights. The kernels and their plain-torch references are in
rows.py (row_kernels.py, row_kernels_backward.py); push.py is the PushBuffer's glue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..exchange import nccl
from ..exchange.plain import HAS_FUNCOL, funcol
from ..exchange.push import PushBuffer
from ..exchange.transport import Transport
from . import push as sp
from . import rows as rows_ops


@dataclass
class Route:
    """How the wire buffers of one dispatch travel between the ranks of ``group``.

    capacity: rows per rank pair (fixed slots), or None (packed). splits: for packed, the
    rows this rank sends to and receives from each rank, in dispatch's direction (combine
    swaps them). push: a PushBuffer (fixed slots only). transport: an MXFP8 Transport that
    moves unquantized rows (packed only; None: the buffers go through all_to_all_single).
    functional: all_to_all_single as torch's functional collective (an op that selective
    activation checkpointing can save instead of running the exchange again in backward).
    """

    group: dist.ProcessGroup | None
    capacity: int | None = None
    splits: tuple[list[int], list[int]] | None = None
    push: PushBuffer | None = None
    transport: Transport | None = None
    functional: bool = False

    def world(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def send_rows(self) -> int:
        """Rows of dispatch's send buffer (and of combine's receive buffer)."""
        if self.capacity is not None:
            return self.world() * self.capacity
        return sum(self.splits[0])

    def carried(self, wire: str) -> str:
        """The wire of the buffers: a Transport takes the rows unquantized."""
        return "bf16" if self.transport is not None else wire

    def move(self, buf: torch.Tensor, back: bool, wire: str, mode: str) -> torch.Tensor:
        """buf in dispatch's send layout -> its receive layout (back: the reverse)."""
        if self.splits is None:
            return all_to_all(buf, None, None, self.group, self.functional)
        send, recv = self.splits if not back else self.splits[::-1]
        if self.transport is not None and wire == "mxfp8":
            return self.transport.exchange(buf, recv, send, self.group, mode)
        return all_to_all(buf, recv, send, self.group, self.functional)


def all_to_all(t: torch.Tensor, out_splits, in_splits, group, functional=False) -> torch.Tensor:
    """all_to_all_single of t's rows (splits None: equal, t's rows divide by the group
    size); a group of one rank exchanges nothing (t itself). functional (or under
    torch.compile): torch's functional collective, else the process group's own call."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return t
    t = t.contiguous()
    if (functional or torch.compiler.is_compiling()) and HAS_FUNCOL:
        out = funcol.all_to_all_single(t, out_splits, in_splits, group or dist.group.WORLD)
        return funcol.wait_tensor(out)
    rows = t.shape[0] if out_splits is None else sum(out_splits)
    out = t.new_empty((rows, *t.shape[1:]))
    # (through the process group's own call where it has one: less host time)
    nccl.all_to_all(out, t, out_splits or [], in_splits or [], group, async_op=False)
    return out


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows_of, src_row, out_row, route, wires, mode):
        ctx.save_for_backward(rows_of, out_row)
        ctx.args = (x.shape[1], x.dtype, route, wires[1], mode)
        push, wire = route.push, wires[0]
        if push is not None:
            return sp.push_dispatch_op(x, rows_of, src_row, push.key, route.capacity, wire, mode)
        carried = route.carried(wire)
        buf = rows_ops.scatter_encode(x, rows_of, route.send_rows(), carried, mode)
        buf = route.move(buf, False, wire, mode)
        return rows_ops.gather_decode(buf, src_row, x.shape[1], x.dtype, carried)

    @staticmethod
    def backward(ctx, grad):
        rows_of, out_row = ctx.saved_tensors
        hidden, dtype, route, wire, mode = ctx.args
        if (push := route.push) is not None:
            grad_x, _ = sp.push_combine_op(grad.contiguous(), out_row, rows_of, None, push.key,
                                           route.capacity, wire, mode, False)  # fmt: skip
        else:
            carried = route.carried(wire)
            buf = rows_ops.gather_encode(grad.contiguous(), out_row, carried, mode)
            back = route.move(buf, True, wire, mode)
            grad_x = rows_ops.slot_sum_decode(back, rows_of, None, hidden, dtype, carried)
        return grad_x, None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weights, rows_of, src_row, out_row, route, wires, mode):
        ctx.args = (y.shape[1], y.dtype, route, wires, mode)
        push, wire = route.push, wires[0]
        if push is not None:  # (keeps the slots' rows for the backward: the buffer is reused)
            out, back = sp.push_combine_op(y.contiguous(), out_row, rows_of, weights, push.key,
                                           route.capacity, wire, mode,
                                           any(ctx.needs_input_grad[:2]))  # fmt: skip
        else:
            carried = route.carried(wire)
            buf = rows_ops.gather_encode(y.contiguous(), out_row, carried, mode)
            back = route.move(buf, True, wire, mode)
            out = rows_ops.slot_sum_decode(back, rows_of, weights, y.shape[1], y.dtype, carried)
        ctx.save_for_backward(back, rows_of, src_row, weights)
        return out

    @staticmethod
    def backward(ctx, grad):
        back, rows_of, src_row, weights = ctx.saved_tensors
        hidden, dtype, route, (kept, wire), mode = ctx.args
        if (push := route.push) is not None:
            grad_y, grad_w = sp.push_combine_backward_op(
                grad.contiguous(), back, rows_of, weights, src_row, push.key, route.capacity,
                kept, wire, mode,
            )  # fmt: skip
        else:  # (``back`` holds the forward's rows, on its carried wire)
            carried = route.carried(wire)
            buf, grad_w = rows_ops.slot_sum_decode_backward(
                grad.contiguous(), back, rows_of, weights, back.shape[0], carried, mode,
                route.carried(kept),
            )  # fmt: skip
            buf = route.move(buf, False, wire, mode)
            grad_y = rows_ops.gather_decode(buf, src_row, hidden, dtype, carried)
        return grad_y, grad_w.to(weights.dtype), None, None, None, None, None, None


def dispatch_rows(
    x: torch.Tensor,
    rows_of: torch.Tensor,
    src_row: torch.Tensor,
    out_row: torch.Tensor,
    route: Route,
    wires: tuple[str, str],
    mode: str,
) -> torch.Tensor:
    """x [T, H] -> [N, H] in x's dtype: output row i = x's token whose send-buffer row
    src_row[i] received, zeros where src_row is -1. rows_of int64 [T, k] (send-buffer row of
    each (token, slot), -1: not sent), src_row int64 [N], out_row int64 [receive rows] (the
    output row of each receive-buffer row, -1: unused), from plan.py; ``wires`` (forward,
    backward), each "mxfp8" or "bf16"; mode: the MXFP8 scaling mode. Differentiable in x."""
    return _Dispatch.apply(x, rows_of, src_row, out_row, route, wires, mode)


def combine_rows(
    y: torch.Tensor,
    weights: torch.Tensor,
    rows_of: torch.Tensor,
    src_row: torch.Tensor,
    out_row: torch.Tensor,
    route: Route,
    wires: tuple[str, str],
    mode: str,
) -> torch.Tensor:
    """y [N, H] (dispatch_rows' layout) -> [T, H] in y's dtype: out[t] = sum over the slots
    j sent of weights[t, j] * y(row of (t, j)), weights [T, k] rounded to y's dtype, fp32
    sums over j in order. Differentiable in y and weights."""
    return _Combine.apply(y, weights, rows_of, src_row, out_row, route, wires, mode)
