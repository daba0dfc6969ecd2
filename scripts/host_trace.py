"""Host time of the eager MXFP8 exchange: per call, by autograd thread, and by condition.

    torchrun --nproc-per-node=2 scripts/host_trace.py 256x5120

1. Wall clock of 300 back-to-back calls / 300 after 20 warm-up calls, rank 0, us: the
   MXFP8 exchange and its bf16 baseline, with and without autograd; then the
   exchange_columns calls inside a forward+backward loop split by the thread they ran on
   (the autograd engine runs a CUDA backward on its own device thread).
2. One exchange_columns call (chunks=1), median of 200 after 20 warm-up, rank 0, us, run:
   back to back; after a device sync; after barrier + sync (what the benchmark does); after
   a host spin or a 200 us sleep; after a trivial autograd forward+backward; on a fresh
   Python thread per call; on one long-lived worker thread fed through a queue (as the
   autograd engine's device thread is). It shows how much of an exchange's host time
   depends on where and after what it runs.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import mxfp8_a2a.a2a as a2a
from mxfp8_a2a import to_mxfp8_a2a_dequant
from mxfp8_a2a._launch import init_from_torchrun

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_a2a import _Bf16AllToAll  # noqa: E402

CALLS, WARMUP = 300, 20


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _settle(device: torch.device) -> None:
    _sync(device)
    dist.barrier()
    _sync(device)


def _median_us(times: list[int]) -> float:
    times = sorted(times)
    return times[len(times) // 2] / 1e3


def per_call_table(x, xg, g, splits) -> list[tuple[str, float]]:
    """Part 1: us per call of back-to-back calls, and the exchanges of a forward+backward
    loop by thread."""

    def per_call(fn) -> float:
        for _ in range(WARMUP):
            fn()
        _settle(x.device)
        t0 = time.perf_counter_ns()
        for _ in range(CALLS):
            fn()
        us = (time.perf_counter_ns() - t0) / CALLS / 1e3
        _sync(x.device)
        return us

    exchange = a2a.exchange_columns
    y = torch.empty_like(x)
    mx_fwd = lambda t: to_mxfp8_a2a_dequant(t, splits, splits)  # noqa: E731
    bf_fwd = lambda t: _Bf16AllToAll.apply(t, splits, splits)  # noqa: E731
    rows = []
    with torch.no_grad():
        rows.append(("mxfp8 fwd (no grad)", per_call(lambda: mx_fwd(x))))
        rows.append(
            (
                "exchange_columns alone",
                per_call(lambda: exchange(x, splits, splits, None, "rceil", 1)),
            )
        )
        rows.append(
            (
                "bf16 all_to_all_single",
                per_call(lambda: dist.all_to_all_single(y, x, splits, splits)),
            )
        )
    rows.append(("mxfp8 fwd (grad)", per_call(lambda: mx_fwd(xg))))
    rows.append(("bf16 Function fwd (grad)", per_call(lambda: bf_fwd(xg))))
    rows.append(("mxfp8 fwd+bwd", per_call(lambda: mx_fwd(xg).backward(g))))
    rows.append(("bf16 Function fwd+bwd", per_call(lambda: bf_fwd(xg).backward(g))))
    rows.append(("trivial Function fwd+bwd", per_call(lambda: _Identity.apply(xg).backward(g))))

    by_thread: dict[str, list[int]] = {"main": [], "autograd": []}
    main_thread = threading.get_ident()

    def timed_exchange(*args):
        t0 = time.perf_counter_ns()
        out = exchange(*args)
        name = "main" if threading.get_ident() == main_thread else "autograd"
        by_thread[name].append(time.perf_counter_ns() - t0)
        return out

    a2a.exchange_columns = timed_exchange
    try:
        per_call(lambda: mx_fwd(xg).backward(g))
    finally:
        a2a.exchange_columns = exchange
    for name, times in by_thread.items():
        if times:  # on CPU the backward runs on the calling thread
            rows.append((f"exchange_columns in fwd+bwd, {name} thread (median)", _median_us(times)))
    return rows


def condition_table(x, xg, g, splits) -> list[tuple[str, float]]:
    """Part 2: the median us of one exchange_columns call by what ran before it and where."""
    n = CALLS * 2 // 3

    def call() -> int:
        t0 = time.perf_counter_ns()
        a2a.exchange_columns(x, splits, splits, None, "rceil", 1)
        return time.perf_counter_ns() - t0

    def after(between) -> float:
        times = []
        for _ in range(n + WARMUP):
            between()
            times.append(call())
        _settle(x.device)
        return _median_us(times[WARMUP:])

    def on_fresh_threads() -> float:
        times = []
        for _ in range(n + WARMUP):
            t = threading.Thread(target=lambda: times.append(call()))
            t.start()
            t.join()
        _settle(x.device)
        return _median_us(times[WARMUP:])

    def on_one_worker() -> float:
        todo, done = queue.Queue(), queue.Queue()

        def worker() -> None:
            while todo.get() is not None:
                done.put(call())

        t = threading.Thread(target=worker)
        t.start()
        times = []
        for _ in range(n + WARMUP):
            todo.put(True)
            times.append(done.get())
        todo.put(None)
        t.join()
        _settle(x.device)
        return _median_us(times[WARMUP:])

    rows = []
    with torch.no_grad():
        rows.append(("back to back", after(lambda: None)))
        rows.append(("after a device sync", after(lambda: _sync(x.device))))
        rows.append(("after barrier + sync (the benchmark)", after(lambda: _settle(x.device))))
        rows.append(("after a ~200 us host spin", after(lambda: [None for _ in range(3000)])))
        rows.append(("after time.sleep(200 us)", after(lambda: time.sleep(2e-4))))
        rows.append(("on a fresh thread each call", on_fresh_threads()))
        rows.append(("on one worker thread fed by a queue", on_one_worker()))
    rows.append(
        ("after a trivial autograd fwd+bwd", after(lambda: _Identity.apply(xg).backward(g)))
    )
    return rows


def main() -> None:
    device = init_from_torchrun()
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, dim = (int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "256x5120").split("x"))
    splits = [tokens // world] * world
    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)
    xg, g = x.clone().requires_grad_(True), torch.randn_like(x)
    parts = (
        (f"host us per call ({CALLS} back to back)", per_call_table(x, xg, g, splits)),
        ("host us of one exchange_columns call (median)", condition_table(x, xg, g, splits)),
    )
    if rank == 0:
        for title, rows in parts:
            print(f"{tokens}x{dim}, rank 0: {title}")
            for name, us in rows:
                print(f"  {name:52s} {us:8.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
