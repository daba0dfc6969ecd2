"""The router's pieces: softmax top-k routing, an optional per-expert selection bias
(DeepSeek-V3's balancing without an auxiliary loss) and the Switch/GShard balancing loss."""

from __future__ import annotations

import torch
import torch.distributed as dist


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing: logits [T, E] -> (weights fp32 [T, k] summing to 1, ids [T, k])."""
    weights, ids, _ = _route(logits, top_k)
    return weights, ids


def _route(logits: torch.Tensor, top_k: int, bias=None, groups=None):
    """(weights, ids, probs). ``bias`` fp32 [E] shifts which experts are chosen, not the
    weights (those are the chosen experts' probabilities, renormalized). ``groups`` (G, M):
    the experts form G contiguous groups (the nodes, when experts are spread over the ranks
    in order) and each token chooses within its M best groups, a group scored by the sum of
    its top max(1, k // M) scores (DeepSeek-V3's node-limited routing)."""
    probs = torch.softmax(logits.float(), dim=-1)
    scores = probs if bias is None else probs + bias
    if groups is not None:
        (g, m), (t, e) = groups, scores.shape
        grouped = scores.view(t, g, e // g)
        best = grouped.topk(min(max(1, top_k // m), e // g), dim=-1).values.sum(-1)
        dropped = torch.ones(t, g, dtype=torch.bool, device=scores.device)
        dropped.scatter_(1, best.topk(m, dim=-1).indices, False)
        scores = grouped.masked_fill(dropped[..., None], float("-inf")).view(t, e)
    ids = torch.topk(scores, top_k, dim=-1).indices
    weights = probs.gather(-1, ids)
    return weights / weights.sum(-1, keepdim=True), ids, probs


def groups_error(groups, num_experts: int, top_k: int) -> str | None:
    """What is wrong with a layer's ``route_groups`` (None or (G, M))."""
    if groups is None:
        return None
    ok = isinstance(groups, tuple) and len(groups) == 2 and all(type(v) is int for v in groups)
    if not ok or not (groups[0] >= 1 and num_experts % groups[0] == 0):
        return (f"route_groups must be (groups, limit) with groups dividing num_experts="
                f"{num_experts}, got {groups!r}")  # fmt: skip
    g, m = groups
    if not 1 <= m <= g or top_k > m * (num_experts // g):
        return (f"route_groups={groups!r}: the limit must be in [1, {g}] and its groups must "
                f"hold top_k={top_k} experts ({num_experts // g} per group)")  # fmt: skip
    return None


def balance_loss(probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Switch-Transformer / GShard load balancing: E * sum_e f_e * P_e, where f_e is the
    share of the routed (token, slot) rows that chose expert e and P_e the mean router
    probability of e; 1 when routing is balanced. probs fp32 [T, E], ids [T, k] -> fp32
    scalar, differentiable in probs (f is a count). No tokens: 0."""
    flat = ids.reshape(-1)
    share = torch.zeros_like(probs[0]).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=probs.dtype)
    )
    share = share / max(flat.numel(), 1)
    mean = probs.sum(0) / max(probs.shape[0], 1)
    return probs.shape[1] * (share * mean).sum()


@torch.no_grad()
def update_bias(bias: torch.Tensor, load: torch.Tensor, rate: float, group) -> None:
    """One step of bias balancing, in place, no host sync: ``load`` fp32 [E] (rows routed to
    each expert since the last step, this rank's) summed over ``group``, then each expert's
    bias moves by ``rate`` toward balance (down if above the mean load, up if below), and
    ``load`` is zeroed."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(load, group=group)
    bias.add_(rate * torch.sign(load.mean() - load))
    load.zero_()
