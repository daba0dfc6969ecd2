"""MXFP8 all-to-all for expert-parallel Mixture-of-Experts.

Layers (one subpackage each):
    formats   -- MXFP8 casts (Triton kernels and plain-torch references), the packed wire
                 layout: quantize, dequantize, quantize_packed, dequantize_packed, pack,
                 unpack, packed_row_bytes, quantize_dequantize, *_reference
    exchange  -- to_mxfp8_a2a_dequant (differentiable MXFP8 all-to-all),
                 compute_output_splits; transports: "nccl" (default), CopyEngineTransport;
                 PushBuffer, static_transport (the static dispatch's one-node transport)
    moe       -- dispatch, combine, ExpertParallelMoE; dispatch_static, combine_static
                 (sync-free, fixed shapes), capacity_for, static_rows, check_no_drops,
                 STAT_NAMES (the names of the static dispatch's stats, in order);
                 prepare_ddp, shard_experts (data parallelism); full_state_dict,
                 load_full_state_dict, prepare_optimizer (checkpoints, moe/checkpoint.py)
    grouped   -- per_group_colwise_scales, per_group_rowwise_scales (FP8 scaling of jagged
                 tensors for grouped GEMMs), grouped_mm (the experts' grouped GEMMs),
                 fp8_rowwise_weights / Fp8Weights (its FP8 weight casts, made once)

After install, ``python -m mxfp8_a2a.selftest`` checks a cast, an exchange and the layer.
"""

import importlib.metadata

from .exchange import (
    WIRE_PRESETS,
    CopyEngineTransport,
    NcclTransport,
    PushBuffer,
    Transport,
    Wires,
    compute_output_splits,
    push_unavailable,
    static_transport,
    to_mxfp8_a2a_dequant,
)
from .formats import (
    dequantize,
    dequantize_packed,
    dequantize_reference,
    pack,
    packed_row_bytes,
    quantize,
    quantize_dequantize,
    quantize_dequantize_reference,
    quantize_packed,
    quantize_reference,
    unpack,
)
from .grouped import (
    PRECISIONS,
    Fp8Weights,
    fp8_rowwise_weights,
    grouped_mm,
    per_group_colwise_scales,
    per_group_rowwise_scales,
)
from .moe import (
    EXCHANGES,
    STAT_NAMES,
    ExpertParallelMoE,
    NodeTopology,
    StaticHandle,
    capacity_for,
    check_no_drops,
    combine,
    combine_static,
    dispatch,
    dispatch_static,
    full_state_dict,
    load_full_state_dict,
    prepare_ddp,
    prepare_optimizer,
    sent_bytes,
    shard_experts,
    static_rows,
)

try:  # the installed distribution's version (a source tree on PYTHONPATH: "unknown")
    __version__ = importlib.metadata.version("mxfp8_a2a")
except importlib.metadata.PackageNotFoundError:
    __version__ = "unknown"

__all__ = [
    "__version__",
    "EXCHANGES",
    "PRECISIONS",
    "STAT_NAMES",
    "CopyEngineTransport",
    "ExpertParallelMoE",
    "Fp8Weights",
    "NodeTopology",
    "StaticHandle",
    "NcclTransport",
    "PushBuffer",
    "Transport",
    "WIRE_PRESETS",
    "Wires",
    "capacity_for",
    "check_no_drops",
    "combine",
    "combine_static",
    "compute_output_splits",
    "dequantize",
    "dequantize_packed",
    "dequantize_reference",
    "dispatch",
    "dispatch_static",
    "fp8_rowwise_weights",
    "full_state_dict",
    "load_full_state_dict",
    "grouped_mm",
    "pack",
    "packed_row_bytes",
    "per_group_colwise_scales",
    "per_group_rowwise_scales",
    "prepare_ddp",
    "prepare_optimizer",
    "quantize",
    "quantize_dequantize",
    "quantize_dequantize_reference",
    "quantize_packed",
    "quantize_reference",
    "sent_bytes",
    "shard_experts",
    "static_rows",
    "static_transport",
    "push_unavailable",
    "to_mxfp8_a2a_dequant",
    "unpack",
]
