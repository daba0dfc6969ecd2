"""Profile one exchange configuration: where the host and GPU time of a call goes.

    torchrun --nproc-per-node=2 scripts/profile_exchange.py --shape 131072x5120 --chunks 4 --out DIR

Runs warm-up calls, then profiles a few forward+backward calls with torch.profiler (CPU and
CUDA activities), prints the top operators by self CPU time and by CUDA time on rank 0,
and writes a Chrome trace per rank (DIR/trace_rank{r}.json). Built to find the fixed cost
per pipeline step that BENCHMARKS.md reports.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import mxfp8_a2a as mx
from mxfp8_a2a._launch import init_from_torchrun


def print_timeline(trace_path: str) -> None:
    """GPU kernels of the last profiled call (after the last cudaDeviceSynchronize-free gap):
    start and end in us from the first kernel of that call, stream, name."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: float(e["ts"]))
    # calls are separated by the barrier-free host loop; take the kernels of the last call:
    # from the last quantize kernel that starts a forward (the first of the last 2 * per_call)
    per_call = len(kernels) // max(1, CALLS)
    last = kernels[-per_call:]
    t0 = float(last[0]["ts"])
    print(f"GPU timeline of the last call ({per_call} kernels), us:")
    for e in last:
        start = float(e["ts"]) - t0
        print(
            f"{start:9.1f} {start + float(e['dur']):9.1f}  stream {e['args'].get('stream')}"
            f"  {e['name'][:60]}"
        )


CALLS = 5


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="8192x5120", help="TOKENSxDIM per rank")
    p.add_argument("--chunks", default="1", help="an int, or 'auto'")
    p.add_argument("--calls", type=int, default=CALLS)
    p.add_argument("--out", default="profile_out")
    p.add_argument(
        "--cold", action="store_true", help="forward only, each after a barrier and a sync"
    )
    args = p.parse_args()
    device = init_from_torchrun()
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, dim = (int(v) for v in args.shape.lower().split("x"))
    chunks = None if args.chunks == "auto" else int(args.chunks)
    splits = [tokens // world] * world
    splits[rank] += tokens - sum(splits)
    out_splits = mx.compute_output_splits(splits)
    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)
    grad = torch.randn(sum(out_splits), dim, device=device, dtype=torch.bfloat16)

    def call():
        if args.cold:  # as the benchmark times a forward: barrier, sync, one call
            dist.barrier()
            torch.cuda.synchronize()
            with torch.no_grad():
                mx.to_mxfp8_a2a_dequant(x, out_splits, splits, chunks=chunks)
            return
        y = mx.to_mxfp8_a2a_dequant(
            x.detach().requires_grad_(True), out_splits, splits, chunks=chunks
        )
        y.backward(grad)

    for _ in range(5):
        call()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    dist.barrier()
    with profile(activities=activities) as prof:
        for _ in range(args.calls):
            call()
        if device.type == "cuda":
            torch.cuda.synchronize()
    os.makedirs(args.out, exist_ok=True)
    prof.export_chrome_trace(os.path.join(args.out, f"trace_rank{rank}.json"))
    if rank == 0:
        print_timeline(os.path.join(args.out, f"trace_rank{rank}.json"))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        if device.type == "cuda":
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
