"""What the ranks of a group must agree on, per MoE front end: one table of terms each
(exchange/agreement.py's Term: the name errors use, how to read it from the front end's
arguments, the fix, and whether the ranks' values are compared). checks.py and the front
ends check them; test_agreement_table.py varies every compared term on one rank.

Front ends and their tables (agreement.TABLES; a test reads them, test_agreement_table.py):

- ``dispatch`` (DISPATCH): its agreement word rides on the counts all-to-all
  (dispatch_synced.py); only when the words differ or a rank is bad do the rows come.
- ``dispatch_static`` (STATIC): checked once per new configuration (checks.agree_static):
  each configuration the ranks agreed on is kept (per PushBuffer, else per process group,
  at most MAX_KEYS), so a known one runs no collective; ``validate=True`` (or
  MXFP8_A2A_VALIDATE=1, read at import) gathers on every call. A change on one rank after
  the ranks agreed is caught there alone: run with validate to catch it everywhere. Under
  torch.compile it runs with validate only (agreement.agree_compiled, every call); under
  CUDA graph capture not at all.
- ``combine`` / ``combine_static`` (COMBINE): local checks only; their terms must agree but
  are not compared (a comparison would cost a collective; the handle fixes the sizes).
- ``ExpertParallelMoE`` (LAYER): at a layer's first forward on a group of more than one
  rank (checks.first_forward_check), beside the terms: the routers are the same on every
  rank (ranks seeded differently build different ones); the experts differ between the
  ranks (equal on every rank: a data-parallel wrapper broadcast or gathered them; not
  checked after shard_experts, whose shards may be empty, nor where every rank's 2+
  experts are copies of one MLP, as sparse upcycling makes them); no
  DistributedDataParallel manages the experts (private, looked up with getattr; the
  digests are the public fallback) and no FSDP2 shards them unless shard_experts did. The
  routers and experts are compared by digests (float64 sums, no copy of the weights).
- ``NodeTopology`` (NODES): when it is built, before any sub-group is made.
- the torchtitan dispatchers (mxfp8_a2a/torchtitan.py) call dispatch and dispatch_static:
  their tables; their own config fields are checked at construction, on each rank.
- ``to_mxfp8_a2a_dequant``: exchange/checks.py (the layer below).
"""

from __future__ import annotations

import torch

from .. import _config
from ..exchange import agreement
from ..exchange.agreement import SAME, Term
from ..exchange.checks import (
    GRAD_FIX,
    SETTING_FIX,
    TRANSPORT_FIX,
    transport_name,
    transport_setting,
)
from ..exchange.push import PushBuffer
from ..exchange.wires import combine_default, leg_pair

# ---- the tables: what must agree, per front end (read from a dict of its args)


def _wires(a) -> tuple[str, ...]:  # dispatch's (forward, backward), then combine's
    return leg_pair(a["exchange"], "dispatch") + combine_default(a["exchange"])


def _spans(a) -> bool:
    return a["topology"] is not None and a["topology"].spans_nodes


def _transport_kind(transport) -> str:
    if isinstance(transport, PushBuffer):
        return "PushBuffer"
    return transport if isinstance(transport, str) else transport_name(transport)


def _mxfp8(a) -> bool:
    return "mxfp8" in _wires(a)  # (unquantized rows take no transport)


_TOP_K = f"{SAME} top-k (topk_ids.shape[1], the experts of each token)"
_HIDDEN = f"{SAME} x.shape[1] (K, the hidden size)"
_DTYPE = f"pass x in the same dtype on every rank ({SAME} x.dtype)"
_TOPOLOGY = "pass the same NodeTopology (or none) on every rank"
_CAPACITY = f"{SAME} capacity (a layer: the same capacity, or capacity_factor and max_tokens)"
_NUM_EXPERTS = Term("num_experts", lambda a: a["num_experts"], f"{SAME} num_experts")
_K = Term("top_k", lambda a: a["topk_ids"].shape[1], _TOP_K)

# dispatch: dict(x, topk_ids, num_experts, exchange, transport, topology)
DISPATCH = agreement.table(
    "dispatch",
    _NUM_EXPERTS,
    _K,
    Term("x.shape[1]", lambda a: a["x"].shape[1], _HIDDEN),
    Term("x.dtype", lambda a: a["x"].dtype, _DTYPE),
    Term("topology", lambda a: a["topology"].terms() if _spans(a) else None, _TOPOLOGY),
    Term("exchange", lambda a: "/".join(_wires(a)), f"{SAME} exchange"),
    Term(
        "transport", lambda a: transport_name(a["transport"]) if _mxfp8(a) else None, TRANSPORT_FIX
    ),  # fmt: skip
    Term(
        "transport setting",
        lambda a: transport_setting(a["transport"]) if _mxfp8(a) else None,
        SETTING_FIX,
    ),  # fmt: skip
    Term("x.requires_grad", lambda a: torch.is_grad_enabled() and a["x"].requires_grad, GRAD_FIX),
)


