"""Host time of one eager exchange (exchange_columns, chunks=1) under different conditions.

    torchrun --nproc-per-node=2 scripts/host_threads.py 256x5120

The same call, timed with perf_counter on rank 0 (median of 200 after 20 warm-up), run:
back to back; after a device sync; after barrier + sync (what the benchmark does); after a
host spin or a 200 us sleep; after a trivial autograd forward+backward; on a fresh Python
thread per call; on one long-lived worker thread fed through a queue (as the autograd
engine runs a backward on its device thread). It shows how much of an exchange's host time
depends on where and after what it runs, not on what it does.
"""

from __future__ import annotations

import queue
import sys
import threading
import time

import torch
import torch.distributed as dist

from mxfp8_a2a._exchange import exchange_columns
from mxfp8_a2a._launch import init_from_torchrun

CALLS, WARMUP = 200, 20


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def _median_us(times: list[int]) -> float:
    times = sorted(times[WARMUP:])
    return times[len(times) // 2] / 1e3


def main() -> None:
    device = init_from_torchrun()
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, dim = (int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "256x5120").split("x"))
    splits = [tokens // world] * world
    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)
    xg, g = x.clone().requires_grad_(True), torch.randn_like(x)

    def call() -> int:
        t0 = time.perf_counter_ns()
        exchange_columns(x, splits, splits, None, "rceil", 1)
        return time.perf_counter_ns() - t0

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def settle() -> None:
        sync()
        dist.barrier()
        sync()

    def after(between) -> float:
        times = []
        for _ in range(CALLS + WARMUP):
            between()
            times.append(call())
        settle()
        return _median_us(times)

    def on_fresh_threads() -> float:
        times = []
        for _ in range(CALLS + WARMUP):
            t = threading.Thread(target=lambda: times.append(call()))
            t.start()
            t.join()
        settle()
        return _median_us(times)

    def on_one_worker() -> float:
        todo, done = queue.Queue(), queue.Queue()

        def worker() -> None:
            while todo.get() is not None:
                done.put(call())

        t = threading.Thread(target=worker)
        t.start()
        times = []
        for _ in range(CALLS + WARMUP):
            todo.put(True)
            times.append(done.get())
        todo.put(None)
        t.join()
        settle()
        return _median_us(times)

    rows = []
    with torch.no_grad():
        rows.append(("back to back", after(lambda: None)))
        rows.append(("after a device sync", after(sync)))
        rows.append(("after barrier + sync (the benchmark)", after(settle)))
        rows.append(("after a ~200 us host spin", after(lambda: [None for _ in range(3000)])))
        rows.append(("after time.sleep(200 us)", after(lambda: time.sleep(2e-4))))
        rows.append(("on a fresh thread each call", on_fresh_threads()))
        rows.append(("on one worker thread fed by a queue", on_one_worker()))
    rows.append(
        ("after a trivial autograd fwd+bwd", after(lambda: _Identity.apply(xg).backward(g)))
    )
    if rank == 0:
        print(f"{tokens}x{dim}, rank 0: host us of one exchange_columns call (median)")
        for name, us in rows:
            print(f"  {name:40s} {us:8.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
