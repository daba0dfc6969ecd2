"""Expert-parallel MoE dispatch and combine on the MXFP8 exchange.

Experts are spread evenly over the ranks of ``group``: rank r holds experts
[r * L, (r + 1) * L), L = num_experts // world. ``dispatch`` sends each (token, top-k slot)
row to the rank of its expert and returns them grouped by local expert; ``combine`` sends
the expert outputs back and sums them with the router weights in the original token order.
Autograd flows through both (the exchanges' backward is the reverse exchange).

Collectives and host syncs: ``dispatch`` makes one small all-to-all of per-expert counts
and one host sync to read the splits that all_to_all_single needs, then the exchange. The
counts message has a fixed size (DISPATCH_INLINE_COUNTS count columns per rank, whatever
num_experts is) and starts with each rank's agreement word (exchange/agreement.py: an error
status and a digest of num_experts, hidden size, dtype, exchange, transport and whether x
records a graph), so that bad arguments on one rank, or ranks that disagree, raise the
same ValueError on every rank before any exchange (only then a second collective brings
the messages). With more local experts than that, the counts follow in a second all-to-all
(and host sync), once the ranks are known to agree. The splits come from the counts, so
they agree across ranks by construction. ``combine`` has no host sync and no collective
besides its exchange. With a NodeTopology spanning nodes (``topology=``), the rows take two
hops (node_plan.py) after a second small all-to-all over the rail and host sync for the
hops' splits, and one all-to-all of the expert ids; combine adds one exchange of the slot
weights (4 bytes a row) to the experts' ranks.

The rows move through the same engine as dispatch_static's (engine.py), on the plan's
packed layout (plan.py: capacity=None): the counts read on the host give exact buffers and
splits, no row dropped, none padded.

Every rank of the group must call dispatch and combine alike (and run the backward alike).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import _config
from ..exchange import agreement
from ..exchange.checks import comm_device, group_rank_and_size
from ..exchange.nccl import NCCL, resolve
from ..exchange.transport import Transport
from ..exchange.wires import Wires, combine_default, leg_pair
from .checks import argument_error, check_combine, mark_output
from .engine import NodeStages, Route, SlotPlan, all_to_all, combine_rows, dispatch_rows
from .node_plan import expert_order, forward_plan, remap, source_ids, source_plan
from .plan import receive_plan, send_plan
from .terms import DISPATCH
from .topology import NodeTopology, spans
from .topology import topology_error as _topology_error

COMPILE_ERROR = (
    "the host-synced dispatch (mxfp8_a2a.dispatch, ExpertParallelMoE without max_tokens) reads "
    "the token counts on the host and cannot be traced by torch.compile(fullgraph=True): use the "
    "static dispatch (mxfp8_a2a.dispatch_static, or ExpertParallelMoE(max_tokens=...)) in "
    "fullgraph-compiled code, or compile with fullgraph=False (this call then runs eagerly)"
)


@dataclass
class DispatchHandle:
    """What combine needs to undo a dispatch. Tensors are on x's device.

    rows_of: int64 [T, k], the send-buffer row of each (token, slot) (plan.py's packed
    layout). src_row: int64 [N], the receive-buffer row of each output row; out_row: int64
    [N], the output row of each receive-buffer row. input_splits / output_splits: rows sent
    to / received from each rank. expert_offsets: int32 [L], end offset of each local
    expert's rows in dispatch's output (what grouped GEMMs take). hidden: for the checks.
    exchange: combine's default (forward, backward) wires; transport: how MXFP8 rows move.
    nodes, topology: the node-aware route's hops and nodes (None: flat; then rows_of,
    src_row and out_row are the hops' maps: stage-1 send rows, stage-2 receive rows);
    dispatch_wires,
    dtype: dispatch's (forward, backward) wires and x's dtype (for sent_bytes).
    dispatch_id: which dispatch (see :func:`mark_output`). functional: the exchanges as
    torch's functional all_to_all_single (see engine.Route).
    """

    rows_of: torch.Tensor
    src_row: torch.Tensor
    out_row: torch.Tensor
    input_splits: list[int]
    output_splits: list[int]
    expert_offsets: torch.Tensor
    hidden: int
    group: dist.ProcessGroup | None
    exchange: tuple[str, str]
    transport: Transport = NCCL
    dispatch_id: int = 0
    functional: bool = False
    nodes: NodeStages | None = None
    topology: NodeTopology | None = None
    dispatch_wires: tuple[str, str] = ("mxfp8", "mxfp8")
    dtype: torch.dtype = torch.bfloat16

    @property
    def route(self) -> Route:
        """How this dispatch's buffers travel (engine.py)."""
        transport = None if self.transport is NCCL else self.transport
        splits = (self.input_splits, self.output_splits)
        return Route(self.group, None, splits, transport=transport, functional=self.functional,
                     nodes=self.nodes)  # fmt: skip


