"""Workers of test_checkpoint.py: a small model with an ExpertParallelMoE layer (6 experts,
so that worlds 1, 2 and 3 divide them) built on a (dp, ep) mesh, unwrapped, under DDP or
under FSDP2, saved and loaded through torch.distributed.checkpoint and the full state dict
helpers, and compared bit for bit with the weights its seed draws."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import mxfp8_a2a as mx
from mxfp8_a2a.moe.layer import init_moe_weights

HIDDEN, FFN, EXPERTS, TOP_K = 16, 16, 6, 2


class Net(torch.nn.Module):
    """pre (dense) -> MoE layer (residual) -> head; every weight drawn from ``seed``."""

    def __init__(self, group, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.pre = torch.nn.Linear(HIDDEN, HIDDEN)
        with torch.no_grad():
            self.pre.weight.copy_(torch.randn(HIDDEN, HIDDEN, generator=g))
            self.pre.bias.copy_(torch.randn(HIDDEN, generator=g))
        self.moe = mx.ExpertParallelMoE(
            HIDDEN, FFN, EXPERTS, TOP_K, group, exchange="bf16", seed=seed
        )
        self.head = torch.nn.Parameter(torch.randn(HIDDEN, 4, generator=g))

    def forward(self, x):
        h = self.pre(x)
        return (h + self.moe(h)) @ self.head


def expected(seed: int) -> dict[str, torch.Tensor]:
    """The full state dict of a Net built with ``seed`` (as a group of one builds it)."""
    g = torch.Generator().manual_seed(seed)
    pre_w, pre_b = torch.randn(HIDDEN, HIDDEN, generator=g), torch.randn(HIDDEN, generator=g)
    moe = init_moe_weights(HIDDEN, FFN, EXPERTS, seed)
    return {"pre.weight": pre_w, "pre.bias": pre_b, "moe.router": moe["router"],
            "moe.experts.w1": moe["w1"], "moe.experts.w2": moe["w2"],
            "head": torch.randn(HIDDEN, 4, generator=g)}  # fmt: skip


def build(world: int, wrap: str, dp: int, seed: int) -> tuple[Net, torch.nn.Module]:
    """(the Net, the model to use: itself, its DDP wrapper or itself sharded by FSDP2)."""
    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "ep"))
    net = Net(mesh["ep"], seed)
    if wrap == "ddp":
        mx.prepare_ddp(net, mesh["dp"] if dp > 1 else None)
        return net, torch.nn.parallel.DistributedDataParallel(net)
    if wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        mx.shard_experts(net, mesh["dp"])
        fully_shard(net, mesh=init_device_mesh("cpu", (world,)))
    return net, net


def mismatches(net: Net, seed: int) -> list[str]:
    """The parameters of ``net`` (this rank's part) that differ from those of ``seed``."""
    want, bad = expected(seed), []
    layer = net.moe
    for key, param in net.named_parameters():
        full = want[key]
        if key.startswith("moe.experts."):
            count = layer.num_experts // dist.get_world_size(layer.group)
            full = full[layer.experts.first : layer.experts.first + count]
        if isinstance(param, DTensor):  # FSDP2: this rank's chunk (torch.chunk's split)
            step = -(-full.shape[0] // param.device_mesh.size())
            start = param.device_mesh.get_local_rank() * step
            full, param = full[start : start + step], param.to_local()
        if not torch.equal(param.detach(), full):
            bad.append(key)
    return bad


def _get(model, api: str) -> dict:
    if api == "dcp_helpers":
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model)
    return model.state_dict()


def save(rank: int, world: int, path: str, wrap: str, dp: int, api: str) -> dict:
    """dcp.save of a Net of seed 1; returns the form of its state dict."""
    net, model = build(world, wrap, dp, seed=1)
    state = _get(model, api)
    dcp.save(state, checkpoint_id=path)
    experts = {k: v for k, v in state.items() if "experts" in k}
    return {
        "keys": sorted(state),
        "experts": {k: (type(v).__name__, tuple(v.shape)) for k, v in experts.items()},
        "router": type(state[[k for k in state if k.endswith("router")][0]]).__name__,
    }


def load(rank: int, world: int, path: str, wrap: str, dp: int, api: str) -> list[str]:
    """A Net of seed 2 loaded from ``path`` (saved from seed 1): what differs from seed 1."""
    net, model = build(world, wrap, dp, seed=2)
    state = _get(model, api)
    dcp.load(state, checkpoint_id=path)
    if api == "dcp_helpers":
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state)
    else:
        model.load_state_dict(state)
    return mismatches(net, seed=1)


