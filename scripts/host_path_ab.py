"""A/B of the two host-time shortcuts of eager calls: the cached Triton launch
(formats/launch.py; MXFP8_A2A_PUBLIC_LAUNCH=1 turns it off) and the custom-op bypass
(_common.eager_or_op; MXFP8_A2A_DISPATCHER=1 turns it off), on a whole eager MoE layer step
and on an eager exchange, each variant with the shortcuts on and off:

    torchrun --nproc-per-node=1 scripts/host_path_ab.py [--shape TxHxKxExF]... [--json F]

layer: ExpertParallelMoE (exchange "mxfp8", the host-synced dispatch) forward + backward
of bf16 tokens, with bf16 experts (the default) and with fp8_rowwise experts; exchange:
to_mxfp8_a2a_dequant forward + backward of TOKENSxDIM rows. Each timed sample is --steps
steps back to back (no sync inside), wall time per step on the host clock from a synced
start to a synced end, and the enqueue time (until the last step returned); the variants
alternate in --rounds rounds in one process, after warm-up; medians over rounds, max over
ranks. "saved" is 1 - time / time with both off. The variants' outputs are compared bit for
bit. On one GPU the group has one rank (the exchange runs its kernels and collectives,
without traffic). Without CUDA (gloo) it only checks that the script runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import versions, write_json  # noqa: E402

import mxfp8_a2a as mx  # noqa: E402
from mxfp8_a2a import _common  # noqa: E402
from mxfp8_a2a._torchrun import init_from_torchrun  # noqa: E402
from mxfp8_a2a.formats import launch  # noqa: E402
from mxfp8_a2a.moe.layer import ExpertParallelMoE  # noqa: E402

LAYER_SHAPES = ["1024x2048x8x16x768", "8192x2048x8x16x768", "4096x7168x8x32x2048"]
EXCHANGE_SHAPES = ["256x5120", "8192x5120"]
VARIANTS = {  # name: (cached launch, bypass)
    "both on": (True, True),
    "launch off": (False, True),
    "bypass off": (True, False),
    "both off": (False, False),
}


def set_variant(name: str) -> None:
    cached, bypass = VARIANTS[name]
    os.environ[launch.PUBLIC_LAUNCH_ENV] = "0" if cached else "1"  # read at every launch
    _common._BYPASS = bypass


def sample(step, steps: int, device) -> tuple[float, float]:
    """(wall, enqueue) us per step of ``steps`` steps back to back."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda device: None
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    t1 = time.perf_counter()
    sync(device)
    return (time.perf_counter() - t0) / steps * 1e6, (t1 - t0) / steps * 1e6


def ab(step, check, steps: int, rounds: int, device) -> dict[str, dict[str, float]]:
    first = None
    for name in VARIANTS:  # warm every path (compiles, caches), compare the outputs' bits
        set_variant(name)
        for _ in range(3):
            step()
        out = check()
        first = out if first is None else first
        if not all(torch.equal(a, b) for a, b in zip(out, first, strict=True)):
            raise AssertionError(f"{name}: outputs differ from {list(VARIANTS)[0]}")
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name in VARIANTS:
            set_variant(name)
            runs[name].append(sample(step, steps, device))
    set_variant("both on")
    res = {}
    for name, rows in runs.items():
        t = torch.tensor([statistics.median(r[i] for r in rows) for i in (0, 1)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        res[name] = {"wall_us": t[0].item(), "enqueue_us": t[1].item()}
    for name in VARIANTS:
        res[name]["saved"] = 1 - res[name]["wall_us"] / res["both off"]["wall_us"]
    return res


def layer_case(shape: str, precision: str, world: int, device, args) -> dict:
    tokens, hidden, top_k, experts, ffn = map(int, shape.split("x"))
    layer = ExpertParallelMoE(hidden, ffn, experts * world, top_k, precision=precision)
    layer = layer.to(device, torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(dist.get_rank())
    x = torch.randn(tokens, hidden, device=device, generator=g).bfloat16().requires_grad_(True)
    grad = torch.randn(tokens, hidden, device=device, generator=g).bfloat16()

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = layer(x)
        out.backward(grad)
        return out

    def check():
        out = step()
        return out.detach(), x.grad, layer.w1.grad, layer.w2.grad, layer.router.grad

    return ab(step, check, args.steps, args.rounds, device)


def exchange_case(shape: str, world: int, device, args) -> dict:
    tokens, dim = map(int, shape.split("x"))
    splits = [tokens // world] * world
    splits[dist.get_rank()] += tokens - sum(splits)
    out_splits = mx.compute_output_splits(splits)
    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(sum(out_splits), dim, device=device, dtype=torch.bfloat16)

    def step():
        x.grad = None
        out = mx.to_mxfp8_a2a_dequant(x, out_splits, splits)
        out.backward(grad)
        return out

    def check():
        return step().detach(), x.grad

    return ab(step, check, args.steps, args.rounds, device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", action="append", help="layer TOKENSxHIDDENxTOPKxEXPERTSxFFN")
    p.add_argument("--exchange-shape", action="append", help="exchange TOKENSxDIM")
    p.add_argument("--precision", action="append", help="experts (default: bf16, fp8_rowwise)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json")
    args = p.parse_args()
    device = init_from_torchrun()
    if device.type != "cuda":  # gloo: a smoke test of the script (tiny shapes), no timing
        print("no CUDA: the numbers below time nothing that matters", file=sys.stderr)
    world, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for shape in args.shape or LAYER_SHAPES:
        for precision in args.precision or ["bf16", "fp8_rowwise"]:
            key = f"layer {shape} mxfp8 exchange, {precision} experts"
            results[key] = layer_case(shape, precision, world, device, args)
    for shape in args.exchange_shape or EXCHANGE_SHAPES:
        results[f"exchange {shape} mxfp8"] = exchange_case(shape, world, device, args)
    if rank == 0:
        info = versions() | {"world_size": world, "fast_triton": launch.FAST_TRITON}
        print(" ".join(f"{k}={v}" for k, v in info.items()))
        print(f"{'case':58} {'variant':11} {'wall us':>8} {'enqueue':>8} {'saved':>6}")
        for key, res in results.items():
            for name, r in res.items():
                print(f"{key:58} {name:11} {r['wall_us']:8.0f} {r['enqueue_us']:8.0f} "
                      f"{r['saved']:6.1%}")  # fmt: skip
        write_json(args.json, {"info": info, "results": results})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
