"""Checkpoints of models with ExpertParallelMoE layers: the standard ways, nothing lost.

A layer's parameters ``experts.w1`` [L, H, F] and ``experts.w2`` [L, F, H] hold this rank's
L = E / W experts only: the same keys name different tensors on the ranks of the
expert-parallel group. So ``state_dict()`` presents them (a state-dict post-hook every layer
registers) as one DTensor each of the global shape [E, ...], sharded ``Shard(0)`` over the
layer's group (a :class:`DeviceMesh` made from it with ``DeviceMesh.from_group``, no new
process group), wrapping the parameter's own storage. With FSDP2 (``shard_experts``) the
parameter is already a DTensor sharded over the data-parallel replicas: the experts are
then presented on a 2-D (ep, dp) mesh made from the two groups, placements
(Shard(0), Shard(0)) (the expert-parallel split outermost). The router and the rest of the
model stay as they are (plain, or FSDP2's DTensors); ``dispatch_stats`` is not saved.

So ``torch.distributed.checkpoint`` (``dcp.save(model.state_dict())``, ``dcp.load`` then
``model.load_state_dict``, or its ``get_model_state_dict`` / ``set_model_state_dict``)
saves every expert once and loads them at any expert-parallel size, unwrapped, under DDP
and under FSDP2. ``load_state_dict`` (a load pre-hook) takes for each expert key such a
DTensor, a plain full [E, ...] tensor (this rank's experts sliced out), or a plain local
[L, ...] tensor (the form of earlier versions, same group size only).

:func:`prepare_optimizer` does the same for the optimizer's states of the experts (Adam's
moments), which dcp would otherwise also keep from one rank only.

:func:`full_state_dict` / :func:`load_full_state_dict`: the whole model as plain full
tensors on one rank, for ``torch.save`` (any module, wrapped or not). full_state_dict is a
collective that first checks every rank has joined (:func:`handshake`): called on one rank
only, it raises an error naming the fix instead of waiting forever.

On the (ep, dp) mesh under FSDP2 each rank knows only its own two groups: DTensor and dcp
use only this rank's own (exact) coordinate and groups, the rest follows init_device_mesh.
"""

from __future__ import annotations

import datetime
import functools
import math
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ..exchange.agreement import (
    BAD_ARGUMENTS,
    FINE,
    _all_gather,
    _text,
    check_rows,
    comm_device,
    row,
    terms_text,
)


def register_checkpoint_hooks(layer: torch.nn.Module) -> None:
    """The state-dict hooks of an ExpertParallelMoE (its constructor calls it; moe_layers)."""
    layer.register_state_dict_post_hook(_present_experts)
    layer.register_load_state_dict_pre_hook(_accept_experts)
    layer._mxfp8_a2a_moe = True


def moe_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, layer) of every ExpertParallelMoE in ``model`` (itself included)."""
    return [(n, m) for n, m in model.named_modules() if getattr(m, "_mxfp8_a2a_moe", False)]


def _group_of(layer) -> dist.ProcessGroup:
    return layer.group if layer.group is not None else dist.group.WORLD


def _expert_mesh(layer, param: torch.Tensor) -> tuple[DeviceMesh, tuple]:
    """The mesh and placements of the experts' global DTensor (see the module docstring)."""
    device_type = param.device.type
    ep = _group_of(layer)
    if not isinstance(param, DTensor):
        return DeviceMesh.from_group(ep, device_type), (Shard(0),)
    if param.device_mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
        raise ValueError(
            f"ExpertParallelMoE checkpoint: the experts are a DTensor on a "
            f"{param.device_mesh.ndim}-D mesh with placements {param.placements}; only "
            f"FSDP2's Shard(0) over a 1-D mesh of replicas is supported (use shard_experts)"
        )
    dp_mesh = param.device_mesh
    rows = dist.get_process_group_ranks(ep)
    cols = dp_mesh.mesh.tolist()
    me = dist.get_rank()
    # this rank's row (its ep group) and column (its dp group) are exact; the other cells
    # follow the grid of init_device_mesh (rank = offset + i * stride_ep + j * stride_dp)
    grid = torch.tensor([[r + c - me for c in cols] for r in rows], dtype=torch.int)
    cells = grid.flatten().tolist()
    if len(set(cells)) != len(cells) or not 0 <= min(cells) <= max(cells) < dist.get_world_size():
        raise ValueError(
            "ExpertParallelMoE checkpoint: the expert-parallel group and FSDP2's mesh of "
            "replicas do not form a grid of ranks; build both from one "
            "init_device_mesh((dp, ep)) mesh (mesh['ep'], mesh['dp'])"
        )
    mesh = DeviceMesh.from_group(
        [ep, dp_mesh.get_group()], device_type, mesh=grid, mesh_dim_names=("ep", "dp")
    )
    return mesh, (Shard(0), Shard(0))


