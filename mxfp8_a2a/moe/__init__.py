"""Expert-parallel MoE on the exchange: dispatch/combine (host-synced, or static-shape and
sync-free), and a layer built on them."""

from .dispatch import EXCHANGES, DispatchHandle, combine, dispatch
from .layer import ExpertParallelMoE, route
from .static_dispatch import (
    StaticHandle,
    capacity_for,
    check_no_drops,
    combine_static,
    dispatch_static,
    static_rows,
)

__all__ = [
    "EXCHANGES",
    "DispatchHandle",
    "ExpertParallelMoE",
    "StaticHandle",
    "capacity_for",
    "check_no_drops",
    "combine",
    "combine_static",
    "dispatch",
    "dispatch_static",
    "route",
    "static_rows",
]
