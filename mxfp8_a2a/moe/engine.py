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
import torch.nn.functional as F

from ..exchange import nccl
from ..exchange.plain import HAS_FUNCOL, funcol
from ..exchange.push import PushBuffer
from ..exchange.transport import Transport
from . import node_plan
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
    nodes: NodeStages | None = None

    def world(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def send_rows(self) -> int:
        """Rows of dispatch's send buffer (and of combine's receive buffer)."""
        if self.nodes is not None:
            return self.nodes.send_rows
        if self.capacity is not None:
            return self.world() * self.capacity
        return sum(self.splits[0])

    def carried(self, wire: str) -> str:
        """The wire of the buffers: a Transport takes the rows unquantized."""
        return "bf16" if self.transport is not None else wire

    def move(self, buf: torch.Tensor, back: bool, wire: str, mode: str, rows) -> torch.Tensor:
        """buf in dispatch's send layout -> its receive layout (back: the reverse). rows:
        (hidden, dtype) of the rows the buffer encodes."""
        if self.nodes is not None:
            return self.nodes.move(buf, back, wire, mode, rows, self.functional)
        if self.splits is None:
            return all_to_all(buf, None, None, self.group, self.functional)
        send, recv = self.splits if not back else self.splits[::-1]
        if self.transport is not None and wire == "mxfp8":
            return self.transport.exchange(buf, recv, send, self.group, mode)
        return all_to_all(buf, recv, send, self.group, self.functional)


@dataclass
class NodeStages:
    """The two hops of a node-aware dispatch (node_plan.py): over the rail (stage 1, between
    nodes) and the node group (stage 2). *_splits: (rows sent, rows received) per rank of
    that group in dispatch's direction; fwd_idx int64 [stage-2 send rows]: the stage-1
    receive row each copies; sum_rows int64 [stage-1 receive rows, k]: the stage-2 send rows
    of each, -1 for none (what the reverse direction sums)."""

    rail: dist.ProcessGroup | None
    node: dist.ProcessGroup | None
    rail_splits: tuple[list[int], list[int]]
    node_splits: tuple[list[int], list[int]]
    fwd_idx: torch.Tensor
    sum_rows: torch.Tensor
    slots: SlotPlan | HopSlots
    send_rows: int  # stage 1's send buffer (dispatch_rows' send rows)

    def move(self, buf, back, wire, mode, rows, functional) -> torch.Tensor:
        """Forward: stage 1, the wire bytes copied, stage 2. Back: stage 2 in reverse, each
        stage-1 row's rows summed in fp32 (rounded to the rows' dtype, encoded again), stage
        1 in reverse."""
        (rail_send, rail_recv), (node_send, node_recv) = self.rail_splits, self.node_splits
        if not back:
            got = all_to_all(buf, rail_recv, rail_send, self.rail, functional)
            copied = rows_ops._take(got, self.fwd_idx)
            return all_to_all(copied, node_recv, node_send, self.node, functional)
        got = all_to_all(buf, node_send, node_recv, self.node, functional)
        hidden, dtype = rows
        part = rows_ops.slot_sum_decode(got, self.sum_rows, None, hidden, dtype, wire)
        every = torch.arange(part.shape[0], device=part.device)
        part = rows_ops.gather_encode(part, every, wire, mode)
        return all_to_all(part, rail_send, rail_recv, self.rail, functional)


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
        buf = route.move(buf, False, wire, mode, (x.shape[1], x.dtype))
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
            back = route.move(buf, True, wire, mode, (hidden, dtype))
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
            back = route.move(buf, True, wire, mode, (y.shape[1], y.dtype))
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
            buf = route.move(buf, False, wire, mode, (hidden, dtype))
            grad_y = rows_ops.gather_decode(buf, src_row, hidden, dtype, carried)
        return grad_y, grad_w.to(weights.dtype), None, None, None, None, None, None


class _CombineAtExperts(torch.autograd.Function):
    """combine on a node-aware route (route.nodes): each row weighted where its expert is,
    z = (w rounded to y's dtype) * y in fp32, rounded to y's dtype; the hops sum the rows
    (NodeStages.move) into [T, H]. The slot weights reach the experts' rows in fp32
    (route.nodes.slots: a SlotPlan or HopSlots), and their gradient, the fp32 dot product
    of each row's decoded gradient with y, goes back the same way in every backward (a
    collective every rank runs, whether its weights require grad or not)."""

    @staticmethod
    def forward(ctx, y, weights, rows_of, src_row, out_row, route, wires, mode):
        hidden, dtype, wire = y.shape[1], y.dtype, wires[0]
        w = route.nodes.slots.to_rows(weights.float()).to(dtype).float()
        z = (w[:, None] * y.float()).to(dtype)
        buf = rows_ops.gather_encode(z, out_row, wire, mode)
        back = route.move(buf, True, wire, mode, (hidden, dtype))
        ctx.args = (weights.shape, weights.dtype, route, wires[1], mode)
        ctx.save_for_backward(y, w, rows_of, src_row)
        return rows_ops.slot_sum_decode(back, rows_of, None, hidden, dtype, wire)

    @staticmethod
    def backward(ctx, grad):
        y, w, rows_of, src_row = ctx.saved_tensors
        shape, w_dtype, route, wire, mode = ctx.args
        buf = rows_ops.scatter_encode(grad.contiguous(), rows_of, route.send_rows(), wire, mode)
        buf = route.move(buf, False, wire, mode, (y.shape[1], y.dtype))
        gz = rows_ops.gather_decode(buf, src_row, y.shape[1], y.dtype, wire).float()
        grad_y = (w[:, None] * gz).to(y.dtype)
        grad_w = route.nodes.slots.to_slots((gz * y.float()).sum(1)).view(shape)
        return grad_y, grad_w.to(w_dtype), None, None, None, None, None, None


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
    sums over j in order. Differentiable in y and weights.

    A node-aware route (route.nodes) weights the rows where the experts are instead
    (:class:`_CombineAtExperts`)."""
    if route.nodes is not None:
        return _CombineAtExperts.apply(y, weights, rows_of, src_row, out_row, route, wires, mode)
    return _Combine.apply(y, weights, rows_of, src_row, out_row, route, wires, mode)


@dataclass
class SlotPlan:
    """The flat path's plan of one dispatch (plan.py's packed layout): rows_of [T, k],
    src_row [N], out_row [R], splits (sent, received) per rank of ``group``."""

    rows_of: torch.Tensor
    src_row: torch.Tensor
    out_row: torch.Tensor
    splits: tuple[list[int], list[int]]
    group: dist.ProcessGroup | None
    functional: bool = False

    def to_rows(self, values: torch.Tensor) -> torch.Tensor:
        """values [T, k] -> [N]: each expert row's (token, slot) value, exchanged exactly
        (zeros for padding rows)."""
        sent, received = self.splits
        buf = rows_ops.put_rows(values.reshape(-1), self.rows_of.reshape(-1), sum(sent))
        got = all_to_all(buf, received, sent, self.group, self.functional)
        return rows_ops._take(got, self.src_row)

    def to_slots(self, rows: torch.Tensor) -> torch.Tensor:
        """The reverse: rows [N] -> [T * k], each (token, slot)'s row's value."""
        sent, received = self.splits
        buf = rows_ops._take(rows.contiguous(), self.out_row)
        back = all_to_all(buf, sent, received, self.group, self.functional)
        return rows_ops._take(back, self.rows_of.reshape(-1))


@dataclass
class HopSlots:
    """The slot weights' way to the experts' rows along a fixed-slot node-aware route's hops
    (the static dispatch): each stage-1 row carries its token's k values (fp32) over the rail,
    the forwarder picks each stage-2 row's slot, the node group delivers it; to_slots is the
    reverse. node_rows / all_rows [T, k]: the stage-1 row of each (token, node)'s first slot
    / of every slot; fwd_idx, fwd_slot [stage-2 rows]: the stage-1 row and slot each copies;
    src_row / out_row: the stage-2 receive plan (plan.receive_plan)."""

    node_rows: torch.Tensor
    all_rows: torch.Tensor
    fwd_idx: torch.Tensor
    fwd_slot: torch.Tensor
    src_row: torch.Tensor
    out_row: torch.Tensor
    rows: int  # stage-1 rows
    rail: dist.ProcessGroup | None
    node: dist.ProcessGroup | None
    functional: bool = False

    def to_rows(self, values: torch.Tensor) -> torch.Tensor:
        """values [T, k] fp32 -> [N]: each expert row's (token, slot) value (0: padding)."""
        f = self.functional
        sent = node_plan.source_ids(values, self.node_rows, self.rows)
        got = F.pad(all_to_all(sent, None, None, self.rail, f), (0, 1, 0, 1))  # (0 at [-1, -1])
        picked = got[self.fwd_idx, torch.where(self.fwd_idx < 0, -1, self.fwd_slot)]
        return rows_ops._take(all_to_all(picked, None, None, self.node, f), self.src_row)

    def to_slots(self, rows: torch.Tensor) -> torch.Tensor:
        """The reverse: rows [N] -> [T * k], each slot's row's value (0: dropped)."""
        f = self.functional
        back = all_to_all(rows_ops._take(rows.contiguous(), self.out_row), None, None, self.node, f)
        k = self.all_rows.shape[1]
        spread = back.new_zeros((self.rows + 1, k + 1))  # (unused stage-2 rows: the last)
        unused = self.fwd_idx < 0
        at = (torch.where(unused, self.rows, self.fwd_idx), torch.where(unused, k, self.fwd_slot))
        spread.index_put_(at, back)
        got = all_to_all(spread[: self.rows, :k].contiguous(), None, None, self.rail, f)
        got = F.pad(got, (0, 0, 0, 1))
        slot = torch.arange(k, device=got.device).expand_as(self.all_rows)
        return got[self.all_rows, slot].reshape(-1)  # (row -1: the zero row; capacity 0)
