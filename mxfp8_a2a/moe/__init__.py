"""Expert-parallel MoE on the exchange: dispatch/combine (host-synced, or static-shape and
sync-free), a layer built on them, and its data parallelism and checkpoints.

Files, from the user's call down:

- front ends: dispatch_synced.py (``dispatch``/``combine``: counts read on the host, exact
  shapes), dispatch_static.py (``dispatch_static``/``combine_static``: fixed capacity, no
  sync); terms.py (what each front end's ranks must agree on: one table each) and
  checks.py (every argument check and cross-rank agreement of the front ends);
- plan.py (+ plan_kernels.py): where every (token, slot) row goes, in the fixed-slot or the
  packed layout; node_plan.py: the node-aware route's two hops (and sent_bytes), over the
  sub-groups of topology.py's NodeTopology;
- engine.py: the autograd Functions that move the rows, one for both front ends, and how a
  buffer travels (all_to_all_single, a PushBuffer, an MXFP8 Transport);
- rows.py (+ row_kernels.py, row_kernels_backward.py): the row operations and their
  plain-torch references; push.py: the PushBuffer's ops;
- layer.py (ExpertParallelMoE), experts.py (grouped experts), parallel.py
  (DDP/FSDP2), checkpoint.py (state_dict as DTensors, full_state_dict).
"""

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
from .layer import ExpertParallelMoE
from .node_plan import sent_bytes
from .parallel import prepare_ddp, shard_experts
from .routing import route
from .topology import NodeTopology

__all__ = [
    "EXCHANGES",
    "DispatchHandle",
    "ExpertParallelMoE",
    "GroupedExperts",
    "NodeTopology",
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
    "sent_bytes",
    "shard_experts",
    "static_rows",
]
