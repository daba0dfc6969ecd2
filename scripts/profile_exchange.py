"""Profile one exchange configuration: where the host and GPU time of a call goes.

    torchrun --nproc-per-node=2 scripts/profile_exchange.py --shape 131072x5120 --chunks 4 --out DIR

With --graph the call is captured once in a CUDA graph and its replays are profiled.

Runs warm-up calls, then profiles a few forward+backward calls with torch.profiler (CPU and
CUDA activities), writes a Chrome trace per rank (DIR/trace_rank{r}.json; DIR must be one
folder all ranks see), and on rank 0 prints the GPU timeline of the last call of every rank
on one clock, then the top operators by self CPU time and by CUDA time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import mxfp8_a2a as mx
from mxfp8_a2a._launch import capture_graph, init_from_torchrun

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_a2a import _Bf16AllToAll, chunk_arguments  # noqa: E402


def print_timeline(trace_paths: list[str], calls: int) -> None:
    """GPU kernels and copies of the last profiled call on every rank, on one clock (the
    traces of one host share it): start and end in us from the earliest first kernel of that
    call, rank, stream, name. Shows whether a collective waits for a peer that started it later."""
    rows, firsts = [], []
    for rank, path in enumerate(trace_paths):
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        kernels = sorted(
            (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy")),
            key=lambda e: float(e["ts"]),
        )
        per_call = len(kernels) // max(1, calls)
        if per_call == 0:
            continue
        last = kernels[-per_call:]
        firsts.append(float(last[0]["ts"]))
        rows += [(float(e["ts"]), float(e["dur"]), rank, e) for e in last]
    if not rows:
        print("no GPU kernels in the traces")
        return
    t0 = min(firsts)
    print(f"GPU timeline of the last call ({len(rows) // len(firsts)} kernels per rank), us:")
    for ts, dur, rank, e in sorted(rows, key=lambda r: r[0]):
        start = ts - t0
        print(
            f"{start:9.1f} {start + dur:9.1f}  rank {rank} stream {e['args'].get('stream')}"
            f"  {e['name'][:60]}"
        )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="8192x5120", help="TOKENSxDIM per rank")
    p.add_argument(
        "--chunks", default="1",
        help="an int, 'auto', or 'ce:C' (transport='copy_engine', C row ranges or 'auto')",
    )  # fmt: skip
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--out", default="profile_out")
    p.add_argument(
        "--cold", action="store_true", help="forward only, each after a barrier and a sync"
    )
    p.add_argument("--bf16", action="store_true", help="profile the bf16 baseline instead")
    p.add_argument(
        "--graph", action="store_true",
        help="profile replays of the call captured in a CUDA graph (an integer --chunks)",
    )  # fmt: skip
    args = p.parse_args()
    device = init_from_torchrun()
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, dim = (int(v) for v in args.shape.lower().split("x"))
    how = chunk_arguments(args.chunks)
    splits = [tokens // world] * world
    splits[rank] += tokens - sum(splits)
    out_splits = mx.compute_output_splits(splits)
    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)
    grad = torch.randn(sum(out_splits), dim, device=device, dtype=torch.bfloat16)

    def exchange(x_):
        if args.bf16:
            return _Bf16AllToAll.apply(x_, out_splits, splits)
        return mx.to_mxfp8_a2a_dequant(x_, out_splits, splits, **how)

    def body():
        if args.cold:
            with torch.no_grad():
                exchange(x)
            return
        exchange(x.detach().requires_grad_(True)).backward(grad)

    run = capture_graph(body)[0].replay if args.graph else body

    def call():
        if args.cold:  # as the benchmark times a forward: barrier, sync, one call
            dist.barrier()
            torch.cuda.synchronize()
        run()

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
    dist.barrier()
    if rank == 0:
        paths = [os.path.join(args.out, f"trace_rank{r}.json") for r in range(world)]
        print_timeline(paths, args.calls)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        if device.type == "cuda":
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
