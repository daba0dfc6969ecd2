"""Expert-parallel MoE on the exchange: dispatch/combine, and a layer built on them."""

from .dispatch import EXCHANGES, DispatchHandle, combine, dispatch
from .layer import ExpertParallelMoE, route

__all__ = ["EXCHANGES", "DispatchHandle", "ExpertParallelMoE", "combine", "dispatch", "route"]