def dispatch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
    *,
    exchange: str | tuple[str, str] | Wires = "mxfp8",
    transport: str | Transport = "nccl",
    topology: NodeTopology | None = None,
) -> tuple[torch.Tensor, list[int], DispatchHandle]:
    """Send each token to the ranks of its top-k experts.

    Args:
        x: [T, H] bf16 or fp32 tokens (H % 32 == 0 for "mxfp8"); T may be 0.
        topk_ids: [T, k] integer expert ids in [0, num_experts); k may be 0.
        num_experts: total experts, a multiple of the group size.
        exchange: the wires of the rows (forward) and of their gradient (backward): a preset
            ("mxfp8", "bf16": a plain all-to-all in x's dtype, "mxfp8_to_experts": MXFP8
            forward, bf16 backward; see :mod:`mxfp8_a2a.exchange.wires`), a Wires (its dispatch
            legs) or a (forward, backward) pair of "mxfp8" / "bf16".
        transport: of the MXFP8 exchanges, "nccl" (default) or a Transport object (see
            :func:`mxfp8_a2a.to_mxfp8_a2a_dequant`).
        topology: a NodeTopology of ``group`` spanning nodes: the node-aware route (each
            token sent once per node it reaches, forwarded within the node; combine weights
            the rows at the experts and sums within the node first; moe/node_plan.py). It
            adds a counts all-to-all over the rail and its host sync, an all-to-all of the
            expert ids, a second hop per row exchange, and combine's exchange of the slot
            weights (forward and backward). expert_x is the flat path's, bit for bit;
            combine rounds once more per node. None or one node: flat.
    Returns:
        expert_x: [N, H] rows received, grouped by local expert (expert 0 first), within an
            expert by source rank; tokens_per_expert: list of L ints, rows per local expert
            (read in the same host sync as the splits); handle for :func:`combine`
            (handle.expert_offsets holds the same counts as int32 end offsets on x's device).
    Bad arguments on any rank (shapes, types, ids out of range) and ranks that disagree
    (num_experts, hidden size, dtype, exchange, transport, topology, x.requires_grad) raise
    the same ValueError on every rank, naming the rank and the argument; the group stays
    usable. Every rank must call it. One counts all-to-all and one host sync (two of each
    past DISPATCH_INLINE_COUNTS local experts; one more of each with a topology), then the
    exchange.
    """
    return dispatch_reporting(
        x, topk_ids, num_experts, group, exchange, transport, None, topology=topology
    )


