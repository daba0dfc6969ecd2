"""ExpertParallelMoE's checks: of its arguments at construction (everything the host knows),
and, at a layer's first forward on a group of more than one rank, of what only the ranks
together can see, in one small all_gather (exchange/agreement.py's rows):

- the configuration (sizes, exchange, capacity, transport kind, precision, x's dtype) is the
  same on every rank;
- the routers are the same on every rank (ranks seeded differently build different ones);
- the experts differ between the ranks (each rank holds its own): experts equal on every
  rank mean a data-parallel wrapper broadcast or gathered them (DistributedDataParallel
  without prepare_ddp, or fully_shard of the whole model without shard_experts; not
  checked after shard_experts, whose shards may be empty, nor where every rank's 2+ experts
  are copies of one MLP, as sparse upcycling makes them: a broadcast cannot be told apart);
- no DistributedDataParallel manages the experts (where torch exposes the DDP module
  running the forward; private, looked up with getattr: the digests above are the public
  fallback) and no FSDP2 shards them unless :func:`shard_experts` did.

A rank's own error (a bad x, a finding above) travels in its row, so every rank raises the
same error. The routers and experts are compared by digests (float64 sums, no copy of the
weights) computed on their device: one read of the weights, once per layer per process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..exchange import agreement
from ..exchange.push import PushBuffer
from ..exchange.wires import layer_wires
from ..grouped.gemm import PRECISIONS
from .agree import capturing
from .dispatch_static import capacity_for
from .topology import NodeTopology, same_group, shared_topology

WHAT = "ExpertParallelMoE"
_DDP_FIX = (
    "call mx.prepare_ddp(model) BEFORE DistributedDataParallel(model) (on the unwrapped "
    "model), or for FSDP2 mx.shard_experts(model, mesh['dp']) before fully_shard(model)"
)


def mesh_group(group, name: str = "group", dim: str = "ep") -> dist.ProcessGroup | None:
    """The ProcessGroup of argument ``name``: a ProcessGroup, None, or a 1-D DeviceMesh (the
    mesh's ``dim`` dimension, e.g. mesh['ep'] for a layer's group, mesh['dp'] for replicas)."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"{name}: a DeviceMesh must be 1-D (e.g. mesh[{dim!r}]), got {group.ndim}-D"
            )
        return group.get_group()
    return group


def check_construction(
    hidden, ffn, num_experts, top_k, world, exchange, precision, capacity_factor, capacity,
    max_tokens, align,
) -> int | None:  # fmt: skip
    """Raise a ValueError naming the argument and the fix for anything wrong the host can
    see; returns the static dispatch's capacity (None: the host-synced dispatch)."""
    for name, value in (("hidden", hidden), ("ffn", ffn), ("num_experts", num_experts)):
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if layer_wires(exchange).uses_mxfp8 and hidden % 32:  # (a ValueError naming the presets)
        raise ValueError(
            f"hidden={hidden}: exchange={exchange!r} sends MXFP8 blocks of 32 values (one "
            "scale each); pass a hidden that is a multiple of 32, or exchange='bf16'"
        )
    if type(top_k) is not int or not 0 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [0, num_experts={num_experts}], got {top_k!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision != "bf16" and (hidden % 16 or ffn % 16):
        raise ValueError(
            f"precision={precision!r} needs hidden and ffn multiples of 16, got {hidden} and "
            f"{ffn}; pick such sizes or precision='bf16'"
        )
    if num_experts % world:
        raise ValueError(
            f"num_experts ({num_experts}) must be a multiple of the group size ({world})"
        )
    if type(align) is not int or align < 1:
        raise ValueError(f"align must be an int >= 1, got {align!r}")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 0):
        raise ValueError(
            f"max_tokens must be an int >= 0 (the most tokens any rank passes in one call), "
            f"got {max_tokens!r}"
        )
    if capacity_factor is not None and capacity is not None:
        raise ValueError("pass capacity_factor or capacity, not both")
    if capacity is not None and (type(capacity) is not int or capacity < 0):
        raise ValueError(f"capacity must be an int >= 0 (rows per rank pair), got {capacity!r}")
    if capacity_factor is not None:
        if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, int | float):
            raise ValueError(f"capacity_factor must be a number > 0, got {capacity_factor!r}")
        capacity_for(1, 1, 1, capacity_factor)  # its check of the factor
        if max_tokens is None:
            raise ValueError(
                "capacity_factor needs max_tokens (the most tokens any rank passes in one "
                "call), so that every rank derives the same capacity: pass max_tokens=..., or "
                "an explicit capacity= (rows per rank pair)"
            )
        capacity = capacity_for(max_tokens, top_k, world, capacity_factor)
    if max_tokens is not None and capacity is None:
        raise ValueError("max_tokens is for the static dispatch: pass capacity_factor or capacity")
    return capacity


def layer_topology(topology, group, push: bool) -> NodeTopology | None:
    """The layer's ``topology`` argument, resolved at construction (see ExpertParallelMoE)."""
    if isinstance(topology, str) and topology == "auto":
        return None if push else shared_topology(group)
    if topology is None:
        return None
    if not isinstance(topology, NodeTopology):
        raise ValueError(f"topology must be a NodeTopology, 'auto' or None, got {topology!r}")
    if not same_group(topology.group, group):
        raise ValueError("topology must be built on the layer's group: NodeTopology(group, ...)")
    if push and topology.spans_nodes:
        raise ValueError("a PushBuffer moves rows within one node: pass topology=None")
    return topology


