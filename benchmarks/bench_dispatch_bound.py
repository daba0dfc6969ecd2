"""Dispatch + combine (forward and backward) against the bytes they must move through memory.

    torchrun --nproc-per-node=1 benchmarks/bench_dispatch_bound.py --json out.json

One rank by default (a group of one rank skips the exchange: memory bandwidth is the
ceiling): tokens x hidden, top-k of the rank's experts, host-synced and static paths,
bf16 and MXFP8 wires, expert rows y = rows (no expert compute). Per variant: the median ms of
forward and of forward + backward (CUDA events, a barrier and a sync before each step), the
byte model's bound at the copy bandwidth measured here, their ratio, and the GPU time of the
slowest kernels (torch.profiler). The model counts, per leg, its input read once, its output
written once and the wire rows four times (written by the encoder, read and written by the
exchange, read by the decoder; twice at one rank, which skips the exchange): dispatch
forward reads x [T, D] and writes the experts' rows [R, D] (R = T * k); combine forward the
reverse; combine backward also reads y once more (the
weights' gradient); wire rows cost D * 2 bytes (bf16) or D * 33 / 32 (MXFP8).
--ncu-step: run one untimed forward + backward per variant between cudaProfilerStart/Stop
(for ncu --profile-from-start off).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from common import Help, Timer, do_bench_ms, kernel_us, report, warm_gpu

import mxfp8_a2a as mx
from mxfp8_a2a.moe.routing import route

WIRE_BYTES = {"bf16": 2.0, "mxfp8": 33 / 32}  # per value on the wire


def model_bytes(tokens: int, dim: int, top_k: int, wire: str, backward: bool, world: int) -> dict:
    """The byte model of the module docstring: {"io": inputs and outputs, "wire": wire rows}."""
    t, r = tokens * dim * 2, tokens * top_k * dim * 2
    w = tokens * top_k * dim * WIRE_BYTES[wire]
    legs = 4 if backward else 2
    io = (t + r) * legs + (r if backward else 0)
    return {"io": io, "wire": (4 if world > 1 else 2) * w * legs}


def copy_gbps(nbytes: int = 1 << 31) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second / 1e9."""
    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = do_bench_ms(lambda: dst.copy_(src), rep_ms=500)
    return 2 * nbytes / ms / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--dim", type=int, default=7168, help="hidden size")
    p.add_argument("--experts", type=int, default=32, help="experts per rank")
    p.add_argument("--top-k", type=int, default=8, help="experts per token")
    p.add_argument("--iters", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--kernels", type=int, default=6, help="slowest kernels listed per variant")
    p.add_argument("--ncu-step", action="store_true", help="one profiled step per variant only")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    rank, cuda = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")  # (CPU: a smoke run)
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    experts = args.experts * world
    gen = torch.Generator(device=device).manual_seed(1 + dist.get_rank())
    x = torch.randn(args.tokens, args.dim, device=device, dtype=torch.bfloat16, generator=gen)
    g = torch.randn_like(x)
    logits = torch.randn(args.tokens, experts, device=device, generator=gen)
    weights, ids = route(logits, args.top_k)
    capacity = args.tokens * min(args.top_k, args.experts)  # dropless
    timer = Timer(device, args.iters, args.warmup)

    def step(path: str, wire: str, backward: bool):
        xi = x.detach().requires_grad_(backward)
        w = weights.detach().requires_grad_(backward)
        if path == "static":
            ex, _, h = mx.dispatch_static(xi, ids, experts, capacity, exchange=wire)
            out = mx.combine_static(ex, w, h)
        else:
            ex, _, h = mx.dispatch(xi, ids, experts, exchange=wire)
            out = mx.combine(ex, w, h)
        if backward:
            out.backward(g)

    if cuda and not args.ncu_step:
        warm_gpu()
    ceiling = copy_gbps() if cuda else float("nan")
    rows = []
    for path in ("synced", "static"):
        for wire in ("bf16", "mxfp8"):
            if args.ncu_step:
                step(path, wire, True)
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStart()
                step(path, wire, True)
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
                continue
            row = {"path": path, "wire": wire}
            for backward in (False, True):
                key = "fwd+bwd" if backward else "fwd"
                ms = timer(lambda _, p=path, w=wire, b=backward: step(p, w, b))
                m = model_bytes(args.tokens, args.dim, args.top_k, wire, backward, world)
                bound = (m["io"] + m["wire"]) / ceiling / 1e6
                row |= {f"{key} ms": ms, f"{key} bound ms": bound, f"{key} / bound": ms / bound}
                row[f"{key} GB"] = (m["io"] + m["wire"]) / 1e9
            kernels = kernel_us(lambda p=path, w=wire: step(p, w, True), calls=5) if cuda else {}
            top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[: args.kernels]
            row["kernel us (fwd+bwd)"] = sum(us for us, _ in kernels.values())
            row["slowest kernels"] = [(name[:60], round(us), n) for name, (us, n) in top]
            rows.append(row)
    if args.ncu_step or dist.get_rank() != 0:
        dist.destroy_process_group()
        return
    print(f"{args.tokens} tokens x {args.dim}, top-{args.top_k} of {experts} experts, "
          f"EP {world}; copy ceiling {ceiling:.0f} GB/s (read + write)")  # fmt: skip
    for r in rows:
        print(f"{r['path']} {r['wire']}: " + "; ".join(f"{n} {us} us x{c}"
              for n, us, c in r["slowest kernels"]))  # fmt: skip
    table = [{k: v for k, v in r.items() if k != "slowest kernels"} for r in rows]
    report(table, args.json)
    if args.json:  # the kernel lists too
        import json

        with open(args.json) as f:
            payload = json.load(f)
        payload |= {"copy_GBps": ceiling, "kernels": rows}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