def dispatch_reporting(
    x: torch.Tensor,
    topk_ids: torch.Tensor | None,
    num_experts: int,
    group: dist.ProcessGroup | None,
    exchange: str,
    transport: str | Transport,
    problem: str | None,
    *,
    functional: bool = False,
    topology: NodeTopology | None = None,
) -> tuple[torch.Tensor, list[int], DispatchHandle]:
    """:func:`dispatch`, with ``problem`` (what the caller found wrong with this rank's
    arguments, or None) raised like dispatch's own checks: as the same ValueError on every
    rank, so that a layer whose input is bad on one rank does not leave the others waiting
    in the counts all-to-all (topk_ids may then be None). functional: every all-to-all
    (counts and rows) as torch's functional collective, which selective activation
    checkpointing policies save (torchtitan's does) instead of running it again."""
    if torch.compiler.is_compiling():  # fullgraph=True gets this; else Dynamo runs it eagerly
        raise RuntimeError(COMPILE_ERROR)
    rank, world = group_rank_and_size(group)
    error: Exception | None = None
    terms, counts = "", None
    try:
        chosen = resolve(transport)
        problem = problem or argument_error(x, topk_ids, num_experts, world, exchange, group)
        problem = problem or _topology_error(topology, group, chosen)
        if problem is not None:
            raise ValueError(problem)
        if "mxfp8" in leg_pair(exchange, "dispatch"):
            chosen.check(x.device, group)
        args = dict(x=x, topk_ids=topk_ids, num_experts=num_experts,
                               exchange=exchange, transport=chosen, topology=topology)  # fmt: skip
        terms = agreement.terms_of(DISPATCH, args)
    except Exception as e:  # every rank learns of it through the counts all-to-all
        error = e
    # every rank sends every rank [its agreement word, INLINE counts]: the same size on
    # every rank whatever its arguments; the word's status: 0 fine, 1 ids out of range
    # (added on the device), 2 or 3 bad arguments
    inline = _config.DISPATCH_INLINE_COUNTS
    local = num_experts // world if error is None else 0
    dev = comm_device(group)
    if error is None:
        rows_of, counts, stats = send_plan(topk_ids, num_experts, world, None)  # packed
        bad = stats[2:].clamp(max=1)  # ids outside [0, num_experts)
        word = bad.add(agreement.word(agreement.FINE, terms)).expand(world, 1)  # one kernel
        if local <= inline:
            sent = torch.cat([word, F.pad(counts, (0, inline - local))], 1).to(dev)
        else:  # (the counts follow)
            sent = F.pad(word, (0, inline)).to(dev)
    else:
        sent = torch.zeros(world, 1 + inline, dtype=torch.int64, device=dev)
        sent[:, 0] = agreement.status_of(error)
    recv = all_to_all(sent, None, None, group, functional)  # [source, word | counts]
    if 0 < local <= inline:
        recv_counts = recv[:, 1 : 1 + local]  # [source, local expert]
        sizes = torch.cat(
            [recv[:, 0], sent[:, 1:].sum(1), recv_counts.sum(1), recv_counts.sum(0)]
        ).tolist()  # the host sync: all_to_all_single needs the splits
    else:
        sizes = recv[:, 0].tolist()  # (no counts yet)
    words, sizes = sizes[:world], sizes[world:]
    if len(set(words)) > 1 or words[0] % 4:  # the same on every rank: it has every word
        _raise_on_every_rank(words[rank] % 4, error, terms, topk_ids, num_experts, group)
    if local > inline:  # the ranks agree on num_experts: the counts' own all-to-all
        recv_counts = all_to_all(counts.to(dev), None, None, group, functional)
        sizes = torch.cat([counts.sum(1).to(dev), recv_counts.sum(1), recv_counts.sum(0)])
        sizes = sizes.tolist()
    input_splits, output_splits = sizes[:world], sizes[world : 2 * world]
    per_expert, n = sizes[2 * world :], sum(output_splits)
    recv_counts = recv_counts.to(device=x.device, dtype=torch.int64)
    src_row, out_row, offsets = receive_plan(recv_counts.contiguous(), None, 1, (n, n))
    nodes = None
    if spans(topology):
        slots = SlotPlan(rows_of, src_row, out_row, (input_splits, output_splits), group,
                         functional)  # fmt: skip
        nodes, rows_of, src_row, out_row = _node_stages(
            topology, topk_ids, num_experts, counts, recv_counts, output_splits, slots, dev
        )
    handle = DispatchHandle(
        rows_of, src_row, out_row, input_splits, output_splits, offsets, x.shape[1], group,
        combine_default(exchange), chosen, functional=functional, nodes=nodes,
        topology=topology if nodes is not None else None,
        dispatch_wires=leg_pair(exchange, "dispatch"), dtype=x.dtype,
    )  # fmt: skip
    wires = leg_pair(exchange, "dispatch")
    out = dispatch_rows(x, rows_of, src_row, out_row, handle.route, wires, "rceil")
    handle.dispatch_id = mark_output(out)
    return out, per_expert, handle


