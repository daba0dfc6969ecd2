"""Train a tiny expert-parallel MoE model on synthetic regression data, checkpoint it and
load it back: the public API end to end.

    torchrun --nproc-per-node=2 examples/train_moe.py --steps 60 --exchange mxfp8
    torchrun --nproc-per-node=2 examples/train_moe.py --exchange mxfp8 --precision fp8_rowwise \
        --dtype bfloat16
    torchrun --nproc-per-node=4 examples/train_moe.py --dp 2 --wrap fsdp2 \
        --max-tokens 256 --capacity-factor 2 --checkpoint /tmp/moe_ckpt

Each rank draws its own batches (fixed seed); the target is a fixed random teacher network.
The model is a stack of residual MoE layers (mxfp8_a2a.ExpertParallelMoE) on a (data x expert)
mesh of the ranks: --dp replicas of each expert (default 1: every rank holds its own experts),
the experts spread over the world / dp ranks of each replica. Data parallelism the public way:
--wrap ddp (default) prepares the model with mx.prepare_ddp(net, mesh["dp"]) and wraps it in
DistributedDataParallel (routers and head averaged by DDP, the experts' gradients averaged over
their replicas); --wrap fsdp2 shards the experts with mx.shard_experts over mesh["dp"] and the
rest with fully_shard. --exchange picks the wire of dispatch and combine's legs (a preset of
mx.EXCHANGES), --precision the experts' grouped GEMMs (fp8_rowwise: FP8 on sm_90+ GPUs, its
plain-torch reference on CPU), --dtype the activations' dtype (parameters and the optimizer
stay fp32; the loss is taken in fp32; "bf16" exchanges and experts run in this dtype).
--max-tokens with --capacity-factor (or --capacity) switches to the static dispatch (no host
sync; every rank may pass up to --max-tokens tokens per call). NCCL on GPUs, gloo on CPU.

Prints the loss (mean over ranks) as it goes and, last, ``final loss: <value>``, the mean over
the last tenth of the steps; --json writes the curve. Before that it prints the loss on
held-out tokens (the same in every run), averaged over those steps, twice: with the run's own
exchange and precision, and with bf16 exchanges and experts (the trained weights' quality
without the FP8 forward's rounding noise). With --checkpoint DIR it saves the model with
torch.distributed.checkpoint (dcp.save of model.state_dict(): every rank's experts kept),
loads it into a fresh model and prints ``checkpoint: reloaded, held-out loss equal``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

import mxfp8_a2a as mx

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's lines and shows each option's default."""


