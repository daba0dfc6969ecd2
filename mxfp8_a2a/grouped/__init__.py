"""Grouped FP8 for MoE experts: per-group scaling of jagged token tensors, and the experts'
grouped GEMMs (grouped_mm)."""

from .fp8_rowwise import Fp8Weights, fp8_rowwise_weights
from .gemm import PRECISIONS, grouped_mm
from .grouped_mm_reference import grouped_mm_reference
from .per_group_scales import per_group_colwise_scales, per_group_rowwise_scales
from .reference import per_group_colwise_reference, per_group_rowwise_reference

__all__ = [
    "PRECISIONS",
    "Fp8Weights",
    "fp8_rowwise_weights",
    "grouped_mm",
    "grouped_mm_reference",
    "per_group_colwise_reference",
    "per_group_colwise_scales",
    "per_group_rowwise_reference",
    "per_group_rowwise_scales",
]