def _node_stages(topology, topk_ids, num_experts, counts, recv_counts, output_splits, slots,
                 dev):  # fmt: skip
    """The node-aware route's plan (node_plan.py): one small all-to-all over the rail and a
    host sync for the hops' splits, the ids' all-to-all, then the index maps on the device.
    Returns (NodeStages, node_rows, stage-2 src_row, stage-2 out_row)."""
    nodes, g, f = topology.nodes, topology.ranks_per_node, slots.functional
    per_node_experts = num_experts // nodes
    node_rows, per_node, _, _ = source_plan(topk_ids, per_node_experts, nodes)
    # to the forwarder on node m: [rows for m, rows for each rank of m]
    msg = torch.cat([per_node[:, None], counts.sum(1).view(nodes, g)], 1)
    got = all_to_all(msg.to(dev), None, None, topology.rail, f)
    host = torch.cat([per_node.to(dev), got.reshape(-1)]).tolist()  # the host sync
    rail_send, got = host[:nodes], [host[nodes + i * (g + 1) :][: g + 1] for i in range(nodes)]
    rail_recv = [row[0] for row in got]
    node_send = [sum(row[1 + i] for row in got) for i in range(g)]
    node_recv = [sum(output_splits[n * g + i] for n in range(nodes)) for i in range(g)]
    ids = source_ids(topk_ids.to(torch.int32), node_rows, sum(rail_send))
    ids = all_to_all(ids.to(dev), rail_recv, rail_send, topology.rail, f).to(topk_ids.device)
    sum_rows, fwd_idx, _, _, _ = forward_plan(
        ids, topology.node, per_node_experts, g, sum(node_send)
    )
    n = sum(output_splits)
    order = expert_order(recv_counts, nodes, g, n)
    src_row, out_row = remap(slots.src_row, slots.out_row, order)
    stages = NodeStages(topology.rail, topology.node_group, (rail_send, rail_recv),
                        (node_send, node_recv), fwd_idx, sum_rows, slots,
                        sum(rail_send))  # fmt: skip
    return stages, node_rows, src_row, out_row


def _raise_on_every_rank(status, error, terms, topk_ids, num_experts, group) -> None:
    """Some rank's word says bad arguments or ids, or the words differ: gather every rank's
    message or terms (agreement.py) and raise the same error on every rank."""
    if error is None and status == agreement.BAD_VALUES:
        ids = topk_ids[(topk_ids < 0) | (topk_ids >= num_experts)]
        error = ValueError(
            f"topk_ids holds {ids.numel()} ids outside [0, num_experts={num_experts}) "
            f"(from {ids.min().item()} to {ids.max().item()}); route to existing experts"
        )
    text = terms if error is None else str(error)
    agreement.agree(DISPATCH, status, text, [], group)


def combine(
    expert_y: torch.Tensor,
    topk_weights: torch.Tensor,
    handle: DispatchHandle,
    *,
    exchange: str | tuple[str, str] | Wires | None = None,
) -> torch.Tensor:
    """Send expert outputs back and sum them with the router weights.

    Args:
        expert_y: [N, H] outputs in the order :func:`dispatch` returned the rows.
        topk_weights: [T, k] router weights of each token's experts.
        handle: from the matching dispatch.
        exchange: the wires of the outputs (forward) and of their gradient (backward): a
            preset (its combine legs), a Wires or a (forward, backward) pair; default: the
            dispatch's preset's combine legs (for a dispatch pair (f, b): (b, f), each
            direction on its own wire). Every rank must pass the same.
    Returns:
        [T, H] in expert_y's dtype: out[t] = sum_j topk_weights[t, j] * y(t, expert j).
    Every rank of the group must call combine after its dispatch (it is a collective). A
    bad argument (expert_y with more or fewer rows than dispatch returned, another width,
    the output of another dispatch than the handle's (:func:`check_owner`: the tensor
    dispatch returned, not rows computed from it), topk_weights of the wrong shape, dtype
    or device) raises a ValueError on this rank
    before any collective; the other ranks then wait in combine's exchange until this
    rank's process ends (gloo and NCCL then fail them) or the process group's timeout:
    there is no cross-rank check here (it would cost a collective).
    """
    check_combine(expert_y, topk_weights, handle, exchange)
    wires = handle.exchange if exchange is None else leg_pair(exchange, "combine")
    return combine_rows(expert_y, topk_weights, handle.rows_of, handle.src_row, handle.out_row,
                        handle.route, wires, "rceil")  # fmt: skip
