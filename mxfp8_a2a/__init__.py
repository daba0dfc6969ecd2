"""MXFP8 all-to-all for expert-parallel Mixture-of-Experts.

Public API:
    to_mxfp8_a2a_dequant             -- differentiable all-to-all that sends rows as MXFP8
    compute_output_splits            -- output_splits from input_splits (one small exchange)
    auto_chunks, agreed_chunks       -- the exchange's automatic column-piece count
    dispatch, combine, ExpertParallelMoE -- expert-parallel MoE on the exchange
    per_group_colwise_scales, per_group_rowwise_scales -- FP8 scaling of jagged tensors
    quantize, dequantize             -- MXFP8 casts (e4m3 + one e8m0 scale per 32 values)
    quantize_packed, dequantize_packed, pack, unpack, packed_row_bytes -- the wire layout
    quantize_dequantize              -- the MXFP8 round trip in one pass
    quantize_reference, dequantize_reference, quantize_dequantize_reference -- plain-torch
                                       definitions of the casts
"""

from ._exchange import auto_chunks
from .a2a import agreed_chunks, compute_output_splits, to_mxfp8_a2a_dequant
from .dequantize import dequantize, dequantize_packed, dequantize_reference
from .moe import ExpertParallelMoE, combine, dispatch
from .packing import pack, packed_row_bytes, unpack
from .per_group_scales import per_group_colwise_scales, per_group_rowwise_scales
from .quantize import quantize, quantize_packed, quantize_reference
from .roundtrip import quantize_dequantize, quantize_dequantize_reference

__all__ = [
    "ExpertParallelMoE",
    "agreed_chunks",
    "auto_chunks",
    "combine",
    "dispatch",
    "compute_output_splits",
    "to_mxfp8_a2a_dequant",
    "dequantize",
    "dequantize_packed",
    "dequantize_reference",
    "pack",
    "per_group_colwise_scales",
    "per_group_rowwise_scales",
    "packed_row_bytes",
    "quantize",
    "quantize_dequantize",
    "quantize_dequantize_reference",
    "quantize_packed",
    "quantize_reference",
    "unpack",
]
