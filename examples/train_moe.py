"""Train a tiny expert-parallel MoE model on synthetic regression data.

    torchrun --nproc-per-node=2 examples/train_moe.py --steps 60 --exchange mxfp8
    torchrun --nproc-per-node=2 examples/train_moe.py --exchange mxfp8 --precision fp8_rowwise \
        --dtype bfloat16

Each rank draws its own batches (fixed seed); the target is a fixed random teacher network.
The model is a stack of residual MoE layers (mxfp8_a2a.ExpertParallelMoE) with experts
spread over the ranks, trained data-parallel the public way: --wrap ddp (default)
prepares it with mx.prepare_ddp and wraps it in DistributedDataParallel (routers and head
averaged by DDP, each rank's experts left to it); --wrap fsdp2 shards the experts with
mx.shard_experts and the rest with fully_shard. --exchange picks dispatch/combine's
exchange, --precision the experts' grouped GEMMs (fp8_rowwise: FP8 on sm_90+ GPUs, its
plain-torch reference on CPU), --dtype the activations' dtype (parameters and the
optimizer stay fp32; the loss is taken in fp32). NCCL on GPUs, gloo on CPU. Prints the loss
(mean over ranks) as it goes and, last, ``final loss: <value>``, the mean over the last
tenth of the steps; --json writes the curve.
Before that it prints the loss on held-out tokens (the same in every run), averaged over those
steps, twice: with the run's own exchange and precision, and with bf16 exchanges and experts
(the trained weights' quality without the FP8 forward's rounding noise).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import mxfp8_a2a as mx
from mxfp8_a2a import ExpertParallelMoE
from mxfp8_a2a._torchrun import init_from_torchrun
from mxfp8_a2a.grouped.gemm import PRECISIONS
from mxfp8_a2a.moe import EXCHANGES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class TinyMoE(torch.nn.Module):
    def __init__(self, args, group=None):
        super().__init__()
        world = dist.get_world_size(group)
        transport = mx.CopyEngineTransport(group) if args.transport == "copy_engine" else "nccl"
        self.layers = torch.nn.ModuleList(
            ExpertParallelMoE(
                args.hidden,
                args.ffn,
                args.experts_per_rank * world,
                args.top_k,
                group,
                exchange=args.exchange,
                transport=transport,
                precision=args.precision,
                seed=args.seed + i,
            )
            for i in range(args.layers)
        )
        g = torch.Generator().manual_seed(args.seed + 1000)
        self.head = torch.nn.Parameter(
            torch.randn(args.hidden, args.out, generator=g) * args.hidden**-0.5
        )

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(torch.nn.functional.layer_norm(x, x.shape[-1:]))
        return x @ self.head.to(x.dtype)


def teacher(x: torch.Tensor, seed: int, out: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 2000)
    h = x.shape[1]
    w1 = (torch.randn(h, 4 * h, generator=g) * h**-0.5).to(x.device)
    w2 = (torch.randn(4 * h, out, generator=g) * (4 * h) ** -0.5).to(x.device)
    return torch.tanh(x @ w1) @ w2


@torch.no_grad()
def evaluate(model: TinyMoE, x: torch.Tensor, target: torch.Tensor, args, world: int) -> dict:
    """The MSE on held-out tokens (mean over ranks) with the run's exchange and precision
    ("own") and with exchange="bf16" and precision="bf16" ("bf16": nothing quantized, in the
    activations' dtype), the same weights."""
    losses = {}
    try:
        for name, exchange, precision in (
            ("own", args.exchange, args.precision),
            ("bf16", "bf16", "bf16"),
        ):
            if name == "bf16" and (args.exchange, args.precision) == ("bf16", "bf16"):
                losses[name] = losses["own"]  # the same layers: the same loss
                continue
            for layer in model.layers:
                layer.exchange, layer.precision = exchange, precision
            pred = model(x.to(DTYPES[args.dtype])).float()
            loss = torch.nn.functional.mse_loss(pred, target)
            dist.all_reduce(loss)
            losses[name] = loss.item() / world
    finally:
        for layer in model.layers:
            layer.exchange, layer.precision = args.exchange, args.precision
    return losses


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--exchange", choices=EXCHANGES, default="mxfp8")
    p.add_argument(
        "--transport",
        choices=("nccl", "copy_engine"),
        default="nccl",
        help="how the MXFP8 exchanges move rows (copy_engine: two ranks on CUDA GPUs)",
    )
    p.add_argument("--wrap", choices=("ddp", "fsdp2"), default="ddp", help="data parallelism")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16", help="experts' GEMMs")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="activations")
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank per step")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--out", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts-per-rank", type=int, default=2)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument(
        "--eval-tokens", type=int, help="held-out tokens per rank (default: 4 * --tokens)"
    )
    p.add_argument("--json", help="write the loss curve here (rank 0)")
    args = p.parse_args()

    device = init_from_torchrun()
    rank, world = dist.get_rank(), dist.get_world_size()
    net = model = TinyMoE(args).to(device)
    if args.wrap == "ddp":  # every rank's experts its own, the rest averaged by DDP
        mx.prepare_ddp(net)
        model = torch.nn.parallel.DistributedDataParallel(net)
    else:  # experts sharded over the ranks that hold them (here: one each), the rest over all
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (1, world), mesh_dim_names=("dp", "ep"))
        mx.shard_experts(net, mesh["dp"])
        fully_shard(net, mesh=init_device_mesh(device.type, (world,)))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(args.seed * 7919 + rank)
    held_out = torch.Generator().manual_seed(10**6 + rank)  # the same tokens in every run
    n_eval = args.eval_tokens or 4 * args.tokens
    x_eval = torch.randn(n_eval, args.hidden, generator=held_out).to(device)
    y_eval = teacher(x_eval, args.seed, args.out)
    tail_steps = max(1, args.steps // 10)  # one step's batch is noise at small losses
    evals = {"own": 0.0, "bf16": 0.0}
    curve, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        x = torch.randn(args.tokens, args.hidden, generator=data).to(device)
        pred = model(x.to(DTYPES[args.dtype])).float()
        loss = torch.nn.functional.mse_loss(pred, teacher(x, args.seed, args.out))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # gradients of the mean of the ranks' losses
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean = mean.item() / world
        curve.append(mean)
        if step > args.steps - tail_steps:
            for name, value in evaluate(net, x_eval, y_eval, args, world).items():
                evals[name] += value / tail_steps
        if rank == 0 and (step % args.log_every == 0 or step == 1):
            print(
                f"step {step:5d}  loss {mean:.6f}  ({time.perf_counter() - start:.1f} s)",
                flush=True,
            )
    if rank == 0:
        own = f"exchange={args.exchange}, precision={args.precision}, {args.dtype} activations"
        print(f"eval loss ({own}): {evals['own']:.6f}")
        plain = f"plain {args.dtype} exchange, unscaled {args.dtype} experts"
        print(f"eval loss ({plain}): {evals['bf16']:.6f}")
        if args.json:
            with open(args.json, "w") as f:
                record = {"args": vars(args), "world_size": world, "loss": curve, "eval": evals}
                json.dump(record, f)
        tail = curve[-tail_steps:]
        print(f"final loss: {sum(tail) / len(tail):.6f}", flush=True)
    for layer in net.layers:  # a CopyEngineTransport owns symmetric memory: free it
        if isinstance(layer.transport, mx.CopyEngineTransport):
            layer.transport.close()
    del model, opt  # DDP's reducer holds the process group: let it go before the group
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