def _static_experts(a) -> int | None:
    inline = a["num_experts"] // a["world"] <= _config.DISPATCH_INLINE_COUNTS
    return None if inline and not _spans(a) else a["num_experts"]


# dispatch_static: the same namespace with capacity, world, scaling_mode (transport: "nccl"
# or a PushBuffer); x.dtype where a leg carries rows in it; num_experts past the inline
# counts (their own message size) or on a node route (the counts stay within the node)
STATIC = agreement.table(
    "dispatch_static",
    Term("capacity", lambda a: a["capacity"], _CAPACITY),
    Term("x.shape[1]", lambda a: a["x"].shape[1], _HIDDEN),
    Term("exchange", lambda a: "/".join(_wires(a)), f"{SAME} exchange"),
    Term("x.dtype", lambda a: a["x"].dtype if "bf16" in _wires(a) else None, _DTYPE),
    Term("topology", lambda a: a["topology"].terms() if _spans(a) else None, _TOPOLOGY),
    Term("num_experts", _static_experts, f"{SAME} num_experts"),
    Term("scaling_mode", lambda a: a["scaling_mode"], f"{SAME} scaling_mode"),
    Term("transport", lambda a: _transport_kind(a["transport"]), TRANSPORT_FIX),
    _K,
)

# combine, combine_static: checked on each rank only (see the module docstring)
COMBINE = agreement.table(
    "combine",
    Term("exchange", lambda a: a["exchange"], f"{SAME} exchange to combine", agree=False),
)

# the layer's first forward: dict(layer, x)
LAYER = agreement.table(
    "ExpertParallelMoE",
    Term("hidden", lambda a: a["layer"].router.shape[0], f"{SAME} hidden"),
    Term("ffn", lambda a: a["layer"].experts.w2.shape[-2], f"{SAME} ffn"),
    Term("num_experts", lambda a: a["layer"].num_experts, f"{SAME} num_experts"),
    Term("activation", lambda a: a["layer"].experts.activation, f"{SAME} activation"),
    Term("top_k", lambda a: a["layer"].top_k, f"{SAME} top_k"),
    Term("exchange", lambda a: "/".join(a["layer"].wires), f"{SAME} exchange"),
    Term("precision", lambda a: a["layer"].precision, f"{SAME} precision"),
    Term("capacity", lambda a: a["layer"].capacity, _CAPACITY),
    Term("max_tokens", lambda a: a["layer"].max_tokens, f"{SAME} max_tokens"),
    Term("align", lambda a: a["layer"].align, f"{SAME} align"),
    Term("transport", lambda a: _transport_kind(a["layer"].transport), TRANSPORT_FIX),
    Term(
        "topology",
        lambda a: None if a["layer"].topology is None else a["layer"].topology.terms(),
        _TOPOLOGY,
    ),  # fmt: skip
    Term("overlap_chunks", lambda a: a["layer"].overlap_chunks, f"{SAME} overlap_chunks"),
    Term("shared_ffn", lambda a: _shared(a["layer"]), f"{SAME} shared_ffn"),
    Term("x.dtype", lambda a: a["x"].dtype if isinstance(a["x"], torch.Tensor) else None, _DTYPE),
)


def _shared(layer) -> str:
    from .overlap import shared_term  # (overlap imports checks, which imports this module)

    return str(shared_term(layer))


# NodeTopology: dict(local_world_size (None: not read), ranks_per_node,
# groups_made (None: a group of the whole world, or this torch keeps no count))
NODES = agreement.table(
    "NodeTopology",
    Term(
        "LOCAL_WORLD_SIZE",
        lambda a: a["local_world_size"],
        "start every rank with the same LOCAL_WORLD_SIZE (nodes of one size), or pass "
        "ranks_per_node or a mesh to NodeTopology",
    ),  # fmt: skip
    Term(
        "ranks_per_node",
        lambda a: a["ranks_per_node"],
        f"{SAME} ranks_per_node (or mesh) to NodeTopology",
    ),  # fmt: skip
    Term(
        "process groups made before",
        lambda a: a["groups_made"],
        "make the same process groups, in the same order, on every rank of the group before "
        "its NodeTopology (new_group names a sub-group by this count)",
    ),  # fmt: skip
)
