"""Workers of test_layer_parallel.py: a small model with an ExpertParallelMoE layer trained on
one global batch per step at several world sizes, unwrapped (one rank), under DDP
(prepare_ddp) and FSDP2 (shard_experts), on a (data-parallel x expert-parallel) mesh."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import mxfp8_a2a as mx

HIDDEN, FFN, EXPERTS, TOP_K, TOKENS, STEPS = 32, 32, 8, 2, 96, 12


class Net(torch.nn.Module):
    """pre (dense) -> MoE layer (residual) -> head (dense)."""

    def __init__(self, group, exchange: str, static: bool):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.pre = torch.nn.Linear(HIDDEN, HIDDEN)
        with torch.no_grad():
            self.pre.weight.copy_(torch.randn(HIDDEN, HIDDEN, generator=g) * HIDDEN**-0.5)
            self.pre.bias.zero_()
        kw = {"capacity_factor": float(EXPERTS), "max_tokens": TOKENS} if static else {}
        self.moe = mx.ExpertParallelMoE(HIDDEN, FFN, EXPERTS, TOP_K, group, exchange=exchange,
                                        seed=3, **kw)  # fmt: skip
        self.head = torch.nn.Parameter(torch.randn(HIDDEN, 4, generator=g) * HIDDEN**-0.5)

    def forward(self, x):
        h = self.pre(x)
        return (h + self.moe(h)) @ self.head


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: x [TOKENS, HIDDEN], target [TOKENS, 4]."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(TOKENS, HIDDEN, generator=g)
    return x, torch.tanh(x[:, :4] * 2)


def train(
    rank: int,
    world: int,
    configs: list[tuple[str, int, str, bool]],
    state: dict | None = None,
    device: str = "cpu",
) -> list[dict]:
    """With ``state`` (a full_state_dict as numpy arrays), first :func:`checkpoint_round_trip`
    (its result is the last item). Each config (wrap "none"/"ddp"/"fsdp2", data-parallel
    size, exchange, static): STEPS Adam steps on the global batch split over the ranks;
    returns per config the loss curve (mean over ranks), the router of every rank, and (on
    rank 0) the full layer, the pre and head weights."""
    out = []
    back = None if state is None else checkpoint_round_trip(state)
    for wrap, dp, exchange, static in configs:
        ep = world // dp
        mesh = init_device_mesh(device, (dp, ep), mesh_dim_names=("dp", "ep"))
        net = Net(mesh["ep"], exchange, static).to(device)
        model = net
        if wrap == "ddp":
            mx.prepare_ddp(net, mesh["dp"] if dp > 1 else None)
            model = torch.nn.parallel.DistributedDataParallel(net)
        elif wrap == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            mx.shard_experts(net, mesh["dp"])
            fully_shard(net, mesh=init_device_mesh(device, (world,)))
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        curve = []
        for step in range(STEPS):
            x, y = (t.to(device) for t in batch(step))
            share = TOKENS // world
            mine = slice(rank * share, (rank + 1) * share)
            loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            curve.append(mean.item() / world)
        full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
        routers = [torch.empty_like(full(net.moe.router)) for _ in range(world)]
        dist.all_gather(routers, full(net.moe.router).detach().contiguous())
        layer = None
        for replica in range(dp):  # each expert-parallel group's layer on its first rank
            layer = mx.full_state_dict(net.moe, dst=replica * ep) or layer
        layers = [None] * world
        dist.all_gather_object(layers, layer)
        result = {"loss": curve, "routers": routers, "layers": [s for s in layers if s]}
        result["pre"] = full(net.pre.weight).detach().clone()
        result["head"] = full(net.head).detach().clone()
        out.append(result if rank == 0 else {"routers": routers})
    return _numpy(out if back is None else [*out, back])


def checkpoint_round_trip(state: dict) -> dict | None:
    """A full state dict (any group size) loaded at this one, saved and loaded locally
    (state_dict), gathered back: the same tensors on rank 0."""
    layer = mx.ExpertParallelMoE(HIDDEN, FFN, EXPERTS, TOP_K, seed=11)
    mx.load_full_state_dict(layer, {k: torch.from_numpy(v) for k, v in state.items()})
    other = mx.ExpertParallelMoE(HIDDEN, FFN, EXPERTS, TOP_K, seed=12)
    other.load_state_dict(layer.state_dict())  # (experts as DTensors over the group)
    return mx.full_state_dict(other)


def _numpy(obj):
    """Tensors as numpy arrays: pickled by value through the result queue (tensors would be
    shared by file descriptor, which outlives no worker)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: _numpy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_numpy(v) for v in obj)
    return obj