def _global_shape(layer, param: torch.Tensor) -> tuple[int, ...]:
    return (layer.num_experts, *param.shape[1:])


def _present_experts(layer, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook: experts.w1 / w2 as DTensors [E, ...] over the layer's group."""
    for name in ("w1", "w2"):
        key = f"{prefix}experts.{name}"
        if key in state_dict:
            state_dict[key] = _as_global(layer, getattr(layer.experts, name), state_dict[key])


def _as_global(layer, param: torch.Tensor, value: torch.Tensor) -> DTensor:
    """``value`` (``param`` or a tensor of its form) as the DTensor [E, ...] of its experts."""
    mesh, placements = _expert_mesh(layer, param)
    local = value.to_local() if isinstance(value, DTensor) else value
    shape = _global_shape(layer, param)
    stride = _contiguous_stride(shape)
    return DTensor.from_local(local.detach(), mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=stride)  # fmt: skip


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def _accept_experts(layer, state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook: each expert key as a DTensor from state_dict(), a full
    [E, ...] or a local [L, ...] plain tensor -> the parameter's own form."""
    for name in ("w1", "w2"):
        key = f"{prefix}experts.{name}"
        if key in state_dict:
            state_dict[key] = _as_param(layer, name, state_dict[key], key)


def _as_param(layer, name: str, value, key: str):
    param = getattr(layer.experts, name)
    count = param.shape[0]
    if isinstance(value, DTensor):
        mesh, placements = _expert_mesh(layer, param)
        if (
            tuple(value.shape) != _global_shape(layer, param)
            or value.device_mesh.mesh.tolist() != mesh.mesh.tolist()  # (the same ranks)
            or value.device_mesh.device_type != mesh.device_type
            or tuple(value.placements) != placements
        ):
            raise ValueError(
                f"load_state_dict: {key!r} is a DTensor {tuple(value.shape)} on "
                f"{value.device_mesh} with {value.placements}, not this layer's form "
                f"({_global_shape(layer, param)} on {mesh} with {placements}); load "
                f"checkpoints of another layout with torch.distributed.checkpoint into "
                f"model.state_dict(), or as plain tensors (mxfp8_a2a.full_state_dict)"
            )
        local = value.to_local()
    elif not isinstance(value, torch.Tensor):
        return value  # (torch's load reports it)
    elif value.dim() >= 1 and value.shape[0] == layer.num_experts != count:
        first = layer.experts.first
        local = value[first : first + count]  # a full tensor: this rank's experts
    else:
        local = value  # this rank's experts (or a wrong shape: torch's load reports it)
    if not isinstance(param, DTensor):
        return local
    if isinstance(value, DTensor):
        piece = local
    else:  # FSDP2's shard of this rank's experts: torch.chunk's split over the replicas
        step = -(-count // param.device_mesh.size())
        start = param.device_mesh.get_local_rank() * step
        piece = local[start : start + step]
    return DTensor.from_local(piece, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())  # fmt: skip


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DistributedDataParallel and torch.compile's wrapper (whose keys have
    no "module." / "_orig_mod." prefix)."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(model, torch.nn.Module) and isinstance(
            getattr(model, "_orig_mod", None), torch.nn.Module
        ):  # torch.compile(module)'s OptimizedModule
            model = model._orig_mod
        else:
            return model


def _expert_params(net: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str]]:
    dot = lambda prefix: f"{prefix}." if prefix else ""  # noqa: E731
    return {
        f"{dot(prefix)}experts.{name}": (layer, name)
        for prefix, layer in moe_layers(net)
        for name in ("w1", "w2")
    }


