"""Host time per call of the eager MXFP8 exchange and of its bf16 baseline, with and without
autograd, and of the exchange inside a forward+backward by thread.

    torchrun --nproc-per-node=2 scripts/host_trace.py 256x5120

Each row: wall clock of 300 back-to-back calls / 300 after 20 warm-up calls, rank 0, us.
The last lines split the exchange_columns calls inside the forward+backward loop by the
thread they ran on (the autograd engine runs the backward on its own device thread).
"""

from __future__ import annotations

import sys
import threading
import time

import torch
import torch.distributed as dist

import mxfp8_a2a.a2a as a2a
from mxfp8_a2a import to_mxfp8_a2a_dequant
from mxfp8_a2a._launch import init_from_torchrun

CALLS, WARMUP = 300, 20


class _Bf16AllToAll(torch.autograd.Function):
    """The baseline: all_to_all_single forward, the same with splits swapped backward."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits):
        ctx.splits = out_splits, in_splits
        out = x.new_empty((sum(out_splits), x.shape[1]))
        dist.all_to_all_single(out, x, out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        gx = grad.new_empty((sum(in_splits), grad.shape[1]))
        dist.all_to_all_single(gx, grad.contiguous(), in_splits, out_splits)
        return gx, None, None


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def main() -> None:
    device = init_from_torchrun()
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, dim = (int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "256x5120").split("x"))
    splits = [tokens // world] * world
    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)
    xg, g = x.clone().requires_grad_(True), torch.randn_like(x)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def per_call(fn) -> float:
        for _ in range(WARMUP):
            fn()
        sync()
        dist.barrier()
        sync()
        t0 = time.perf_counter_ns()
        for _ in range(CALLS):
            fn()
        us = (time.perf_counter_ns() - t0) / CALLS / 1e3
        sync()
        return us

    # the exchange inside forward+backward, timed by thread
    by_thread: dict[str, list[int]] = {"main": [], "autograd": []}
    main_thread = threading.get_ident()
    exchange = a2a.exchange_columns

    def timed_exchange(*args):
        t0 = time.perf_counter_ns()
        out = exchange(*args)
        name = "main" if threading.get_ident() == main_thread else "autograd"
        by_thread[name].append(time.perf_counter_ns() - t0)
        return out

    rows = []
    with torch.no_grad():
        rows.append(
            ("mxfp8 fwd (no grad)", per_call(lambda: to_mxfp8_a2a_dequant(x, splits, splits)))
        )
        rows.append(
            (
                "exchange_columns alone",
                per_call(lambda: exchange(x, splits, splits, None, "rceil", 1)),
            )
        )
        y = torch.empty_like(x)
        rows.append(
            (
                "bf16 all_to_all_single",
                per_call(lambda: dist.all_to_all_single(y, x, splits, splits)),
            )
        )
    rows.append(("mxfp8 fwd (grad)", per_call(lambda: to_mxfp8_a2a_dequant(xg, splits, splits))))
    rows.append(
        ("bf16 Function fwd (grad)", per_call(lambda: _Bf16AllToAll.apply(xg, splits, splits)))
    )
    rows.append(
        ("mxfp8 fwd+bwd", per_call(lambda: to_mxfp8_a2a_dequant(xg, splits, splits).backward(g)))
    )
    rows.append(
        (
            "bf16 Function fwd+bwd",
            per_call(lambda: _Bf16AllToAll.apply(xg, splits, splits).backward(g)),
        )
    )
    rows.append(("trivial Function fwd+bwd", per_call(lambda: _Identity.apply(xg).backward(g))))
    a2a.exchange_columns = timed_exchange
    try:
        per_call(lambda: to_mxfp8_a2a_dequant(xg, splits, splits).backward(g))
    finally:
        a2a.exchange_columns = exchange
    if rank == 0:
        print(f"{tokens}x{dim}, rank 0: host us per call ({CALLS} back to back)")
        for name, us in rows:
            print(f"  {name:32s} {us:8.1f}")
        for name, times in by_thread.items():
            if not times:  # on CPU the backward runs on the calling thread
                continue
            times.sort()
            median = times[len(times) // 2] / 1e3
            print(f"  exchange_columns in fwd+bwd, {name} thread: median {median:.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
