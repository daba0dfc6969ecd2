"""The same per-group scaling calls timed again and again: does one call's time drift?

    python scripts/timing_spread.py [--rounds 10] [--pad-mib 2] [--json out.json]

x (16640, 8192) bf16, fixed offsets; each round frees the CUDA allocator's cache, holds a
pad of round * --pad-mib MiB (so the outputs land elsewhere), times three calls with
triton.testing.do_bench (median) and samples the GPU's clocks, power, temperature and
throttle reasons with nvidia-smi. Rows in time order; a summary of min / median / max.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton

from mxfp8_a2a import per_group_colwise_scales, per_group_rowwise_scales

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_per_group_scales import K, M, jagged_offsets  # noqa: E402
from common import versions, write_json  # noqa: E402

QUERY = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def gpu_state() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "nvidia-smi unavailable"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--pad-mib", type=int, default=2)
    p.add_argument("--json", help="write every round's timing and GPU state to this file")
    args = p.parse_args()
    x = torch.randn(M, K, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0)).cuda()
    g = torch.Generator().manual_seed(0)
    offs = {n: jagged_offsets(M, n, g) for n in (1, 16)}
    offs_k = jagged_offsets(K, 1, g)
    cases = {
        "colwise col-major, 1 group": lambda: per_group_colwise_scales(
            x, offs[1], data_layout="column_major", validate=False),
        "colwise row-major, 16 groups": lambda: per_group_colwise_scales(
            x, offs[16], validate=False),
        "rowwise contiguous, 1 group": lambda: per_group_rowwise_scales(
            x, offs_k, validate=False),
    }  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in cases}
    rounds = []
    start = time.perf_counter()
    print(f"round    s  {'call':30s}      us  ({QUERY})")
    for r in range(args.rounds):
        torch.cuda.empty_cache()
        pad = torch.empty(r * args.pad_mib * 2**20, dtype=torch.uint8, device="cuda")
        for name, fn in cases.items():
            us = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median") * 1e3
            times[name].append(us)
            t, state = time.perf_counter() - start, gpu_state()
            print(f"{r:5d} {t:4.0f}  {name:30s} {us:7.1f}  ({state})", flush=True)
            rounds.append({"round": r, "s": t, "call": name, "us": us, "gpu": state})
        del pad
    for name, v in times.items():
        print(
            f"{name:30s} min {min(v):.1f}  median {statistics.median(v):.1f}  max {max(v):.1f} us"
        )
    write_json(args.json, {"versions": versions(), "query": QUERY, "rounds": rounds})


if __name__ == "__main__":
    main()
