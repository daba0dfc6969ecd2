"""Why an eager experts' step is slower than its kernels: host synchronizations in one step
(torch.cuda.set_sync_debug_mode), host enqueue time against wall time of 10 back-to-back
steps (3 repeats), and the CPU profile of 5 steps, per precision, at 8192x2048x8x16x768.
``--python-profile``: also the Python functions that take the host's time in 10 steps
(cProfile, by own time).

    python scripts/step_host_check.py [--shape TOKENSxHIDDENxTOPKxEXPERTSxFFN] [--python-profile]

Run with another checkout first on PYTHONPATH to compare package versions. Needs CUDA.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from profile_grouped_mm import expert_inputs, experts_step  # noqa: E402

import mxfp8_a2a  # noqa: E402


def check(step, name: str) -> None:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step()
    torch.cuda.set_sync_debug_mode(0)
    print(name, "syncs in one step:", len(caught))
    for c in caught[:5]:
        print("   ", str(c.message)[:200])
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(name, f"enqueue {(t1 - t) / 10 * 1e6:.0f} us/step, wall {(t2 - t) / 10 * 1e6:.0f}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


def python_profile(step, name: str) -> None:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    print(name, "Python profile of 10 steps (us are cProfile's, inflated by it):")
    print(out.getvalue())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="8192x2048x8x16x768")
    p.add_argument("--python-profile", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("step_host_check.py needs a CUDA GPU")
    print(mxfp8_a2a.__file__)
    inputs = expert_inputs(args.shape)
    for precision in ("fp8_rowwise_gw_hp", "fp8_rowwise", "bf16"):
        step = functools.partial(experts_step, *inputs, precision)
        check(step, precision)
        if args.python_profile:
            python_profile(step, precision)


if __name__ == "__main__":
    main()