def full_round_trip(rank: int, world: int, wrap: str, dp: int) -> dict:
    """full_state_dict of a wrapped Net of seed 1 on the last rank (checked there against the
    seed's weights), load_full_state_dict of seed 1's weights into one of seed 2."""
    net, model = build(world, wrap, dp, seed=1)
    state = mx.full_state_dict(model, dst=world - 1)
    out = {"none": state is None}
    if state is not None:
        want = expected(1)
        out["keys"] = sorted(state)
        out["differ"] = [k for k in want if not torch.equal(state.get(k, torch.empty(0)), want[k])]
    net2, model2 = build(world, wrap, dp, seed=2)
    mx.load_full_state_dict(model2, expected(1))
    out["loaded_differ"] = mismatches(net2, seed=1)
    # torch's own full state dict (on rank 0) gathers the experts' DTensors as well
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    torch_full = get_model_state_dict(model, options=options)
    if rank == 0:
        want = expected(1)
        out["torch_differ"] = [k for k in want if not torch.equal(torch_full[k], want[k])]
    return out


def one_rank_only(rank: int, world: int, others: str) -> str:
    """The mistake ``if rank == 0: full_state_dict(model)``: what each rank sees, the others
    going on to their next collective (``others="barrier"``) or ending (``"exit"``)."""
    net, model = build(world, "ddp", 1, seed=1)
    try:
        if rank == 0:
            mx.full_state_dict(model, timeout=3.0)
            return "no error"
        if others == "exit":
            return "exited"
        dist.barrier()
        return "barrier passed"
    except RuntimeError as err:
        return str(err)


def bad_dst(rank: int, world: int) -> str:
    """Each rank passes its own rank as dst (or rank 1 an out-of-range one)."""
    net, model = build(world, "none", 1, seed=1)
    try:
        mx.full_state_dict(model, dst=rank if world > 2 else 5 * rank)
        return "no error"
    except ValueError as err:
        return str(err)


def _trained(world: int, wrap: str, dp: int, seed: int):
    """A Net of ``seed`` after one Adam step on this rank's tokens (the optimizer has
    state), its optimizer prepared for checkpoints."""
    net, model = build(world, wrap, dp, seed)
    opt = mx.prepare_optimizer(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(dist.get_rank() + seed))
    model(x).square().mean().backward()
    opt.step()
    return net, model, opt


def _expert_moments(net: Net, opt) -> tuple[int, list]:
    """(the global index of this rank's first expert row, its experts' Adam moments)."""
    layer, start = net.moe, net.moe.experts.first
    if isinstance(layer.experts.w1, DTensor):  # FSDP2's chunk
        mesh = layer.experts.w1.device_mesh
        start += mesh.get_local_rank() * -(-layer.experts.w1.shape[0] // mesh.size())
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    return start, [local(opt.state[p][k]).numpy().copy()
                   for p in (layer.experts.w1, layer.experts.w2)
                   for k in ("exp_avg", "exp_avg_sq")]  # fmt: skip


def _dcp_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def optimizer_save(rank: int, world: int, path: str, wrap: str, dp: int) -> tuple[int, list]:
    """dcp.save of a trained Net of seed 1 and its Adam state; returns its expert moments."""
    net, model, opt = _trained(world, wrap, dp, seed=1)
    dcp.save(_dcp_state(model, opt), checkpoint_id=path)
    return _expert_moments(net, opt)


def optimizer_load(rank: int, world: int, path: str, wrap: str, dp: int) -> tuple[int, list]:
    """A trained Net of seed 2 and its Adam state loaded from ``path``: its expert moments."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    net, model, opt = _trained(world, wrap, dp, seed=2)
    state = _dcp_state(model, opt)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    return _expert_moments(net, opt)


def state_dict_forms(rank: int, world: int) -> dict:
    """load_state_dict of each form an expert key may take, and the helpers' refusals."""
    out = {}
    layer = mx.ExpertParallelMoE(HIDDEN, FFN, EXPERTS, TOP_K, exchange="bf16", seed=1)
    want = expected(1)
    full = {"router": want["moe.router"], "experts.w1": want["moe.experts.w1"],
            "experts.w2": want["moe.experts.w2"]}  # fmt: skip
    mine = slice(layer.experts.first, layer.experts.first + EXPERTS // world)
    local = {k: v[mine] if k.startswith("experts") else v for k, v in full.items()}
    for form, state in (("full", full), ("local", local), ("dtensor", layer.state_dict())):
        other = mx.ExpertParallelMoE(HIDDEN, FFN, EXPERTS, TOP_K, exchange="bf16", seed=2)
        other.load_state_dict(state)
        out[form] = all(torch.equal(getattr(other.experts, n), full[f"experts.{n}"][mine])
                        for n in ("w1", "w2"))  # fmt: skip
    try:
        layer.load_state_dict({**full, "experts.w1": full["experts.w1"][:, :, :4]})
    except RuntimeError as err:
        out["wrong shape"] = str(err)
    try:
        mx.prepare_optimizer(torch.nn.Linear(2, 2), torch.optim.SGD([layer.router]))
    except ValueError as err:
        out["no layer"] = str(err)
    try:
        mx.load_full_state_dict(layer, {**full, "experts.w2": full["experts.w2"][:2]})
    except ValueError as err:
        out["partial"] = str(err)
    return out
