"""The GPU's own time (torch.profiler: the kernels' time per call) beside the time per call
that back-to-back calls take, which is the larger of the GPU's and the host's.

    python scripts/gpu_time.py [--part colwise|experts|both]

colwise: the colwise per-group casts at (16640, 8192) bf16 (bench_per_group_scales.py's x
and offsets) with 1 / 16 / 64 groups, data column-major (grad_w) and row-major, and two of
the FP8 experts' small pieces: each launch's kernel time over 20 calls, and the do_bench
median. experts: profile_grouped_mm.py's experts forward+backward at the MoE benchmark's
shapes, bf16, fp8_rowwise and fp8_rowwise_gw_hp: wall time per step of back-to-back steps
(median of 5 runs of 10), the kernels' time per step, and a CUDA graph's replay (no host
time). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_per_group_scales import K, M, jagged_offsets  # noqa: E402
from common import kernel_us, versions, warm_gpu, write_json  # noqa: E402
from profile_grouped_mm import SHAPES, expert_inputs, experts_step, uneven_offsets  # noqa: E402

from mxfp8_a2a import per_group_colwise_scales  # noqa: E402

fr = importlib.import_module("mxfp8_a2a.grouped.fp8_rowwise")


def wall_us(fn, n: int) -> float:
    """Median over 5 runs of the time per call of n back-to-back calls."""
    runs = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(runs)


def colwise() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, dtype=torch.bfloat16, generator=g).cuda()
    cases = {}
    for n in (1, 16, 64):
        o = jagged_offsets(M, n, torch.Generator().manual_seed(0))
        cases[f"colwise col-major {n}"] = lambda o=o: per_group_colwise_scales(
            x, o, data_layout="column_major", validate=False
        )
        cases[f"colwise row-major {n}"] = lambda o=o: per_group_colwise_scales(x, o, validate=False)
    randn = lambda *s: torch.randn(*s, generator=g).to("cuda", torch.bfloat16)  # noqa: E731
    w_small, a768 = randn(16, 2048, 768), randn(65536, 768)
    o16 = uneven_offsets(65536, 16, g)
    cases["w per column [16, 2048, 768]"] = lambda: fr._weights_per_column(w_small)
    cases["padded per group [65536, 768], 16"] = lambda: fr.padded_token_scales(a768, o16)
    rows = []
    for name, fn in cases.items():
        bench = triton.testing.do_bench(fn, warmup=100, rep=200, return_mode="median") * 1e3
        per = kernel_us(fn, 20)
        total = sum(t for t, _ in per.values())
        parts = ", ".join(
            f"{k[:40]} {t:.1f} us x{c}"
            for k, (t, c) in sorted(per.items(), key=lambda kv: -kv[1][0])
        )
        print(f"{name}: do_bench {bench:.1f} us, kernels {total:.1f} us: {parts}", flush=True)
        kernels = {k: {"us": t, "launches": c} for k, (t, c) in per.items()}
        rows.append({"case": name, "do_bench_us": bench, "kernels_us": total, "kernels": kernels})
    return rows


def experts() -> list[dict]:
    rows = []
    for text in SHAPES:
        inputs = expert_inputs(text)
        for precision in ("bf16", "fp8_rowwise", "fp8_rowwise_gw_hp"):
            step = functools.partial(experts_step, *inputs, precision)

            for _ in range(3):
                step()
            eager = wall_us(step, 10)
            kernels = sum(t for t, _ in kernel_us(step, 5).values())
            side = torch.cuda.Stream()  # warm-up off the capturing stream, as CUDA graphs ask
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            replay = wall_us(graph.replay, 10)
            print(
                f"{text} {precision}: eager wall {eager:.0f} us per step, kernels "
                f"{kernels:.0f} us, graph replay {replay:.0f} us",
                flush=True,
            )
            rows.append(
                {"shape": text, "precision": precision, "eager_us": eager,
                 "kernels_us": kernels, "graph_replay_us": replay}
            )  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--part", choices=["colwise", "experts", "both"], default="both")
    p.add_argument("--json", help="write the results to this JSON file")
    args = p.parse_args()
    print(versions())
    warm_gpu()  # the first do_bench median is not to be taken on a cold GPU
    results = {"versions": versions()}
    if args.part in ("colwise", "both"):
        results["colwise"] = colwise()
    if args.part in ("experts", "both"):
        results["experts"] = experts()
    write_json(args.json, results)


if __name__ == "__main__":
    main()
