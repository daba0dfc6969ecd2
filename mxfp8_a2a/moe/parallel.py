"""Data parallelism for models with ExpertParallelMoE layers (checkpoints: checkpoint.py).

A layer's experts differ between the ranks of its expert-parallel group, so a data-parallel
wrapper must not average them with the rest of the model. Two ways, both giving the update
of the mean of the losses of all ranks (each rank backpropagating the mean over its own
tokens, as DistributedDataParallel expects):

- DDP: :func:`prepare_ddp` before ``DistributedDataParallel(model)``: DDP skips the experts
  (no broadcast at construction, no all-reduce); their gradient is divided by the number of
  ranks and, with ``replicas`` (the ranks holding the same experts), summed over those by a
  gradient hook. Everything else (routers, the rest of the model) is DDP's as usual.
- FSDP2: :func:`shard_experts` shards each layer's ``experts`` over ``replicas`` with
  ``fully_shard`` (which averages over them; the experts' gradient is divided by the
  expert-parallel size); then ``fully_shard(model, mesh=<all ranks>)`` takes the rest.

Why not DTensors sharded over the expert-parallel mesh: dispatch and combine already move
the tokens to the experts, so the experts are plain local tensors; what a wrapper needs is
to keep its hands off them, which both ways above do with public torch (DDP's exclusion list
is the one exception, gated: without it, use FSDP2).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .checkpoint import moe_layers
from .checks import mesh_group


def _ranks(model: torch.nn.Module, replicas: dist.ProcessGroup | None, who: str) -> int:
    """The data-parallel world: expert-parallel size x replicas (the same for every layer)."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"{who}: model has no ExpertParallelMoE layer")
    sizes = {dist.get_world_size(layer.group) for _, layer in layers}
    if len(sizes) != 1:
        raise ValueError(f"{who}: the layers' expert-parallel groups differ in size: {sizes}")
    return sizes.pop() * (1 if replicas is None else dist.get_world_size(replicas))


def _ddp_exclude() -> object:
    from torch.nn.parallel import DistributedDataParallel

    # DDP's only switch for parameters it must not touch (torch >= 1.8; not public API).
    exclude = getattr(DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model", None)
    if exclude is None:
        raise RuntimeError(
            "prepare_ddp: this torch's DistributedDataParallel cannot exclude parameters; "
            "use FSDP2 instead (mxfp8_a2a.moe.shard_experts, then fully_shard(model))"
        )
    return exclude


def prepare_ddp(
    model: torch.nn.Module, replicas: dist.ProcessGroup | DeviceMesh | None = None
) -> torch.nn.Module:
    """Get ``model`` ready for ``DistributedDataParallel(model)`` over all ranks; returns it.

    ``replicas``: the ranks holding the same experts as this one (the data-parallel
    dimension of a (dp, ep) mesh, e.g. mesh["dp"]); None when each expert lives on one rank
    (the expert-parallel group is the whole job). Call once, on every rank, before wrapping:
    given a DistributedDataParallel it raises; called after wrapping (on the wrapped
    module), the layers' first forward raises on every rank (ExpertParallelMoE's check).
    The experts' gradient hooks run in every backward (also under ``no_sync()``; they are
    linear, so accumulation stays right). With ``replicas``, each layer's experts are first
    broadcast from the replicas' first rank (as DDP does with the rest of the model), so
    replicas seeded differently start equal; call it with the model on its device.
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise ValueError(
            "prepare_ddp: model is already a DistributedDataParallel, which broadcast and "
            "will average the experts; call mx.prepare_ddp(model) on the plain model BEFORE "
            "DistributedDataParallel(model)"
        )
    group = mesh_group(replicas, "replicas", "dp")
    ranks = _ranks(model, group, "prepare_ddp")
    exclude = _ddp_exclude()
    names = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    for prefix, layer in moe_layers(model):
        if getattr(layer.experts, "data_parallel", None) is not None:
            raise RuntimeError(f"prepare_ddp: layer {prefix!r} is already prepared")
        _broadcast_over(layer, group)
        layer.experts.data_parallel = "ddp"
        layer.experts.grad_scale = 1.0 / ranks
        dot = f"{prefix}." if prefix else ""
        names.append(f"{dot}dispatch_stats")  # this rank's own counts: no broadcast
        for pname, param in layer.experts.named_parameters():
            names.append(f"{dot}experts.{pname}")
            if group is not None and dist.get_world_size(group) > 1:
                param.register_hook(functools.partial(_sum_over, group=group))
    exclude(model, names)
    return model


@torch.no_grad()
def _broadcast_over(layer: torch.nn.Module, group: dist.ProcessGroup | None) -> None:
    """The experts of ``layer`` made equal over ``group`` (replicas): its first rank's."""
    if group is None or dist.get_world_size(group) == 1:
        return
    for param in layer.experts.parameters():
        if param.device.type != "meta":
            dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)


def _sum_over(grad: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


def shard_experts(model: torch.nn.Module, replicas: DeviceMesh, **fsdp_kwargs) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` each layer's ``experts`` over ``replicas`` (a 1-D DeviceMesh of
    the ranks holding the same experts; size 1 when each expert lives on one rank), with the
    gradient divided by the number of all ranks. Then shard the rest with
    ``fully_shard(model, mesh=<1-D mesh of all ranks>)``. Returns ``model``. (FSDP2 averages
    over ``replicas``; the experts' gradient is also divided by the expert-parallel size, in
    their forward, as a gradient divide factor would need PREMUL_SUM, which gloo lacks.) The
    experts are first broadcast from the replicas' first rank, so that replicas seeded
    differently shard one set of experts."""
    from torch.distributed.fsdp import fully_shard

    if not isinstance(replicas, DeviceMesh) or replicas.ndim != 1:
        raise ValueError(f"replicas must be a 1-D DeviceMesh (e.g. mesh['dp']), got {replicas!r}")
    ranks = _ranks(model, replicas.get_group(), "shard_experts")
    for prefix, layer in moe_layers(model):
        if getattr(layer.experts, "data_parallel", None) is not None:
            raise RuntimeError(f"shard_experts: layer {prefix!r} is already prepared")
        _broadcast_over(layer, replicas.get_group())
        fully_shard(layer.experts, mesh=replicas, **fsdp_kwargs)
        layer.experts.grad_scale = replicas.size() / ranks
        layer.experts.data_parallel = "fsdp2"
    return model
