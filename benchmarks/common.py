"""Timing and reporting helpers shared by the benchmark scripts."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import triton
from tabulate import tabulate


class Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's lines and shows each option's default."""


def versions() -> dict:
    info = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)",
        "date": time.strftime("%Y-%m-%d"),
    }
    if torch.cuda.is_available():
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def parse_shape(text: str) -> tuple[int, int]:
    try:
        tokens, dim = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(
            f"--shape must look like TOKENSxDIM (e.g. 8192x5120), got {text!r}"
        ) from None
    return tokens, dim


def do_bench_ms(fn: Callable[[], object], warmup_ms: int = 50, rep_ms: int = 300) -> float:
    """Median milliseconds of ``fn`` on the GPU (CUDA events, after warm-up)."""
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def kernel_us(fn: Callable[[], object], calls: int = 20) -> dict[str, tuple[float, int]]:
    """The GPU's own time per call of ``fn``, kernel by kernel (torch.profiler over ``calls``
    calls): kernel name -> (us per call, launches per call); no host time in it. Keyed by the
    whole name: torch's elementwise kernels share long prefixes."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return {
        e.key: (e.device_time_total / calls, e.count // calls)
        for e in prof.key_averages()
        if e.device_type == cuda and e.count
    }


def warm_gpu(fn: Callable[[], object] | None = None, seconds: float = 2.0) -> None:
    """Run ``fn`` (default: a 256 MiB device copy) for ``seconds`` before any timing. On a
    freshly started H200 (SM clock at 345 MHz when idle) the first kernel timed after 250 ms
    of warm-up still measured 35% slow (2026-11-30)."""
    if fn is None:
        src = torch.empty(128 << 20, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        fn = lambda: dst.copy_(src)  # noqa: E731
    do_bench_ms(fn, warmup_ms=int(seconds * 1000), rep_ms=10)


def time_ops(shape: str, ops: list[tuple[str, Callable[[], object], int]]) -> list[dict]:
    """One row per (name, function, bytes moved) of ``ops``: do_bench median ms and GB/s."""
    rows = []
    for name, fn, nbytes in ops:
        ms = do_bench_ms(fn)
        rows.append(
            {"shape": shape, "op": name, "ms": ms, "bytes": nbytes, "GB/s": nbytes / ms / 1e6}
        )
    return rows


def report(results: list[dict], json_path: str | None) -> None:
    """Print the versions line and the table of ``results``; write both to ``json_path``."""
    info = versions()
    print(" ".join(f"{k}={v}" for k, v in info.items()))
    print(tabulate(results, headers="keys", floatfmt=".3f"))
    write_json(json_path, {"versions": info, "results": results})


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """SQNR in dB of ``approx`` against ``ref`` over all ranks of the default group."""
    ref, approx = ref.double(), approx.double()
    num, den = ref.pow(2).sum(), (ref - approx).pow(2).sum()
    for v in (num, den):
        dist.all_reduce(v)
    return (10 * torch.log10(num / den)).item()


def median(values: list[float]) -> float:
    return statistics.median(values)


def write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {path}", file=sys.stderr)


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.enabled = total, 0, enabled and total > 1

    def step(self, label: str) -> None:
        self.done += 1
        if self.enabled:
            width = 30
            filled = width * self.done // self.total
            bar = "#" * filled + "." * (width - filled)
            print(f"\r[{bar}] {self.done}/{self.total} {label:<30}", end="", file=sys.stderr)
            if self.done == self.total:
                print(file=sys.stderr)


class Timer:
    """Per-iteration timing of a torchrun process group: barrier + sync before each, CUDA
    events (or host clock) around; the median over iterations per rank, then the max over
    ranks."""

    def __init__(self, device: torch.device, iters: int, warmup: int):
        self.device, self.iters, self.warmup = device, iters, warmup

    def __call__(
        self, fn: Callable[[object], object], setup: Callable[[], object] | None = None
    ) -> float:
        cuda = self.device.type == "cuda"
        times, events = [], []
        for i in range(self.warmup + self.iters):
            state = setup() if setup else None
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn(state)
                end.record()
                if i >= self.warmup:
                    events.append((start, end))
            else:
                t0 = time.perf_counter()
                fn(state)
                if i >= self.warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            torch.cuda.synchronize()
            times = [s.elapsed_time(e) for s, e in events]
        t = torch.tensor([median(times)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()
