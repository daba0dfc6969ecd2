"""Static-shape (sync-free) dispatch and combine: counts on the device, fixed capacity,
expert-major output.

Every shape depends only on what the host knows (tokens T, top_k, num_experts, the group
size W, ``capacity``), so nothing is read on the host, forward or backward: a MoE layer on
it can be captured in one CUDA graph and traced by torch.compile(fullgraph=True).

Capacity: rows per (source rank, destination rank) pair. Over NCCL each rank sends every
other rank exactly ``capacity`` wire rows (all_to_all_single with fixed, equal splits; rows
past a pair's count are never read), so wire bytes and buffers are W * capacity rows per
rank each way, whatever the routing; over a PushBuffer (push.py) only the rows kept
are stored, at the same places. Per rank pair rather than per expert: the drop decision is
local to the sender, experts of one rank share the rank's room (skew between the experts of
a rank costs no drops), and the dropless value is small: T * min(top_k, L) for distinct ids
per token (L = num_experts / W local experts), T * top_k in general.

Drop rule: a (token, slot) row is dropped when its destination rank already got
``capacity`` rows of this rank in token-major order (token t before t + 1, slot j before
j + 1 within a token): the first ``capacity`` rows to each rank are kept. Ids outside
[0, num_experts) are dropped too and counted apart. A dropped row is not sent, adds nothing
to combine's sum (whatever its router weight) and gets zero gradient.

Output layout (expert-major): local expert l's rows in one block, within it by source
rank, within a source in token-major order (the order :func:`dispatch` returns). Block l
starts at offs[l - 1] (0 for l = 0) and holds round_up(n_l, align) rows, the rows past n_l
zero; offs = int32 end offsets, what grouped_mm takes. The output has
``static_rows(capacity, W, L, align)`` rows; the rows past offs[-1] are zero too.

Collectives (NCCL; a PushBuffer's exchanges stand in the same places): one
all_to_all_single of the counts, then one of the rows (fixed splits), forward; the rows' one
backward. The counts message has one size whatever num_experts is
(num_experts, then DISPATCH_INLINE_COUNTS count columns, or L if more): a rank
drops the rows to and from ranks whose num_experts differs from its own and records it in
its stats, so that :func:`check_no_drops` raises the same error on every rank (no sync
here to raise it sooner). Every rank must pass the same hidden size, dtype, exchange and
capacity (they set the rows' collective's size) and, past DISPATCH_INLINE_COUNTS local
experts, the same num_experts: each new configuration is checked across the ranks once
(checks.py), so that ranks that disagree raise the same error instead of hanging.

With a NodeTopology (``topology=``), the rows take the node-aware route's two hops in fixed
slots (node_plan.py; see dispatch_static's ``topology``), still without a host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..exchange import agreement
from ..exchange.agreement import _all_gather as all_gather
from ..exchange.checks import group_rank_and_size
from ..exchange.nccl import NCCL
from ..exchange.push import PushBuffer, counts_columns
from ..exchange.wires import Wires, combine_default, leg_pair
from . import checks
from . import push as sp
from .checks import check_combine_static, check_static, mark_output
from .engine import HopSlots, NodeStages, Route, all_to_all, combine_rows, dispatch_rows
from .node_plan import forward_plan, source_ids, source_plan
from .plan import capacity_for as capacity_for  # (public here)
from .plan import receive_plan, send_plan
from .plan import static_rows as static_rows  # (public here)
from .push import check_fits
from .terms import STATIC
from .topology import NodeTopology, spans, topology_error

STAT_NAMES = ("dropped", "needed_capacity", "invalid_ids", "num_experts_differs")


@dataclass
class StaticHandle:
    """What :func:`combine_static` needs; tensors on x's device.

    rows_of: int64 [T, k], the send-buffer row of each (token, slot), -1 if dropped.
    src_row: int64 [N], the receive-buffer row each output row came from, -1 for padding.
    out_row: int64 [W * capacity], the output row of each receive-buffer row, -1 if unused.
    expert_offsets: int32 [L] end offsets of the experts' blocks (aligned).
    stats: int64 [4] of this rank: rows dropped, the capacity that would have kept every row
    (the most rows it routed to one rank), ids outside [0, num_experts), and this rank's
    num_experts if some rank's differed, else 0 (STAT_NAMES).
    exchange: combine_static's default (forward, backward) wires.
    dispatch_id: which dispatch (checks.mark_output; combine_static checks expert_y).
    push: the PushBuffer the rows travel through, None for NCCL/gloo.
    functional: NCCL/gloo exchanges as torch's functional all_to_all_single (engine.Route).
    """

    rows_of: torch.Tensor
    src_row: torch.Tensor
    out_row: torch.Tensor
    expert_offsets: torch.Tensor
    stats: torch.Tensor
    capacity: int
    hidden: int
    dtype: torch.dtype
    group: dist.ProcessGroup | None
    exchange: tuple[str, str]
    scaling_mode: str
    dispatch_id: int = 0
    push: PushBuffer | None = None
    functional: bool = False
    nodes: NodeStages | None = None  # the node-aware route's hops (topology), None: flat


def _exchange_counts(rows_of, sent, stats, num_experts, capacity, group, push, functional):
    """The counts all-to-all: [W, 1 + max(INLINE, L)] whatever L is, column 0 num_experts
    (itself, not dispatch's agreement word: its digest does not trace under torch.compile).
    Returns rows_of without the rows to ranks whose num_experts differs, the counts
    received [W, L] with those ranks' zeroed, and stats with the rows lost added to the
    drops and num_experts in stats[3] if any rank differed."""
    world, local = sent.shape
    msg = F.pad(sent, (1, counts_columns(local) - 1 - local))
    msg[:, 0] = num_experts
    if push is None:
        recv = all_to_all(msg, None, None, group, functional)
    else:
        recv = sp.push_counts_op(msg, push.key)
    agrees = recv[:, 0] == num_experts  # [source rank]
    if capacity:  # rows to a rank that differs are not sent (nor read back by combine)
        kept = rows_of.ge(0)
        rows_of = torch.where(agrees[rows_of.div(capacity, rounding_mode="floor")], rows_of, -1)
        lost = kept.sum() - rows_of.ge(0).sum()
    else:
        lost = stats.new_zeros(())
    differs = (~agrees).any() * num_experts
    stats = torch.stack([stats[0] + lost, stats[1], stats[2], differs])
    return rows_of, recv[:, 1 : 1 + local] * agrees[:, None], stats


def dispatch_static(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    capacity: int,
    group: dist.ProcessGroup | None = None,
    *,
    exchange: str | tuple[str, str] | Wires = "mxfp8",
    align: int = 16,
    scaling_mode: str = "rceil",
    transport: str | PushBuffer = "nccl",
    validate: bool = False,
    functional: bool = False,
    topology: NodeTopology | None = None,
) -> tuple[torch.Tensor, torch.Tensor, StaticHandle]:
    """Send each token to the ranks of its top-k experts, with no host sync.

    Args:
        x: [T, H] tokens (bf16 or fp32, H % 32 == 0, for an MXFP8 leg); T may be 0.
        topk_ids: [T, k] integer expert ids; ids outside [0, num_experts) are dropped and
            counted (stats[2]).
        num_experts: total experts, a multiple of the group size W.
        capacity: rows each rank sends each rank (:func:`capacity_for` from a capacity
            factor; T * min(k, L) is dropless for distinct ids per token). Memory: two
            wire buffers of W * capacity rows (the send and receive buffers; wire rows are
            1.03 * H bytes for "mxfp8", 2 * H for "bf16" with bf16 x) and the
            static_rows(...) x H output, each way.
        exchange: the wires of the rows (forward) and of their gradient (backward), each
            "mxfp8" (rows quantized once per token, dequantized on arrival) or "bf16" (rows
            in x's dtype, unquantized): a preset ("mxfp8", "bf16", "mxfp8_to_experts": MXFP8
            forward, bf16 backward; :mod:`mxfp8_a2a.exchange.wires`), a Wires (its dispatch legs)
            or a (forward, backward) pair.
        align: rows per expert block are rounded up to a multiple of it (16: what torch's
            FP8 grouped GEMMs want along the tokens).
        transport: "nccl" (all_to_all_single over the group's backend: fixed splits, padding
            rows included) or a :class:`PushBuffer` (one node: each rank's kernels store the
            rows it sends straight into the receivers' buffers, padding never sent; group
            may then be None, the buffer's; bf16/fp32 x). Same results bit for bit; the
            PushBuffer replaces the two wire buffers of the memory above.
        validate: check the configuration across the ranks on every call (also with
            MXFP8_A2A_VALIDATE=1), not only at a new one (see below).
        functional: the counts and rows through torch's functional all_to_all_single (as
            under torch.compile), which selective activation checkpointing policies can save
            (torchtitan's does) so that a recomputed forward does not exchange again.
        topology: a NodeTopology of ``group`` spanning nodes: the node-aware route
            (:func:`mxfp8_a2a.dispatch`'s, in fixed slots, "nccl" transport only). Stage 1
            holds G * capacity rows per (source, node) (G ranks per node: never fewer
            tokens than the flat path keeps slots), stage 2 N * capacity rows per
            (forwarder, rank) (N nodes), so the buffers and the output have the flat path's
            sizes; rows past either are dropped (stats: slots dropped at both stages, the
            capacity that keeps all, invalid ids; num_experts is in the agreement instead).
            The output is expert-major, within an expert by forwarder, then source node.
    Returns:
        expert_x: [static_rows(capacity, W, L, align), H] in x's dtype, expert-major (module
            docstring), padding rows zero; expert_offsets: int32 [L] end offsets of the
            blocks (grouped_mm's offs; rows past offs[-1] are zero); handle for
            :func:`combine_static` (handle.stats: drops, see StaticHandle).
    Differentiable in x; the backward sends the gradient back on the dispatch-backward wire
    and sums each token's k copies. Arguments the host sees are checked before
    any collective. At each new configuration (capacity, hidden, exchange, x's dtype where
    the wire carries it, num_experts past the inline counts, transport kind, scaling mode;
    moe/checks.py) one small all_gather checks it across the ranks, eagerly, and a
    rank's bad argument or a size that differs between ranks raises the same ValueError on
    every rank; a known configuration costs no collective. Under torch.compile the check
    runs with validate only (agreement.agree_compiled, on every call); under CUDA graph
    capture not at all: run one eager call first. A change on one rank only after the
    ranks agreed is caught there alone: pass validate=True to catch it everywhere.
    """
    error, text, push = None, "", None
    try:  # (a rank's error travels in the agreement: raised on every rank that joins it)
        group, push, world = _carrier(group, transport)
        check_static(x, topk_ids, num_experts, world, capacity, align, exchange, scaling_mode,
                     group)  # fmt: skip
        wires = leg_pair(exchange, "dispatch")
        if push is not None:
            columns = counts_columns(num_experts // world)
            check_fits(push, capacity, x.shape[1], x.dtype, wires, columns, x.device)
        if problem := topology_error(topology, group, NCCL if push is None else push):
            raise ValueError(problem)
        args = dict(x=x, topk_ids=topk_ids, num_experts=num_experts, world=world,
                               capacity=capacity, exchange=exchange, scaling_mode=scaling_mode,
                               transport=transport, topology=topology)  # fmt: skip
        text = agreement.terms_of(STATIC, args)
    except (TypeError, ValueError) as e:
        if push is None and not dist.is_initialized():  # (no group to tell)
            raise
        error, world = e, (push.world if push is not None else group_rank_and_size(group)[1])
    x = checks.agree_static(text, error, group, push, world, validate, x)
    if spans(topology):
        return _node_route(x, topk_ids, num_experts, capacity, group, exchange, align,
                           scaling_mode, functional, topology)  # fmt: skip
    rows_of, sent, stats = send_plan(topk_ids, num_experts, world, capacity)
    rows_of, recv, stats = _exchange_counts(rows_of, sent.to(x.device), stats, num_experts,
                                            capacity, group, push, functional)  # fmt: skip
    src_row, out_row, offs = receive_plan(recv, capacity, align)
    route = Route(group, capacity, push=push, functional=functional)
    out = dispatch_rows(x, rows_of, src_row, out_row, route, wires, scaling_mode)
    handle = StaticHandle(
        rows_of, src_row, out_row, offs, stats, capacity, x.shape[1], x.dtype, group,
        combine_default(exchange), scaling_mode, mark_output(out), push, functional,
    )  # fmt: skip
    return out, offs, handle


def _node_route(x, topk_ids, num_experts, capacity, group, exchange, align, mode, functional,
                topology):  # fmt: skip
    """dispatch_static on a node-aware route (node_plan.py), all on the device."""
    nodes, g, f = topology.nodes, topology.ranks_per_node, functional
    per_node, c1, c2 = num_experts // nodes, g * capacity, nodes * capacity
    node_rows, _, all_rows, stats1 = source_plan(topk_ids, per_node, nodes, c1)
    ids = source_ids(topk_ids.to(torch.int32), node_rows, nodes * c1, fill=-1)
    ids = all_to_all(ids, None, None, topology.rail, f)
    sum_rows, fwd_idx, fwd_slot, kept, stats2 = forward_plan(
        ids, topology.node, per_node, g, g * c2, c2
    )
    recv = all_to_all(kept, None, None, topology.node_group, f)  # [forwarder, local expert]
    src_row, out_row, offs = receive_plan(recv, c2, align)
    slots = HopSlots(node_rows, all_rows, fwd_idx, fwd_slot, src_row, out_row, nodes * c1,
                     topology.rail, topology.node_group, f)  # fmt: skip
    stages = NodeStages(topology.rail, topology.node_group, (None, None), (None, None), fwd_idx,
                        sum_rows, slots, nodes * c1)  # fmt: skip
    need = torch.maximum((stats1[1] + g - 1) // g, (stats2[1] + nodes - 1) // nodes)
    stats = torch.stack([stats1[0] + stats2[0], need, stats1[2], stats1[2] * 0])
    route = Route(group, capacity, functional=f, nodes=stages)
    wires = leg_pair(exchange, "dispatch")
    out = dispatch_rows(x, node_rows, src_row, out_row, route, wires, mode)
    handle = StaticHandle(
        node_rows, src_row, out_row, offs, stats, capacity, x.shape[1], x.dtype, group,
        combine_default(exchange), mode, mark_output(out), None, f, stages,
    )  # fmt: skip
    return out, offs, handle


def _same_group(a, b) -> bool:
    """Whether ``a`` (None: the buffer's) and a PushBuffer's group ``b`` are one group."""
    b = b if b is not None else (dist.group.WORLD if dist.is_initialized() else None)
    a = a if a is not None else b
    return a is b or (a is not None and b is not None and a.group_name == b.group_name)


def _carrier(group, transport) -> tuple[dist.ProcessGroup | None, PushBuffer | None, int]:
    """(group, push buffer or None, group size) for dispatch_static's arguments."""
    if isinstance(transport, PushBuffer):
        if not _same_group(group, transport.group):
            raise ValueError("group must be the PushBuffer's own group (or None for it)")
        return transport.group, transport, transport.world
    if not isinstance(transport, str) or transport != "nccl":
        raise ValueError(f"transport must be 'nccl' or a PushBuffer, got {transport!r}")
    return group, None, group_rank_and_size(group)[1]


def combine_static(
    expert_y: torch.Tensor,
    topk_weights: torch.Tensor,
    handle: StaticHandle,
    *,
    exchange: str | tuple[str, str] | Wires | None = None,
) -> torch.Tensor:
    """Send expert outputs back and sum them with the router weights, with no host sync.

    Args:
        expert_y: [N, H] in the layout :func:`dispatch_static` returned (padding rows are
            not read; their gradient is zero).
        topk_weights: floating [T, k] router weights.
        handle: from the matching dispatch_static.
        exchange: the wires of the outputs (forward) and of their gradient (backward): a
            preset (its combine legs), a Wires or a (forward, backward) pair; default: the
            dispatch's (a preset's combine legs; for a dispatch pair (f, b): (b, f)).
    Returns:
        [T, H] in expert_y's dtype: out[t] = sum over kept j of topk_weights[t, j] *
        y(t, j), weights rounded to expert_y's dtype, fp32 sums over j in order. Dropped
        slots add nothing; their weights get zero gradient.
    """
    check_combine_static(expert_y, topk_weights, handle, exchange)
    h = handle.hidden
    wires = handle.exchange if exchange is None else leg_pair(exchange, "combine")
    if (push := handle.push) is not None:
        check_fits(push, handle.capacity, h, handle.dtype, wires, push.count_columns,
                   expert_y.device)  # fmt: skip
    route = Route(handle.group, handle.capacity, push=handle.push, functional=handle.functional,
                  nodes=handle.nodes)  # fmt: skip
    return combine_rows(expert_y, topk_weights, handle.rows_of, handle.src_row, handle.out_row,
                        route, wires, handle.scaling_mode)  # fmt: skip


def check_no_drops(stats: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Raise the same ValueError on every rank if any rank dropped rows or met bad ids.

    stats: int64 [4] (StaticHandle.stats, or a sum of them, e.g. ExpertParallelMoE's
    ``dispatch_stats``). A collective and a host sync: call it where the caller chooses (e.g.
    every N steps), on every rank."""
    _, world = group_rank_and_size(group)
    gathered = torch.empty(world * stats.numel(), dtype=stats.dtype, device=stats.device)
    all_gather(gathered, stats.contiguous(), group=group)
    per_rank = gathered.view(world, -1).tolist()
    if any(r[3:] and r[3] for r in per_rank):
        raise ValueError(
            f"static dispatch: num_experts differs between ranks ({[r[3] for r in per_rank]} "
            "by rank, 0: agreed with every rank), and the rows between ranks that differ were "
            "dropped; every rank must pass the same num_experts"
        )
    if any(r[0] or r[2] for r in per_rank):
        needed = max(r[1] for r in per_rank)
        raise ValueError(
            f"static dispatch dropped rows: {[r[0] for r in per_rank]} by rank, ids out of "
            f"range {[r[2] for r in per_rank]} by rank; a capacity of {needed} rows per rank "
            "pair would have kept every row (raise capacity or capacity_factor)"
        )
