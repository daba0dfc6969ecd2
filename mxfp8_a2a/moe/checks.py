"""The checks of the MoE front ends, in one place: each rank's own argument errors
(``*_error`` -> a message or None, raised at the front end), the marks that tell combine
which dispatch a tensor of rows came from, and the cross-rank agreements of the static
dispatch and of the layer's first forward, on exchange/agreement.py's rows (one
all_gather, the same error on every rank, naming the argument, the ranks that differ and
the fix). What each front end's ranks must agree on is declared in terms.py (one table per
front end); this module says how and when it is checked.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .._common import check_scaling_mode
from ..exchange import agreement
from ..exchange.checks import validating
from ..exchange.push import PushBuffer
from ..exchange.transport import device_error
from ..exchange.wires import check_leg_pair, combine_default, layer_wires, leg_pair
from ..grouped.gemm import PRECISIONS
from .plan import capacity_for
from .terms import LAYER, STATIC

MAX_KEYS = 64  # configurations kept per group or buffer (oldest forgotten first)
_GROUPS: dict[str, OrderedDict] = {}  # process group name -> agreed terms texts


# ---- each rank's own arguments, and which dispatch a tensor of rows came from

_dispatch_ids = itertools.count(1)
_OWNER = "_mxfp8_a2a_dispatch_id"


def mark_output(out: torch.Tensor) -> int:
    """A new dispatch id, also set on ``out`` (the dispatch's output rows) as an attribute, so
    that combine can tell when it is given another dispatch's rows (:func:`check_owner`).
    0 (no mark) under torch.compile, where tensors take no attributes."""
    if torch.compiler.is_compiling():
        return 0
    dispatch_id = next(_dispatch_ids)
    setattr(out, _OWNER, dispatch_id)
    return dispatch_id


def check_owner(expert_y: torch.Tensor, dispatch_id: int, what: str) -> None:
    """A ValueError if ``expert_y`` is the output of a dispatch other than the handle's.
    Rows computed from a dispatch's output carry no mark (an attribute does not follow
    through operations): only a dispatch's own output tensor is told apart. Host-only (no
    sync, nothing under CUDA graph capture); skipped under torch.compile."""
    if torch.compiler.is_compiling():
        return
    owner = getattr(expert_y, _OWNER, None)
    if owner is not None and dispatch_id and owner != dispatch_id:
        raise ValueError(
            f"expert_y is the output of another {what} (number {owner} in this process) than "
            f"the handle's (number {dispatch_id}); pass the handle returned with these rows"
        )


def argument_error(x, topk_ids, num_experts, world, exchange, group) -> str | None:
    """What is wrong with this rank's arguments (shapes and types only, no data read)."""
    if (problem := check_leg_pair(exchange)) is not None:
        return problem
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        return f"x must be a 2-D [tokens, hidden] tensor, got {getattr(x, 'shape', type(x))}"
    if (problem := device_error(x.device, group)) is not None:
        return problem
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        return f"topk_ids must be a 2-D [tokens, k] tensor, got {getattr(topk_ids, 'shape', '?')}"
    if topk_ids.shape[0] != x.shape[0]:
        return f"topk_ids must be [tokens, k] with tokens = {x.shape[0]}, got {topk_ids.shape}"
    dt = topk_ids.dtype
    if dt.is_floating_point or dt.is_complex or dt == torch.bool:
        return f"topk_ids must be an integer tensor, got {topk_ids.dtype}"
    if topk_ids.device != x.device:
        return f"topk_ids ({topk_ids.device}) must be on x's device ({x.device})"
    if type(num_experts) is not int or num_experts < 1 or num_experts % world:
        return f"num_experts ({num_experts!r}) must be a positive multiple of the group size"
    mxfp8 = "mxfp8" in leg_pair(exchange, "dispatch") + combine_default(exchange)
    if mxfp8 and x.dtype not in (torch.bfloat16, torch.float32):
        return f"x must be bfloat16 or float32 for an MXFP8 wire ({exchange!r}), got {x.dtype}"
    if mxfp8 and x.shape[1] % 32:
        return (
            f"x.shape[1] (hidden={x.shape[1]}) must be a multiple of 32 for an MXFP8 wire "
            f"({exchange!r}); pad it or use exchange='bf16'"
        )
    return None


def mxfp8_rows_error(y: torch.Tensor, exchange) -> str | None:
    """What stops combine's rows ``y`` from travelling on ``exchange``'s combine legs."""
    if "mxfp8" not in leg_pair(exchange, "combine"):
        return None
    if y.dtype not in (torch.bfloat16, torch.float32) or y.shape[1] % 32:
        return (f"expert_y must be bfloat16 or float32 with a multiple of 32 columns for an "
                f"MXFP8 combine leg ({exchange!r}), got {y.dtype} {tuple(y.shape)}")  # fmt: skip
    return None


