"""Host time per exchange call: what the CPU spends issuing one call (small exchanges are
bound by it), bf16 vs MXFP8.

    torchrun --nproc-per-node=1 benchmarks/bench_host_time.py --shape 256x5120

For each case, ``--calls`` calls back to back (after warm-up), timed on the host clock
without synchronizing inside the loop; the median per call over ``--repeats`` loops, max
over ranks. bf16 is the library's differentiable exchange of unquantized rows
(mxfp8_a2a.exchange.plain.all_to_all_rows: a plain differentiable all-to-all). Cases:
no-grad forward, forward with grad, forward+backward. On one GPU the group has one rank
(the exchange goes through the same kernels and collective calls, with no traffic): it
measures host time, not speed. ``--python-profile``: rank 0 also
prints the Python functions that take the host's time in 50 MXFP8 forward+backward calls of
the first shape (cProfile, by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch
import torch.distributed as dist
from common import Help, parse_shape, versions, write_json
from tabulate import tabulate

import mxfp8_a2a as mx
from mxfp8_a2a.exchange.plain import all_to_all_rows


def init_from_torchrun() -> torch.device:
    """NCCL with one GPU per process (LOCAL_RANK) where CUDA is present, gloo otherwise."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def per_call_us(fn, calls: int, repeats: int, device) -> float:
    for _ in range(3):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    times = []
    for _ in range(repeats):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        sync()
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def time_shape(text: str, world: int, rank: int, device, calls: int, repeats: int) -> dict:
    tokens, dim = parse_shape(text)
    splits = [tokens // world] * world
    splits[rank] += tokens - sum(splits)
    out_splits = mx.compute_output_splits(splits)
    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    grad = torch.randn(sum(out_splits), dim, device=device, dtype=torch.bfloat16)
    fns = {
        "bf16": lambda t: all_to_all_rows(t, out_splits, splits),
        "mxfp8": lambda t: mx.to_mxfp8_a2a_dequant(t, out_splits, splits),
    }
    out = {}
    for name, f in fns.items():
        res = {}
        with torch.no_grad():
            res["fwd no-grad"] = per_call_us(lambda f=f: f(x), calls, repeats, device)
        res["fwd"] = per_call_us(lambda f=f: f(xg), calls, repeats, device)
        res["fwd+bwd"] = per_call_us(lambda f=f: f(xg).backward(grad), calls, repeats, device)
        out[name] = res
    return out


def python_profile(text: str, world: int, rank: int, device) -> str:
    tokens, dim = parse_shape(text)
    splits = [tokens // world] * world
    splits[rank] += tokens - sum(splits)
    out_splits = mx.compute_output_splits(splits)
    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(sum(out_splits), dim, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        mx.to_mxfp8_a2a_dequant(x, out_splits, splits).backward(grad)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        mx.to_mxfp8_a2a_dequant(x, out_splits, splits).backward(grad)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    return f"{text} MXFP8 fwd+bwd, Python profile of 50 calls:\n{out.getvalue()}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    p.add_argument("--shape", action="append", help="TOKENSxDIM per rank (repeatable)")
    p.add_argument("--calls", type=int, default=50, help="calls per timed loop")
    p.add_argument("--repeats", type=int, default=7, help="timed loops (median)")
    p.add_argument("--json", help="write the results here (rank 0)")
    p.add_argument("--python-profile", action="store_true", help="also profile (see above)")
    args = p.parse_args()
    device = init_from_torchrun()
    world, rank = dist.get_world_size(), dist.get_rank()
    rows, results = [], {}
    for text in args.shape or ["256x5120"]:
        for name, res in time_shape(text, world, rank, device, args.calls, args.repeats).items():
            results[f"{text} {name}"] = res
            rows.append([text, name, *res.values()])
    if rank == 0:
        info = versions() | {"world_size": world}
        print(" ".join(f"{k}={v}" for k, v in info.items()))
        headers = ["shape", "exchange", "fwd no-grad us", "fwd us", "fwd+bwd us"]
        print(tabulate(rows, headers=headers, floatfmt=".1f"))
        write_json(args.json, {"info": info, "results": results})
    if args.python_profile:
        report = python_profile((args.shape or ["256x5120"])[0], world, rank, device)
        if rank == 0:
            print(report)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
