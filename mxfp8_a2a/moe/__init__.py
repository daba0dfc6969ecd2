"""Expert-parallel MoE on the exchange: dispatch/combine (host-synced, or static-shape and
sync-free), a layer built on them, and its data parallelism and checkpoints."""

from ..exchange.wires import EXCHANGES
from .checkpoint import full_state_dict, load_full_state_dict, prepare_optimizer
from .dispatch_static import (
    STAT_NAMES,
    StaticHandle,
    capacity_for,
    check_no_drops,
    combine_static,
    dispatch_static,
    static_rows,
)
from .dispatch_synced import DispatchHandle, combine, dispatch
from .experts import GroupedExperts
from .layer import ExpertParallelMoE, route
from .parallel import prepare_ddp, shard_experts

__all__ = [
    "EXCHANGES",
    "DispatchHandle",
    "ExpertParallelMoE",
    "GroupedExperts",
    "STAT_NAMES",
    "StaticHandle",
    "capacity_for",
    "check_no_drops",
    "combine",
    "combine_static",
    "dispatch",
    "dispatch_static",
    "full_state_dict",
    "load_full_state_dict",
    "prepare_ddp",
    "prepare_optimizer",
    "route",
    "shard_experts",
    "static_rows",
]