def _desc(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {tuple(t.shape)} on {t.device}"
    return type(t).__name__


def check_static(x, topk_ids, num_experts, world, capacity, align, exchange, scaling_mode,
                 group) -> None:  # fmt: skip
    """dispatch_static's checks of its arguments: dispatch's, then the static path's own."""
    if (problem := argument_error(x, topk_ids, num_experts, world, exchange, group)) is not None:
        raise ValueError(problem)
    check_scaling_mode(scaling_mode)
    if not x.dtype.is_floating_point:
        raise ValueError(f"x must be a floating [tokens, hidden] tensor, got {_desc(x)}")
    if type(capacity) is not int or capacity < 0:
        raise ValueError(
            f"capacity must be an int >= 0 (rows per rank pair; see capacity_for), got {capacity!r}"
        )
    if type(align) is not int or align < 1:
        raise ValueError(f"align must be an int >= 1, got {align!r}")


def check_combine(expert_y, topk_weights, handle, exchange) -> None:
    """combine's checks of its arguments (a ValueError on this rank; no collective)."""
    n, h = handle.src_row.numel(), handle.hidden
    t, k = handle.rows_of.shape
    if not isinstance(expert_y, torch.Tensor) or expert_y.dim() != 2:
        got = getattr(expert_y, "shape", type(expert_y).__name__)
        raise ValueError(f"expert_y must be a 2-D [{n}, {h}] tensor, got {got}")
    if expert_y.shape != (n, h):
        raise ValueError(
            f"expert_y must be [{n}, {h}] (one row per row dispatch returned, of dispatch's "
            f"hidden size), got {tuple(expert_y.shape)}"
        )
    if expert_y.device != handle.rows_of.device:
        raise ValueError(
            f"expert_y is on {expert_y.device}, dispatch's tensors on "
            f"{handle.rows_of.device}; keep them on one device"
        )
    if not isinstance(topk_weights, torch.Tensor) or topk_weights.shape != (t, k):
        raise ValueError(
            f"topk_weights must be a [{t}, {k}] tensor (tokens, top-k of the dispatch), got "
            f"{tuple(getattr(topk_weights, 'shape', ())) or type(topk_weights)}"
        )
    if not topk_weights.dtype.is_floating_point or topk_weights.device != expert_y.device:
        raise ValueError(
            f"topk_weights must be a floating tensor on {expert_y.device}, got "
            f"{topk_weights.dtype} on {topk_weights.device}"
        )
    if exchange is not None and (problem := check_leg_pair(exchange)) is not None:
        raise ValueError(problem)
    if exchange is not None and (problem := mxfp8_rows_error(expert_y, exchange)) is not None:
        raise ValueError(problem)
    check_owner(expert_y, handle.dispatch_id, "dispatch")


def check_combine_static(expert_y, topk_weights, handle, exchange) -> None:
    """combine_static's checks of its arguments (a ValueError on this rank; no collective)."""
    n, h = handle.src_row.numel(), handle.hidden
    t, k = handle.rows_of.shape
    if not isinstance(expert_y, torch.Tensor) or tuple(expert_y.shape) != (n, h):
        raise ValueError(
            f"expert_y must be [{n}, {h}] (dispatch_static's output shape), got {_desc(expert_y)}"
        )
    check_owner(expert_y, handle.dispatch_id, "dispatch_static")
    if expert_y.dtype != handle.dtype or expert_y.device != handle.rows_of.device:
        raise ValueError(
            f"expert_y must be {handle.dtype} on {handle.rows_of.device} (as dispatch_static's "
            f"x), got {expert_y.dtype} on {expert_y.device}"
        )
    if (
        not isinstance(topk_weights, torch.Tensor) or tuple(topk_weights.shape) != (t, k)
        or not topk_weights.dtype.is_floating_point or topk_weights.device != expert_y.device
    ):  # fmt: skip
        raise ValueError(
            f"topk_weights must be a floating [{t}, {k}] tensor on {expert_y.device}, got "
            f"{_desc(topk_weights)}"
        )
    if exchange is not None and (problem := mxfp8_rows_error(expert_y, exchange)) is not None:
        raise ValueError(problem)


# ---- the static dispatch's agreement, once per new configuration


def _cache(group: dist.ProcessGroup | None, push: PushBuffer | None) -> OrderedDict:
    if push is not None:
        return push.__dict__.setdefault("_agreed_configs", OrderedDict())
    name = (group or dist.group.WORLD).group_name
    return _GROUPS.setdefault(name, OrderedDict())


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (nothing may synchronize)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def agree_static(
    text: str,
    error: Exception | None,
    group: dist.ProcessGroup | None,
    push: PushBuffer | None,
    world: int,
    validate: bool,
    x: torch.Tensor,
) -> torch.Tensor:
    """Check this call's configuration ``text`` (or this rank's ``error``) across the ranks
    once per new configuration (terms.py's STATIC); returns x (under torch.compile with
    validate: x through the traced check). Raises the same ValueError/TypeError on every
    rank that joined."""
    check = validating(validate)
    if torch.compiler.is_compiling():
        if error is not None:
            raise error
        if check and world > 1:
            return agreement.agree_compiled(STATIC, agreement.FINE, text, [], group, x)
        return x
    if capturing() and check:
        raise ValueError(
            "under CUDA graph capture pass validate=False (and start without "
            "MXFP8_A2A_VALIDATE=1): validation synchronizes"
        )
    alone = world == 1 or (push is not None and push._handle is None)  # (emulated: one process)
    cache = None if alone or capturing() else _cache(group, push)
    # (agreed before: a lone error is this rank's only)
    if cache is None or not (check or (text not in cache if error is None else not cache)):
        if error is not None:
            raise error
        return x
    if error is None:
        agreement.agree(STATIC, agreement.FINE, text, [], group)
    else:
        agreement.agree(STATIC, agreement.status_of(error), str(error), [], group)
    cache[text] = True
    cache.move_to_end(text)
    while len(cache) > MAX_KEYS:
        cache.popitem(last=False)
    return x


def report(problem: str, group: dist.ProcessGroup | None, push: PushBuffer | None) -> None:
    """A layer's error with x before its static dispatch: raised on every rank where the
    ranks would agree at this call (the first call, or validate), else on this rank."""
    world = dist.get_world_size(group) if push is None else push.world
    agree_static("", ValueError(problem), group, push, world, False, torch.empty(0))


# ---- the layer: its arguments at construction, and its first forward's agreement

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


def first_forward_due(layer) -> bool:
    """Whether this forward runs the first-forward check: not yet passed, eager (not under
    torch.compile, nor CUDA graph capture), a group of more than one rank."""
    if layer._checked or torch.compiler.is_compiling() or capturing():
        return False
    if dist.get_world_size(layer.group) == 1 or layer.router.device.type == "meta":
        layer._checked = True
        return False
    return True


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


def _extra(layer) -> list[int]:
    """The first forward's extra ints of this rank (their places: _AT)."""
    router = layer.router  # (a sharded one, still a DTensor: its shards differ)
    extra = [0, 0] if hasattr(router, "to_local") else _digest(router)
    extra += _digest(layer.experts.w1) + _digest(layer.experts.w2)
    # shard_experts' FSDP2 shards may be empty (fewer experts than replicas): no digest
    extra.append(int(getattr(layer.experts, "data_parallel", None) == "fsdp2"))
    return extra + [_own_finding(layer), int(_copies_of_one(layer.experts))]


# where each of _extra's ints sits in a gathered row (after the word)
_AT = SimpleNamespace(router=slice(1, 3), experts=slice(3, 7), sharded=7, finding=8, copies=9)


def first_forward_check(layer, x, problem: str | None) -> None:
    """The module docstring's check (a collective on the layer's group; every rank must
    call it). ``problem``: this rank's error with x, or None. Raises the same ValueError on
    every rank, or marks the layer checked."""
    error = None if problem is None else ValueError(problem)
    extra = _extra(layer) if error is None else [0] * 9
    rows = agreement.check(LAYER, dict(layer=layer, x=x), error, layer.group, extra)
    for key, finding in _FINDINGS.items():
        if ranks := [rank for rank, r in enumerate(rows) if r[_AT.finding] == key]:
            raise ValueError(f"{LAYER}: {finding} (seen on rank(s) {ranks}); {_DDP_FIX}")
    if len({tuple(r[_AT.router]) for r in rows}) > 1:
        raise ValueError(
            f"{LAYER}: the router differs between the ranks of the group (the ranks built it "
            "from different seeds); call torch.manual_seed(s) with the same s on every rank "
            "before building the model, or pass the same seed= on every rank"
        )
    upcycled = all(r[_AT.copies] for r in rows)  # (every expert one MLP's copy: can't tell)
    same = len({tuple(r[_AT.experts]) for r in rows}) == 1
    if same and not any(r[_AT.sharded] for r in rows) and not upcycled:
        raise ValueError(
            f"{LAYER}: the experts are the same on every rank of the group, but each rank "
            "holds its own: a data-parallel wrapper overwrote them (DistributedDataParallel "
            "broadcasts rank 0's unless prepare_ddp excluded them; fully_shard of the whole "
            "model gathers one set for every rank unless shard_experts sharded them); " + _DDP_FIX
        )
    layer._checked = True
