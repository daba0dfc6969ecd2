"""Expert-parallel MoE dispatch and combine on the MXFP8 exchange.

Experts are spread evenly over the ranks of ``group``: rank r holds experts
[r * L, (r + 1) * L), L = num_experts // world. ``dispatch`` sends each (token, top-k slot)
row to the rank of its expert and returns them grouped by local expert; ``combine`` sends
the expert outputs back and sums them with the router weights in the original token order.
Autograd flows through both (the exchanges' backward is the reverse exchange).

Collectives and host syncs: ``dispatch`` makes one small all-to-all of per-expert counts
(with an error flag per rank, so that bad ``topk_ids`` on one rank raise on every rank)
and one host sync to read the splits that all_to_all_single needs, then the exchange.
``combine`` has no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..exchange.api import to_mxfp8_a2a_dequant
from ..exchange.checks import comm_device, group_rank_and_size
from ..exchange.transport import Transport, resolve

EXCHANGES = ("mxfp8", "bf16")


def exchange_rows(
    x: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None,
    exchange: str,
    transport: str | Transport = "nccl",
) -> torch.Tensor:
    """Differentiable all-to-all of x's rows: "mxfp8" (:func:`to_mxfp8_a2a_dequant` over
    ``transport``) or "bf16" (a plain all_to_all_single of x in its own dtype)."""
    if exchange == "mxfp8":
        return to_mxfp8_a2a_dequant(x, output_splits, input_splits, group, transport=transport)
    if exchange == "bf16":
        out = funcol.all_to_all_single_autograd(
            x, output_splits, input_splits, group or dist.group.WORLD
        )
        return funcol.wait_tensor(out)
    raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")


@dataclass
class DispatchHandle:
    """What combine needs to undo a dispatch. Tensors are on x's device.

    order: int64 [T * k] (token, slot) pairs sorted by expert (stable); inverse_order: its
    inverse. regroup: int64 [N] received rows reordered from (source rank, expert) to
    (expert, source rank); inverse_regroup: its inverse. input_splits / output_splits: rows
    sent to / received from each rank. expert_offsets: int32 [L], end offset of each local
    expert's rows in dispatch's output (what grouped GEMMs take). top_k, num_tokens, hidden:
    for the final sum. exchange, transport: how the rows move.
    """

    order: torch.Tensor
    inverse_order: torch.Tensor
    regroup: torch.Tensor
    inverse_regroup: torch.Tensor
    input_splits: list[int]
    output_splits: list[int]
    expert_offsets: torch.Tensor
    top_k: int
    num_tokens: int
    hidden: int
    group: dist.ProcessGroup | None
    exchange: str
    transport: str | Transport = "nccl"


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def _local_error(x, topk_ids, num_experts, world, exchange) -> str | None:
    """What is wrong with this rank's arguments (shapes and types only, no data read)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        return f"x must be a 2-D [tokens, hidden] tensor, got {getattr(x, 'shape', type(x))}"
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        return f"topk_ids must be a 2-D [tokens, k] tensor, got {getattr(topk_ids, 'shape', '?')}"
    if topk_ids.shape[0] != x.shape[0]:
        return f"topk_ids must be [tokens, k] with tokens = {x.shape[0]}, got {topk_ids.shape}"
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        return f"topk_ids must be an integer tensor, got {topk_ids.dtype}"
    if topk_ids.device != x.device:
        return f"topk_ids ({topk_ids.device}) must be on x's device ({x.device})"
    if type(num_experts) is not int or num_experts < 1 or num_experts % world:
        return f"num_experts ({num_experts!r}) must be a positive multiple of the group size"
    if exchange == "mxfp8" and x.shape[1] % 32:
        return f"x.shape[1] (hidden={x.shape[1]}) must be a multiple of 32 for exchange='mxfp8'"
    return None