def handshake(what: str, terms: dict, problem: str | None, timeout: float) -> None:
    """Before a collective helper's first collective: every rank of the job tells rank 0 it
    is in ``what`` with ``terms`` (or its ``problem``), and rank 0 answers each, within
    ``timeout`` seconds (the others wait twice that for the answer). Raises on every rank
    what is wrong (a rank's problem, terms that differ). A rank whose peers do not join in
    time (or have left: a closed connection) raises a RuntimeError that names the fix.

    On gloo these are point-to-point messages (a timed-out receive leaves nothing pending:
    the process can exit, and its peers' next collective then fails with "Connection closed
    by peer"). On NCCL, one all_gather waited with ``Work.wait(timeout)`` (which blocks the
    host and raises on timeout)."""
    world, me = dist.get_world_size(), dist.get_rank()
    text = problem if problem is not None else terms_text({"call": what, **terms})
    mine = row(FINE if problem is None else BAD_ARGUMENTS, text, [])
    dev = comm_device(None)
    if dev.type == "cuda":
        table = torch.zeros(world * mine.numel(), dtype=torch.int64, device=dev)
        _wait(what, [_all_gather(table, mine.to(dev), async_op=True)], timeout)
        return check_rows(what, table.view(world, -1).tolist(), 0)
    if me != 0:
        answer = torch.zeros_like(mine)
        works = [dist.isend(mine, 0, tag=_TAG), dist.irecv(answer, 0, tag=_TAG)]
        _wait(what, works, 2 * timeout)
        if answer[0] % 4 != FINE:
            raise ValueError(_text(answer[1:].tolist()))
        return None
    rows = [mine, *(torch.zeros_like(mine) for _ in range(world - 1))]
    _wait(what, [dist.irecv(rows[r], r, tag=_TAG) for r in range(1, world)], timeout)
    try:
        check_rows(what, [r.tolist() for r in rows], 0)
        failure, answer = None, row(FINE, "", [])
    except ValueError as err:
        failure, answer = err, row(BAD_ARGUMENTS, str(err), [])
    _wait(what, [dist.isend(answer, r, tag=_TAG) for r in range(1, world)], timeout)
    if failure is not None:
        raise failure


_TAG = 0x6D78  # the handshake's point-to-point messages


