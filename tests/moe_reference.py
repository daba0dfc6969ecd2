"""The single-process definition of ExpertParallelMoE (every expert local)."""

import torch

from mxfp8_a2a.grouped import grouped_mm_reference
from mxfp8_a2a.moe.routing import route


def moe_reference(
    x: torch.Tensor, weights: dict[str, torch.Tensor], top_k: int, precision: str = "bf16"
) -> torch.Tensor:
    """Single-process MoE (all experts local), the layer's definition: x [T, H] -> [T, H].

    "bf16": each (slot, expert) pair's rows through x @ w1[e], gelu, @ w2[e] in x's dtype.
    "fp8_rowwise": the experts through grouped_mm_reference, every expert's rows together in
    (token, slot) order, the order and grouping the expert-parallel layer gives them."""
    w, ids = route(x @ weights["router"], top_k)
    if precision != "bf16":
        flat = ids.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        counts = torch.bincount(flat, minlength=weights["w1"].shape[0])
        offs = counts.cumsum(0).to(torch.int32)
        h = grouped_mm_reference(x[order // top_k], weights["w1"], offs, precision=precision)
        y = grouped_mm_reference(
            torch.nn.functional.gelu(h), weights["w2"], offs, precision=precision
        )
        y = y * w.reshape(-1)[order, None].to(y.dtype)
        return torch.zeros_like(x).index_add(0, order // top_k, y)
    out = torch.zeros_like(x)
    for j in range(top_k):
        for e in ids[:, j].unique().tolist():
            rows = (ids[:, j] == e).nonzero().squeeze(1)
            y = torch.nn.functional.gelu(x[rows] @ weights["w1"][e]) @ weights["w2"][e]
            out = out.index_add(0, rows, y * w[rows, j : j + 1].to(y.dtype))
    return out