def init_process_group() -> torch.device:
    """Join the torchrun group: NCCL with GPU LOCAL_RANK where CUDA is present, else gloo."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


class TinyMoE(torch.nn.Module):
    def __init__(self, args, group=None):
        super().__init__()
        world = dist.get_world_size(group)
        transport = mx.CopyEngineTransport(group) if args.transport == "copy_engine" else "nccl"
        static = {}  # the static dispatch: a capacity agreed by every rank
        if args.capacity is not None:
            static = {"capacity": args.capacity}
        elif args.capacity_factor is not None:
            static = {"capacity_factor": args.capacity_factor, "max_tokens": args.max_tokens}
        self.layers = torch.nn.ModuleList(
            mx.ExpertParallelMoE(
                args.hidden,
                args.ffn,
                args.experts_per_rank * world,
                args.top_k,
                group,
                exchange=args.exchange,
                transport=transport,
                precision=args.precision,
                seed=args.seed + i,
                **static,
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
            chunks = x.to(DTYPES[args.dtype]).split(args.max_tokens or x.shape[0])
            pred = torch.cat([model(chunk) for chunk in chunks]).float()  # (max_tokens a call)
            loss = torch.nn.functional.mse_loss(pred, target)
            dist.all_reduce(loss)
            losses[name] = loss.item() / world
    finally:
        for layer in model.layers:
            layer.exchange, layer.precision = args.exchange, args.precision
    return losses


def build(args, mesh, device) -> tuple[TinyMoE, torch.nn.Module, torch.optim.Optimizer]:
    """(the model, it wrapped for data parallelism, its optimizer) on the (dp, ep) mesh."""
    net = model = TinyMoE(args, mesh["ep"]).to(device)
    if args.wrap == "ddp":  # experts averaged over their replicas only, the rest by DDP
        mx.prepare_ddp(net, mesh["dp"])
        model = torch.nn.parallel.DistributedDataParallel(net)
    else:  # experts sharded over their replicas, the rest over all ranks
        from torch.distributed.fsdp import fully_shard

        mx.shard_experts(net, mesh["dp"])
        fully_shard(net, mesh=init_device_mesh(device.type, (dist.get_world_size(),)))
    return net, model, torch.optim.Adam(model.parameters(), lr=args.lr)


def reload_checkpoint(args, model, net, mesh, device, x_eval, y_eval, world) -> None:
    """dcp.save the trained model, dcp.load it into a fresh one: the held-out loss must be the
    same (every rank's experts came back)."""
    before = evaluate(net, x_eval, y_eval, args, world)
    dcp.save({"model": model.state_dict()}, checkpoint_id=args.checkpoint)
    args.seed += 1  # a fresh model with other weights, to load into
    fresh_net, fresh, _ = build(args, mesh, device)
    args.seed -= 1
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=args.checkpoint)
    fresh.load_state_dict(state["model"])
    after = evaluate(fresh_net, x_eval, y_eval, args, world)
    if after != before:
        raise RuntimeError(f"checkpoint: held-out loss {before} before, {after} after reloading")
    if dist.get_rank() == 0:
        print(f"checkpoint: reloaded, held-out loss equal ({after['own']:.6f})", flush=True)
    del fresh


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--exchange", choices=mx.EXCHANGES, default="mxfp8", help="legs' wires")
    p.add_argument(
        "--transport",
        choices=("nccl", "copy_engine"),
        default="nccl",
        help="how the MXFP8 exchanges move rows (copy_engine: two ranks on CUDA GPUs)",
    )
    p.add_argument("--wrap", choices=("ddp", "fsdp2"), default="ddp", help="data parallelism")
    p.add_argument("--dp", type=int, default=1, help="replicas of each expert (divides world)")
    p.add_argument("--precision", choices=mx.PRECISIONS, default="bf16", help="experts' GEMMs")
    p.add_argument("--max-tokens", type=int, help="static dispatch: most tokens per rank")
    p.add_argument("--capacity-factor", type=float, help="static dispatch (with --max-tokens)")
    p.add_argument("--capacity", type=int, help="static dispatch: rows per rank pair")
    p.add_argument("--checkpoint", help="save with dcp here, reload into a fresh model")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="activations")
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank per step")
    p.add_argument("--hidden", type=int, default=128, help="model width")
    p.add_argument("--ffn", type=int, default=256, help="experts' inner width")
    p.add_argument("--out", type=int, default=16, help="regression outputs")
    p.add_argument("--layers", type=int, default=2, help="MoE layers")
    p.add_argument("--experts-per-rank", type=int, default=2, help="of each replica")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    p.add_argument("--seed", type=int, default=0, help="weights, teacher, batches")
    p.add_argument("--log-every", type=int, default=10, help="steps between loss lines")
    p.add_argument(
        "--eval-tokens", type=int, help="held-out tokens per rank (default: 4 * --tokens)"
    )
    p.add_argument("--json", help="write the loss curve here (rank 0)")
    args = p.parse_args()

    device = init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.capacity_factor is not None and args.max_tokens is None:
        args.max_tokens = args.tokens
    if world % args.dp:
        p.error(f"--dp {args.dp} must divide the world size {world}")
    mesh = init_device_mesh(device.type, (args.dp, world // args.dp), mesh_dim_names=("dp", "ep"))
    net, model, opt = build(args, mesh, device)
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
        plain = f'exchange="bf16" (rows unquantized, in {args.dtype}), precision="bf16"'
        print(f"eval loss ({plain}): {evals['bf16']:.6f}")
        if args.json:
            with open(args.json, "w") as f:
                record = {"args": vars(args), "world_size": world, "loss": curve, "eval": evals}
                json.dump(record, f)
    if args.checkpoint:
        reload_checkpoint(args, model, net, mesh, device, x_eval, y_eval, world)
    if rank == 0:
        tail = curve[-tail_steps:]
        print(f"final loss: {sum(tail) / len(tail):.6f}", flush=True)
    for layer in net.layers:  # a CopyEngineTransport owns symmetric memory: free it
        if isinstance(layer.transport, mx.CopyEngineTransport):
            layer.transport.close()
    del model, opt  # DDP's reducer holds the process group: let it go before the group
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