def _wait(what: str, works: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        for work in works:
            left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
            if work.wait(timeout=left) is False:
                raise RuntimeError("the wait returned False")
        return
    except RuntimeError as err:  # gloo: "Timed out ...", "Connection closed by peer"
        error = str(err).splitlines()[0].split("] ")[-1].strip()[:160]
    raise RuntimeError(
        f"{what}: not every rank joined it ({error}; waited up to {timeout} s). It is a "
        f"collective: call it on every rank, not only on the rank that saves (it returns "
        f"the state dict on rank dst and None on the others): state = mxfp8_a2a.{what}(model); "
        f"if state is not None: torch.save(state, path)"
    )


@torch.no_grad()
def full_state_dict(
    model: torch.nn.Module, dst: int = 0, *, timeout: float = 60.0
) -> dict[str, torch.Tensor] | None:
    """The whole state dict of ``model`` (an ExpertParallelMoE, a model holding such layers,
    either wrapped in DistributedDataParallel or sharded with FSDP2) as plain full tensors on
    the CPU on rank ``dst`` of the job, None on the other ranks. Keys as ``state_dict()``'s
    of the unwrapped model (no "module." prefix); each layer's ``experts.w1`` [E, H, F] and
    ``experts.w2`` [E, F, H] hold every expert (a layer alone: "router" [H, E], "experts.w1",
    "experts.w2"). Plain tensors of a CPU model share its storage, as ``state_dict()``'s do.

    A collective: call it on every rank of the job. It first checks that every rank has
    joined (one small all_gather, waited for ``timeout`` seconds): called on some ranks only
    (``if rank == 0: full_state_dict(model)``), it raises a RuntimeError on those saying so,
    after ``timeout`` s or as soon as the others have left (their own next collective then
    fails or waits; the process group is unusable). Memory: the experts are gathered on
    ``dst`` only; FSDP2's shards (and the other DTensors) are all-gathered on their ranks,
    one tensor at a time. Loads at any group size with :func:`load_full_state_dict`."""
    world = dist.get_world_size()
    problem = None
    if type(dst) is not int or not 0 <= dst < world:
        problem = f"dst must be a rank of the job, an int in [0, {world}), got {dst!r}"
    if world > 1:
        handshake("full_state_dict", {"dst": dst}, problem, timeout)
    elif problem is not None:
        raise ValueError(f"full_state_dict: {problem}")
    net = _unwrap(model)
    experts = _expert_params(net)
    mine = dist.get_rank() == dst
    out = {}
    for key, value in net.state_dict().items():
        if key in experts:
            value = _gather_experts(*experts[key], dst)
        elif isinstance(value, DTensor):
            value = value.full_tensor()
        if mine:
            key = key.replace("_orig_mod.", "")  # compiled submodules: the plain model's keys
            out[key] = value.detach().cpu() if isinstance(value, torch.Tensor) else value
    return out if mine else None


def _gather_experts(layer, name: str, dst: int) -> torch.Tensor | None:
    """Every expert of the layer's parameter ``name`` on rank dst (None elsewhere)."""
    param = getattr(layer.experts, name)
    local = (param.full_tensor() if isinstance(param, DTensor) else param).detach().contiguous()
    group = _group_of(layer)
    ranks = dist.get_process_group_ranks(group)
    if dst not in ranks:  # another expert-parallel group gathers them
        return None
    parts = [torch.empty_like(local) for _ in ranks] if dist.get_rank() == dst else None
    dist.gather(local, parts, dst=dst, group=group)
    return torch.cat(parts) if parts is not None else None


@torch.no_grad()
def load_full_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a :func:`full_state_dict` (saved at any group size; on every rank, e.g. from
    ``torch.load``) into ``model`` (wrapped or not, as for :func:`full_state_dict`): each
    rank takes its experts' slice, FSDP2's shards their part. Local: no collective. Raises
    ValueError for an expert key or router of the wrong shape, and ``load_state_dict``'s
    (strict) error for missing or unexpected keys."""
    net = _unwrap(model)
    target = net.state_dict()
    experts = _expert_params(net)
    for key, (layer, name) in experts.items():
        router = key[: -len(f"experts.{name}")] + "router"
        want = {key: _global_shape(layer, getattr(layer.experts, name)),
                router: (layer.router.shape[0], layer.num_experts)}  # fmt: skip
        for k, shape in want.items():
            got = tuple(state[k].shape) if k in state else "missing"
            if got != shape:
                raise ValueError(f"state[{k!r}]: expected shape {shape}, got {got}")
    ready = {}
    for key, value in state.items():
        here = target.get(key)
        if key not in experts and isinstance(here, DTensor) and not isinstance(value, DTensor):
            value = distribute_tensor(
                value.to(here.device), here.device_mesh, here.placements, src_data_rank=None
            )  # fmt: skip (local: no collective)
        ready[key] = value
    net.load_state_dict(ready)


def prepare_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """Make ``optimizer.state_dict()`` present the states of the experts (Adam's moments,
    SGD's momentum: tensors of the parameter's shape) as the model's ``state_dict()``
    presents the experts, DTensors [E, ...] over the expert-parallel group, and
    ``load_state_dict`` take them back (or full [E, ...] / local [L, ...] plain tensors), so
    that torch.distributed.checkpoint keeps every rank's (``get_optimizer_state_dict`` /
    ``set_optimizer_state_dict``, or ``optimizer.state_dict()``) and loads them at another
    expert-parallel size. Without it, dcp keeps one rank's states of the experts for all.
    Call once, on every rank, after wrapping the model and building the optimizer; returns
    the optimizer. Other states of an expert raise ValueError in ``state_dict()``."""
    net = _unwrap(model)
    if not _expert_params(net):
        raise ValueError("prepare_optimizer: model has no ExpertParallelMoE layer")
    optimizer.register_state_dict_post_hook(functools.partial(_present_states, net=net))
    optimizer.register_load_state_dict_pre_hook(functools.partial(_accept_states, net=net))
    return optimizer


def _expert_states(optimizer, state_dict: dict, net: torch.nn.Module):
    """(index, key, layer, name, param) of each expert parameter's state in state_dict."""
    owners = {id(getattr(layer.experts, name)): (key, layer, name)
              for key, (layer, name) in _expert_params(net).items()}  # fmt: skip
    for saved, group in zip(state_dict["param_groups"], optimizer.param_groups, strict=True):
        for index, param in zip(saved["params"], group["params"], strict=True):
            if id(param) in owners and index in state_dict["state"]:
                yield (index, *owners[id(param)], param)


def _present_states(optimizer, state_dict: dict, net: torch.nn.Module) -> dict:
    state = dict(state_dict["state"])  # (its per-parameter dicts are the optimizer's own)
    for index, key, layer, _, param in _expert_states(optimizer, state_dict, net):
        mine = dict(state[index])
        for k, value in mine.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            if value.shape != param.shape:
                raise ValueError(
                    f"prepare_optimizer: state {k!r} of {key} has shape {tuple(value.shape)}, "
                    f"not the parameter's {tuple(param.shape)}: only states of the "
                    f"parameter's shape can be saved by expert (Adam, SGD with momentum)"
                )
            mine[k] = _as_global(layer, param, value)
        state[index] = mine
    return {**state_dict, "state": state}


def _accept_states(optimizer, state_dict: dict, net: torch.nn.Module) -> dict:
    state = dict(state_dict["state"])
    for index, key, layer, name, _ in _expert_states(optimizer, state_dict, net):
        state[index] = {k: _as_param(layer, name, v, f"{key} {k}") if _is_array(v) else v
                        for k, v in state[index].items()}  # fmt: skip
    return {**state_dict, "state": state}


def _is_array(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0
