"""Grouped FP8 for MoE experts: per-group scaling of jagged token tensors."""

from .per_group_scales import per_group_colwise_scales, per_group_rowwise_scales
from .reference import per_group_colwise_reference, per_group_rowwise_reference

__all__ = [
    "per_group_colwise_reference",
    "per_group_colwise_scales",
    "per_group_rowwise_reference",
    "per_group_rowwise_scales",
]
