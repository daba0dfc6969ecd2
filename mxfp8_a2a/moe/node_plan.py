"""The node-aware plan: where each row goes on the two hops of a dispatch across nodes.

Dispatch forward, for a group of N nodes x G ranks (topology.py), a token routed to k
experts:

1. at its source (node n, local index g): encoded once per node m that holds one of its
   experts into stage-1 row ``node_rows[t, j]`` (the first slot j of t on node m; -1 for
   the token's other slots on m), rows grouped by node, in token order within; sent over
   the rail (the ranks with local index g) to rank (m, g), the *forwarder*, with the
   token's k expert ids beside it;
2. at the forwarder: each received row copied, as wire bytes, once per slot whose expert is
   on node m, into its stage-2 row (:func:`forward_plan`: grouped by destination rank, then
   local expert, then received-row order) and sent over the node group;
3. at the expert rank: decoded into the flat path's expert layout (:func:`expert_order`
   maps each flat receive row to its stage-2 row), so the experts see what the flat path
   gives them, bit for bit.

Combine forward and dispatch backward run the hops in reverse: each forwarder sums the rows
of a stage-1 row in fp32 (rounded to the rows' dtype, then encoded again for the rail) and
the source sums its nodes' rows in the order of their first slots. Plain torch, small index
ops: these run once per dispatch, after the counts' host sync.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..exchange.rows import wire_row
from .plan import _rank_in_bucket, send_plan
from .rows import put_rows


def source_plan(
    topk_ids: Tensor, experts_per_node: int, nodes: int, capacity: int | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """topk_ids [T, k] -> (node_rows int64 [T, k]: the stage-1 send row of the first slot of
    each (token, node), -1 for the other slots; per_node int64 [N]: rows per destination node
    (before drops); all_rows int64 [T, k]: the stage-1 row of every slot's (token, node);
    stats int64 [3]: slots dropped, the most rows for one node, slots with invalid ids).
    capacity None: packed (node m's rows after the earlier nodes'); else fixed slots (node m's
    at m * capacity, the rows past it dropped with all their slots). Ids outside [0, N *
    experts_per_node) are not sent."""
    t, k = topk_ids.shape
    ids = topk_ids.to(torch.int64)
    valid = (ids >= 0) & (ids < nodes * experts_per_node)
    node = torch.where(valid, ids // experts_per_node, nodes)  # (N: an invalid id)
    earlier = torch.ones(k, k, dtype=torch.bool, device=node.device).tril(-1)
    repeat = ((node[:, :, None] == node[:, None, :]) & earlier).any(2)  # node seen before j
    key = torch.where(repeat | ~valid, nodes, node).reshape(-1)
    pos, count = _rank_in_bucket(key, nodes + 1)  # token-major within a node
    m = key.clamp(max=nodes - 1)
    if capacity is None:
        row, kept = (count.cumsum(0) - count)[m] + pos, key < nodes
    else:
        row, kept = m * capacity + pos, (key < nodes) & (pos < capacity)
    first = torch.where(kept, row, -1).view(t, k)
    # every slot's row: its node's first slot's (a [T, k, k] match, k is small)
    same = (node[:, :, None] == node[:, None, :]) & ~repeat[:, None, :] & valid[:, :, None]
    all_rows = torch.where(same, first[:, None, :], -1).amax(2) if k else first  # (k = 0)
    dropped = (valid & (all_rows < 0)).sum()
    stats = torch.stack([dropped, count[:nodes].max(), (~valid).sum()])
    return first, count[:nodes], all_rows, stats


def source_ids(values: Tensor, node_rows: Tensor, n_rows: int, fill: float = 0) -> Tensor:
    """[n_rows, k] in values' dtype: the k values of the token of each stage-1 row (its
    expert ids, or its slot weights), ``fill`` in rows no token uses."""
    t, k = values.shape
    token = torch.arange(t, device=values.device)[:, None].expand(t, k).reshape(-1)
    return put_rows(values[token], node_rows.reshape(-1), n_rows, fill)


def forward_plan(
    ids: Tensor,
    node: int,
    experts_per_node: int,
    ranks_per_node: int,
    n_rows: int,
    capacity: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """At the forwarder of ``node``: ids int32 [R1, k] (the received rows' expert ids, -1 in
    unused rows) -> (sum_rows int64 [R1, k]: the stage-2 send row of each (row, slot) whose
    expert is on this node, -1 otherwise; fwd_idx int64 [n_rows]: the received row each
    stage-2 row copies, -1 for none; fwd_slot int64 [n_rows]: its slot; the kept rows per
    (rank of the node, local expert) [G, L]; stats [3] as plan.send_plan's). capacity: rows
    per destination rank (fixed slots, the rest dropped), None: packed."""
    local = ids.to(torch.int64) - node * experts_per_node
    local = torch.where((local >= 0) & (local < experts_per_node), local, -1)
    sum_rows, counts, stats = send_plan(local, experts_per_node, ranks_per_node, capacity)
    r1, k = ids.shape
    src = torch.arange(r1 * k, device=ids.device)
    fwd = put_rows(src, sum_rows.reshape(-1), n_rows, -1)  # (row * k + slot)
    fwd_idx = torch.where(fwd < 0, -1, fwd.div(max(k, 1), rounding_mode="floor"))
    return sum_rows, fwd_idx, torch.where(fwd < 0, -1, fwd % max(k, 1)), counts, stats


def expert_order(recv_counts: Tensor, nodes: int, ranks_per_node: int, n: int) -> Tensor:
    """recv_counts int64 [W, L] (rows from each source rank for each local expert) -> int64
    [n]: the stage-2 receive row of each flat receive row (source-major: source s, expert l,
    then the rows in order). Stage 2 receives from each forwarder g (the sources of local
    index g) its rows by expert, then source node."""
    w, local = recv_counts.shape
    c = recv_counts.view(nodes, ranks_per_node, local)
    by_stage2 = c.permute(1, 2, 0).reshape(-1)  # [G, L, N] order
    start2 = (by_stage2.cumsum(0) - by_stage2).view(ranks_per_node, local, nodes)
    start2 = start2.permute(2, 0, 1).reshape(-1)  # back to [N, G, L] = [source, expert]
    flat = c.reshape(-1)
    start1 = flat.cumsum(0) - flat
    shift = torch.repeat_interleave(start2 - start1, flat, output_size=n)
    return shift + torch.arange(n, device=recv_counts.device)


def remap(src_row: Tensor, out_row: Tensor, order: Tensor) -> tuple[Tensor, Tensor]:
    """The flat receive plan (src_row [N], out_row [R]) on the stage-2 receive rows."""
    src2 = torch.where(src_row < 0, -1, order[src_row.clamp(min=0)])
    out2 = torch.empty_like(out_row).index_copy_(0, order, out_row)
    return src2, out2


LEGS = ("dispatch_fwd", "dispatch_bwd", "combine_fwd", "combine_bwd")


def sent_bytes(handle, topology=None) -> dict[str, dict[str, int]]:
    """Bytes this rank sends to other ranks for one dispatch and its combine (forward and
    backward), by where they go: {leg: {"within": to ranks of its node, "between": to other
    nodes}} for the legs in LEGS, and "metadata": the node-aware route's expert ids (4 bytes
    each) and the slot weights and their gradients (4 bytes each). Read from the plan on the
    host: no sync, no collective. A row is wire_row(H) bytes on an MXFP8 leg, H * x's
    element size on a "bf16" one (combine's rows in another dtype: scale those legs by hand);
    what a rank keeps counts nowhere, nor the counts' small fixed-size messages.

    handle: from :func:`mxfp8_a2a.dispatch` (its wires and combine's default ones);
    topology: which ranks share a node, for a flat handle (default: one node)."""
    if not hasattr(handle, "input_splits"):
        raise TypeError(
            "sent_bytes takes the handle of mxfp8_a2a.dispatch; the static dispatch sends "
            "fixed buffers (W * capacity rows each way, per hop on a node-aware route)"
        )
    if handle.topology is not None:  # (a node-aware handle's own)
        topology = handle.topology
    rank = dist.get_rank(handle.group) if dist.is_initialized() else 0
    g = topology.ranks_per_node if topology is not None else len(handle.input_splits)
    me, local = divmod(rank, g)
    size = {"mxfp8": wire_row(handle.hidden), "bf16": handle.hidden * handle.dtype.itemsize}
    wires = dict(zip(LEGS, (*handle.dispatch_wires, *handle.exchange), strict=True))
    out = {leg: {"within": 0, "between": 0} for leg in (*LEGS, "metadata")}

    def add(into, rows, per_row, node_of, mine) -> None:
        for peer, n in enumerate(rows):
            if peer != mine:
                into["within" if node_of(peer) == me else "between"] += n * per_row

    stages = handle.nodes
    for leg in LEGS:
        back = leg in ("dispatch_bwd", "combine_fwd")
        if stages is None:
            rows = handle.output_splits if back else handle.input_splits
            add(out[leg], rows, size[wires[leg]], lambda r: r // g, rank)
        else:
            add(out[leg], stages.rail_splits[back], size[wires[leg]], lambda n: n, me)
            add(out[leg], stages.node_splits[back], size[wires[leg]], lambda i: me, local)
    if stages is not None:
        k = handle.rows_of.shape[1]
        add(out["metadata"], stages.rail_splits[0], 4 * k, lambda n: n, me)  # the ids
        for rows in (handle.input_splits, handle.output_splits):  # weights and gradients
            add(out["metadata"], rows, 4, lambda r: r // g, rank)
    return out
