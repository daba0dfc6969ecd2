"""The single-process definition of ExpertParallelMoE (every expert local)."""

import torch

from mxfp8_a2a.moe.layer import route


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