def first_forward_due(layer) -> bool:
    """Whether this forward runs the first-forward check: not yet passed, eager (not under
    torch.compile, nor CUDA graph capture), a group of more than one rank."""
    if layer._checked or torch.compiler.is_compiling() or capturing():
        return False
    if dist.get_world_size(layer.group) == 1 or layer.router.device.type == "meta":
        layer._checked = True
        return False
    return True


def _transport_kind(transport) -> str:
    if isinstance(transport, PushBuffer):
        return "PushBuffer"
    if isinstance(transport, str):
        return transport
    cls = type(transport)
    return f"{cls.__module__}.{cls.__qualname__}"


def _terms(layer, x) -> str:
    hidden, ffn = layer.router.shape[0], layer.experts.w1.shape[-1]
    terms = {"hidden": hidden, "ffn": ffn, "num_experts": layer.num_experts}
    terms["activation"] = layer.experts.activation
    terms |= {"top_k": layer.top_k, "exchange": "/".join(layer.wires), "precision": layer.precision}
    terms |= {"capacity": layer.capacity, "max_tokens": layer.max_tokens, "align": layer.align}
    terms |= {"transport": _transport_kind(layer.transport)}
    if layer.topology is not None:
        terms["topology"] = layer.topology.terms()
    if isinstance(x, torch.Tensor):
        terms["x.dtype"] = x.dtype
    return agreement.terms_text(terms)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 DTensor: this shard


def _digest(t: torch.Tensor) -> list[int]:
    """Two float64 sums of t (all of it, every third element) as int64 bit patterns."""
    flat = _local(t).detach().reshape(-1)
    sums = torch.stack([flat.sum(dtype=torch.float64), flat[::3].sum(dtype=torch.float64)])
    return sums.cpu().view(torch.int64).tolist()


def _copies_of_one(experts) -> bool:
    """Whether this rank holds 2+ experts, all equal (sparse upcycling, a constant init)."""
    w1, w2 = _local(experts.w1).detach(), _local(experts.w2).detach()
    return w1.shape[0] > 1 and bool((w1 == w1[:1]).all() and (w2 == w2[:1]).all())


_FINDINGS = {  # what a rank alone can see wrong with how the experts are wrapped
    1: "the experts are DTensors (fully_shard) that mx.shard_experts did not shard: a "
    "whole-model fully_shard mixes the ranks' different experts",
    2: "DistributedDataParallel averages this layer's experts with the other ranks' "
    "(different) experts",
}


def _own_finding(layer) -> int:
    """This rank's _FINDINGS key (0: none)."""
    experts = layer.experts
    if hasattr(experts.w1, "to_local") and getattr(experts, "data_parallel", None) != "fsdp2":
        return 1
    from torch.nn.parallel import DistributedDataParallel

    ddp = getattr(DistributedDataParallel, "_active_ddp_module", None)  # (private; gated)
    managed = getattr(ddp, "_module_parameters", None) or ()
    mine = {id(p) for p in experts.parameters()}
    return 2 if any(id(p) in mine for p in managed) else 0


def first_forward_check(layer, x, problem: str | None) -> None:
    """The module docstring's check (a collective on the layer's group; every rank must
    call it). ``problem``: this rank's error with x, or None. Raises the same ValueError on
    every rank, or marks the layer checked."""
    extra = [0] * 9
    if problem is None:
        status, text = agreement.FINE, _terms(layer, x)
        router = layer.router  # (a sharded one, still a DTensor: its shards differ)
        extra = [0, 0] if hasattr(router, "to_local") else _digest(router)
        extra += _digest(layer.experts.w1) + _digest(layer.experts.w2)
        # shard_experts' FSDP2 shards may be empty (fewer experts than replicas): no digest
        extra.append(int(getattr(layer.experts, "data_parallel", None) == "fsdp2"))
        extra.append(_own_finding(layer))
        extra.append(int(_copies_of_one(layer.experts)))
    else:
        status, text = agreement.BAD_ARGUMENTS, problem
    rows = agreement.gather_rows(agreement.row(status, text, extra), layer.group)
    agreement.check_rows(WHAT, rows, len(extra))
    for key, finding in _FINDINGS.items():
        if ranks := [rank for rank, r in enumerate(rows) if r[8] == key]:
            raise ValueError(f"{WHAT}: {finding} (seen on rank(s) {ranks}); {_DDP_FIX}")
    if len({tuple(r[1:3]) for r in rows}) > 1:
        raise ValueError(
            f"{WHAT}: the router differs between the ranks of the group (the ranks built it "
            "from different seeds); call torch.manual_seed(s) with the same s on every rank "
            "before building the model, or pass the same seed= on every rank"
        )
    upcycled = all(r[9] for r in rows)  # (every expert one MLP's copy: nothing to tell)
    if len({tuple(r[3:7]) for r in rows}) == 1 and not any(r[7] for r in rows) and not upcycled:
        raise ValueError(
            f"{WHAT}: the experts are the same on every rank of the group, but each rank "
            "holds its own: a data-parallel wrapper overwrote them (DistributedDataParallel "
            "broadcasts rank 0's unless prepare_ddp excluded them; fully_shard of the whole "
            "model gathers one set for every rank unless shard_experts sharded them); " + _DDP_FIX
        )
    layer._checked = True
