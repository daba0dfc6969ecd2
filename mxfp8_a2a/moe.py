"""Expert-parallel MoE dispatch and combine on the MXFP8 exchange.

Experts are spread evenly over the ranks of ``group``: rank r holds experts
[r * L, (r + 1) * L), L = num_experts // world. ``dispatch`` sends each (token, top-k slot)
row to the rank of its expert and returns them grouped by local expert; ``combine`` sends
the expert outputs back and sums them with the router weights in the original token order.
Autograd flows through both (the exchanges' backward is the reverse exchange).

Host syncs: one, in ``dispatch``, to read the row counts that all_to_all_single needs
(after one small all-to-all of per-expert counts). ``combine`` has none.

``transport`` ("nccl" or "copy_engine") picks how the MXFP8 exchanges move their rows (see
:func:`mxfp8_a2a.to_mxfp8_a2a_dequant`); the bf16 exchange always uses NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ._copy_exchange import auto_ranges
from ._exchange import auto_chunks
from .a2a import _comm_device, check_transport, to_mxfp8_a2a_dequant

EXCHANGES = ("mxfp8", "bf16")


def exchange_rows(
    x: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None,
    exchange: str,
    chunks: int = 1,
    transport: str = "nccl",
) -> torch.Tensor:
    """Differentiable all-to-all of x's rows: "mxfp8" (to_mxfp8_a2a_dequant with ``chunks``
    and ``transport``, the same on every rank) or "bf16" (a plain all_to_all_single of x as
    it is, in its own dtype)."""
    if exchange == "mxfp8":
        return to_mxfp8_a2a_dequant(
            x, output_splits, input_splits, group, chunks=chunks, transport=transport
        )
    if exchange == "bf16":
        out = funcol.all_to_all_single_autograd(
            x, output_splits, input_splits, group or dist.group.WORLD
        )
        return funcol.wait_tensor(out)
    raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")


@dataclass
class DispatchHandle:
    """What combine needs to undo a dispatch. Tensors are int64 on x's device.

    order: [T * k] (token, slot) pairs sorted by expert (stable); inverse_order: its inverse.
    regroup: [N] received rows reordered from (source rank, expert) to (expert, source
    rank); inverse_regroup: its inverse. input_splits / output_splits: rows sent to / received
    from each rank. top_k, num_tokens: for the final sum. chunks: column pieces (NCCL) or
    row ranges (copy engines) of the MXFP8 exchanges, from the busiest rank's rows (the same
    on every rank); transport: theirs.
    """

    order: torch.Tensor
    inverse_order: torch.Tensor
    regroup: torch.Tensor
    inverse_regroup: torch.Tensor
    input_splits: list[int]
    output_splits: list[int]
    top_k: int
    num_tokens: int
    group: dist.ProcessGroup | None
    chunks: int
    transport: str = "nccl"


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def dispatch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
    *,
    exchange: str = "mxfp8",
    transport: str = "nccl",
) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
    """Send each token to the ranks of its top-k experts.

    Args:
        x: [T, H] bf16 or fp32 tokens (H % 32 == 0 for "mxfp8").
        topk_ids: [T, k] integer expert ids in [0, num_experts).
        num_experts: total experts, a multiple of the group size.
        exchange: "mxfp8" or "bf16" (plain all-to-all in x's dtype).
        transport: of the MXFP8 exchanges, "nccl" (default) or "copy_engine" (two ranks on
            CUDA GPUs with peer access; see :func:`mxfp8_a2a.to_mxfp8_a2a_dequant`).
    Returns:
        expert_x: [N, H] rows received, grouped by local expert (expert 0 first), within an
            expert by source rank; tokens_per_expert: list of L ints, rows per local expert
            (on the host, read in the same sync as the splits); handle for :func:`combine`.
    """
    world = dist.get_world_size(group)
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    check_transport(transport, x.device, world)  # before the first collective, on every rank
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_ids must be [tokens, k] with tokens = {x.shape[0]}, got {tuple(topk_ids.shape)}"
        )
    if topk_ids.dtype.is_floating_point:
        raise TypeError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if num_experts % world != 0:
        raise ValueError(
            f"num_experts ({num_experts}) must be a multiple of the group size ({world})"
        )
    local = num_experts // world
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1).to(torch.int64)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts)
    if counts.numel() != num_experts:
        raise ValueError(f"topk_ids holds expert ids >= num_experts ({num_experts})")
    dev = _comm_device(group)
    sent = counts.to(dev)
    recv_counts = torch.empty_like(sent)
    dist.all_to_all_single(recv_counts, sent, group=group)  # [src, local expert]
    per_rank = recv_counts.view(world, local)
    # the most rows any rank sends or receives: the same piece count on every rank
    peak = torch.maximum(sent.sum(), recv_counts.sum()).reshape(1)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    sizes = torch.cat([sent.view(world, local).sum(1), per_rank.sum(1), per_rank.sum(0), peak])
    sizes = sizes.tolist()  # the host sync: all_to_all_single needs the splits on the host
    input_splits, output_splits = sizes[:world], sizes[world : 2 * world]
    pieces = auto_ranges if transport == "copy_engine" else auto_chunks
    chunks = pieces(sizes[-1], x.shape[1])
    recv_counts = recv_counts.to(x.device)
    # received rows come as (source, expert) segments; regroup to (expert, source)
    seg = torch.repeat_interleave(torch.arange(world * local, device=x.device), recv_counts)
    key = (seg % local) * world + seg // local
    regroup = torch.sort(key, stable=True).indices
    rows = exchange_rows(
        x[order // k], output_splits, input_splits, group, exchange, chunks, transport
    )
    inverses = _inverse(order), _inverse(regroup)
    handle = DispatchHandle(
        order, inverses[0], regroup, inverses[1], input_splits, output_splits, k, t, group,
        chunks, transport,
    )  # fmt: skip
    return rows[regroup], sizes[2 * world : 2 * world + local], handle


def combine(
    expert_y: torch.Tensor,
    topk_weights: torch.Tensor,
    handle: DispatchHandle,
    *,
    exchange: str = "mxfp8",
) -> torch.Tensor:
    """Send expert outputs back and sum them with the router weights.

    Args:
        expert_y: [N, H] outputs in the order :func:`dispatch` returned the rows.
        topk_weights: [T, k] router weights of each token's experts.
        handle: from the matching dispatch.
        exchange: "mxfp8" or "bf16".
    Returns:
        [T, H] in expert_y's dtype: out[t] = sum_j topk_weights[t, j] * y(t, expert j).
    """
    if topk_weights.shape != (handle.num_tokens, handle.top_k):
        raise ValueError(
            f"topk_weights must have shape {(handle.num_tokens, handle.top_k)}, "
            f"got {tuple(topk_weights.shape)}"
        )
    y = expert_y[handle.inverse_regroup]
    back = exchange_rows(
        y, handle.input_splits, handle.output_splits, handle.group, exchange, handle.chunks,
        handle.transport,
    )  # fmt: skip
    slots = back[handle.inverse_order].view(handle.num_tokens, handle.top_k, -1)
    return (slots * topk_weights.unsqueeze(-1).to(slots.dtype)).sum(1)


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing: logits [T, E] -> (weights fp32 [T, k] summing to 1, ids [T, k])."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def expert_mlp(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, counts: list[int]
) -> torch.Tensor:
    """Row groups of x [N, H] (sizes ``counts``) through experts w1 [L, H, F], w2 [L, F, H]."""
    outs = [
        torch.nn.functional.gelu(xe @ w1[e]) @ w2[e] for e, xe in enumerate(torch.split(x, counts))
    ]
    return torch.cat(outs) if outs else x.new_empty((0, w2.shape[-1]))


class ExpertParallelMoE(torch.nn.Module):
    """A MoE layer with experts spread over the ranks of ``group``.

    router: replicated Linear(hidden, num_experts); experts: this rank's L = num_experts /
    world experts, gelu MLPs hidden -> ffn -> hidden, weights w1 [L, hidden, ffn] and
    w2 [L, ffn, hidden]. Forward: x [T, hidden] -> [T, hidden]. ``exchange`` picks "mxfp8"
    or "bf16" for dispatch and combine, ``transport`` how the MXFP8 exchanges move rows
    ("nccl" or "copy_engine", see :func:`dispatch`). Parameters are drawn from ``seed`` for
    all experts and sliced, so every world size builds the same model.
    """

    def __init__(
        self,
        hidden: int,
        ffn: int,
        num_experts: int,
        top_k: int,
        group: dist.ProcessGroup | None = None,
        *,
        exchange: str = "mxfp8",
        transport: str = "nccl",
        seed: int = 0,
    ):
        super().__init__()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if num_experts % world:
            raise ValueError(
                f"num_experts ({num_experts}) must be a multiple of the group size ({world})"
            )
        self.num_experts, self.top_k, self.group, self.exchange = (
            num_experts,
            top_k,
            group,
            exchange,
        )
        full = init_moe_weights(hidden, ffn, num_experts, seed)
        local = slice(rank * num_experts // world, (rank + 1) * num_experts // world)
        self.transport = transport
        self.router = torch.nn.Parameter(full["router"])
        self.w1 = torch.nn.Parameter(full["w1"][local].clone())
        self.w2 = torch.nn.Parameter(full["w2"][local].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(x @ self.router, self.top_k)
        ex, counts, handle = dispatch(
            x, ids, self.num_experts, self.group, exchange=self.exchange, transport=self.transport
        )
        ey = expert_mlp(ex, self.w1.to(ex.dtype), self.w2.to(ex.dtype), counts)
        return combine(ey, weights, handle, exchange=self.exchange)


def init_moe_weights(hidden: int, ffn: int, num_experts: int, seed: int) -> dict[str, torch.Tensor]:
    """All experts' weights, fp32 on CPU: router [H, E], w1 [E, H, F], w2 [E, F, H]."""
    g = torch.Generator().manual_seed(seed)
    return {
        "router": torch.randn(hidden, num_experts, generator=g) * hidden**-0.5,
        "w1": torch.randn(num_experts, hidden, ffn, generator=g) * hidden**-0.5,
        "w2": torch.randn(num_experts, ffn, hidden, generator=g) * ffn**-0.5,
    }


def moe_reference(x: torch.Tensor, weights: dict[str, torch.Tensor], top_k: int) -> torch.Tensor:
    """Single-process MoE (all experts local), the layer's definition: x [T, H] -> [T, H]."""
    w, ids = route(x @ weights["router"], top_k)
    out = torch.zeros_like(x)
    for j in range(top_k):
        for e in ids[:, j].unique().tolist():
            rows = (ids[:, j] == e).nonzero().squeeze(1)
            y = torch.nn.functional.gelu(x[rows] @ weights["w1"][e]) @ weights["w2"][e]
            out = out.index_add(0, rows, y * w[rows, j : j + 1].to(y.dtype))
    return out