def dispatch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
    *,
    exchange: str = "mxfp8",
    transport: str | Transport = "nccl",
) -> tuple[torch.Tensor, list[int], DispatchHandle]:
    """Send each token to the ranks of its top-k experts.

    Args:
        x: [T, H] bf16 or fp32 tokens (H % 32 == 0 for "mxfp8"); T may be 0.
        topk_ids: [T, k] integer expert ids in [0, num_experts); k may be 0.
        num_experts: total experts, a multiple of the group size.
        exchange: "mxfp8" or "bf16" (plain all-to-all in x's dtype).
        transport: of the MXFP8 exchanges, "nccl" (default) or a Transport object (see
            :func:`mxfp8_a2a.to_mxfp8_a2a_dequant`).
    Returns:
        expert_x: [N, H] rows received, grouped by local expert (expert 0 first), within an
            expert by source rank; tokens_per_expert: list of L ints, rows per local expert
            (read in the same host sync as the splits); handle for :func:`combine`
            (handle.expert_offsets holds the same counts as int32 end offsets on x's device).
    Bad arguments on any rank (shapes, ids out of range) raise a ValueError on every rank.
    """
    rank, world = group_rank_and_size(group)
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    chosen = resolve(transport)
    error = _local_error(x, topk_ids, num_experts, world, exchange)
    if error is None and exchange == "mxfp8":
        try:
            chosen.check(x.device, group)
        except ValueError as e:
            error = str(e)
    # every rank sends world x (local + 1) counts, also a rank whose arguments are bad
    local = max(num_experts // world, 1) if type(num_experts) is int else 1
    dev = comm_device(group)
    if error is None:
        t, k = topk_ids.shape
        flat = topk_ids.reshape(-1).to(torch.int64)
        bad = ((flat < 0) | (flat >= num_experts)).any().reshape(1)
        counts = torch.bincount(flat.clamp(0, num_experts - 1), minlength=num_experts)
        flag = bad.to(torch.int64).expand(world, 1)
        sent = torch.cat([counts.view(world, local), flag], 1).to(dev)
    else:
        sent = torch.zeros(world, local + 1, dtype=torch.int64, device=dev)
        sent[:, local] = 2
    recv = torch.empty_like(sent)
    dist.all_to_all_single(recv, sent, group=group)  # [src, local expert | flag]
    flags_and_sizes = torch.cat(
        [recv[:, local], sent[:, :local].sum(1), recv[:, :local].sum(1), recv[:, :local].sum(0)]
    )
    sizes = flags_and_sizes.tolist()  # the host sync: all_to_all_single needs the splits
    flags = sizes[:world]
    if error is not None:
        raise ValueError(f"dispatch on rank {rank}: {error}")
    if any(flags):
        bad_ranks = [r for r in range(world) if flags[r]]
        what = "topk_ids out of [0, num_experts)" if flags[rank] == 1 else "bad arguments"
        raise ValueError(
            f"dispatch: bad arguments on rank(s) {bad_ranks} of the group"
            + (f" (here: {what})" if flags[rank] else "")
        )
    input_splits, output_splits = sizes[world : 2 * world], sizes[2 * world : 3 * world]
    per_expert = sizes[3 * world :]
    recv_counts = recv[:, :local].reshape(-1).to(x.device)
    order = torch.sort(flat, stable=True).indices
    # received rows come as (source, expert) segments; regroup to (expert, source)
    seg = torch.repeat_interleave(torch.arange(world * local, device=x.device), recv_counts)
    regroup = torch.sort((seg % local) * world + seg // local, stable=True).indices
    rows = exchange_rows(
        x[order // max(k, 1)], output_splits, input_splits, group, exchange, chosen
    )
    offsets = recv[:, :local].sum(0).cumsum(0).to(device=x.device, dtype=torch.int32)
    handle = DispatchHandle(
        order, _inverse(order), regroup, _inverse(regroup), input_splits, output_splits,
        offsets, k, t, x.shape[1], group, exchange, chosen,
    )  # fmt: skip
    return rows[regroup], per_expert, handle


def combine(
    expert_y: torch.Tensor,
    topk_weights: torch.Tensor,
    handle: DispatchHandle,
    *,
    exchange: str | None = None,
) -> torch.Tensor:
    """Send expert outputs back and sum them with the router weights.

    Args:
        expert_y: [N, H] outputs in the order :func:`dispatch` returned the rows.
        topk_weights: [T, k] router weights of each token's experts.
        handle: from the matching dispatch.
        exchange: "mxfp8" or "bf16"; default: the dispatch's.
    Returns:
        [T, H] in expert_y's dtype: out[t] = sum_j topk_weights[t, j] * y(t, expert j).
    """
    if topk_weights.shape != (handle.num_tokens, handle.top_k):
        raise ValueError(
            f"topk_weights must have shape {(handle.num_tokens, handle.top_k)}, "
            f"got {tuple(topk_weights.shape)}"
        )
    if expert_y.dim() != 2 or expert_y.shape[0] != handle.regroup.numel():
        raise ValueError(
            f"expert_y must be [{handle.regroup.numel()}, H] (one row per row dispatch "
            f"returned), got {tuple(expert_y.shape)}"
        )
    y = expert_y[handle.inverse_regroup]
    back = exchange_rows(
        y, handle.input_splits, handle.output_splits, handle.group,
        exchange or handle.exchange, handle.transport,
    )  # fmt: skip
    slots = back[handle.inverse_order].view(handle.num_tokens, handle.top_k, expert_y.shape[1])
    return (slots * topk_weights.unsqueeze(-1).to(slots.dtype)).sum(1)
