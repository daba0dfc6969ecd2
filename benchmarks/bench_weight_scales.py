"""Both FP8 copies of expert weights (precision="fp8_rowwise": the forward's per (expert,
column), grad_x's per (expert, row)) at the MoE benchmark's weight shapes: one op that reads
w twice (grouped/weight_scales.py) against the two casts apart (expert_column_scales, which
reads w twice, and row_scales, once), beside a device copy.

    python benchmarks/bench_weight_scales.py [--shape 32x7168x2048 ...] [--rounds 3]
        [--setting ROWS=128,NUM_WARPS=4 ...] [--json out.json]

Times: "kernel ms", the GPU's own time per call (torch.profiler, all kernels summed, no host
time), and do_bench's median ms (back-to-back calls: the larger of the GPU's and the host's
time), each the fastest over ``--rounds`` interleaved rounds, and the kernel time of each
launch ("split", the fastest round's). GB/s effective: w read once and both copies written
once (4 bytes per bf16 element, as a device copy of w) over the kernel time. ``--setting``
(repeatable) tries other values of _config.WEIGHT_SCALES_* (KEY=VALUE,...; the prefix left
out). Prints whether the one-pass op gives the bits of the two casts apart. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import Help, do_bench_ms, kernel_us, report, warm_gpu

from mxfp8_a2a import _config
from mxfp8_a2a.grouped.weight_scales import weight_scales, weight_scales_apart

# w1 [E, hidden, ffn] and w2 [E, ffn, hidden] of bench_moe_layer.py's two shapes
DEFAULT_SHAPES = ["32x7168x2048", "32x2048x7168", "16x2048x768", "16x768x2048"]


def _same(got, want) -> bool:
    return all(
        torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                    b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
        and a.stride() == b.stride()
        for a, b in zip(got, want, strict=True)
    )  # fmt: skip


def _parse_setting(text: str) -> dict[str, int]:
    out = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        name = f"WEIGHT_SCALES_{key.strip().upper()}"
        if not hasattr(_config, name) or not value:
            raise SystemExit(
                f"--setting: {item!r} is not KEY=VALUE of a _config.WEIGHT_SCALES_* name"
            )
        out[name] = int(value)
    return out


def _short(kernel: str) -> str:
    return kernel.split("(")[0].split("<")[0][-28:]


def bench_shape(text: str, settings: list[dict[str, int]], rounds: int) -> list[dict]:
    e, k, n = (int(v) for v in text.lower().split("x"))
    w = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16) * 3
    dst = torch.empty_like(w)
    shipped = {name: getattr(_config, name) for s in settings for name in s}
    ops = [
        ("device copy (bf16)", {}, lambda: dst.copy_(w)),
        ("two casts apart", {}, lambda: weight_scales_apart(w)),
    ]
    for setting in settings or [{}]:
        label = ",".join(f"{k[14:].lower()}={v}" for k, v in setting.items()) or "shipped"
        ops.append((f"one pass, {label}", setting, lambda: weight_scales(w)))
    want = weight_scales_apart(w)
    kernel: dict[str, list[dict[str, float]]] = {name: [] for name, *_ in ops}
    bench: dict[str, list[float]] = {name: [] for name, *_ in ops}
    checks = {}
    for _ in range(rounds):
        for name, setting, fn in ops:
            for key, value in {**shipped, **setting}.items():
                setattr(_config, key, value)
            if name.startswith("one pass") and name not in checks:
                checks[name] = _same(fn(), want)
            kernel[name].append({k: t / 1e3 for k, (t, _) in kernel_us(fn).items()})
            bench[name].append(do_bench_ms(fn))
    for key, value in shipped.items():
        setattr(_config, key, value)
    nbytes = 4 * w.numel()
    rows = []
    for name, *_ in ops:
        best = min(kernel[name], key=lambda d: sum(d.values()))
        ms = sum(best.values())
        split = " + ".join(f"{_short(k)} {v * 1e3:.0f}" for k, v in best.items() if v > 0.002)
        rows.append(
            {"shape": text, "op": name, "kernel ms": ms, "do_bench ms": min(bench[name]),
             "GB/s (kernel)": nbytes / ms / 1e6, "same bits": checks.get(name, ""),
             "split (us)": split}
        )  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    p.add_argument(
        "--shape", action="append", help=f"ExKxN (repeatable); default: {' '.join(DEFAULT_SHAPES)}"
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    p.add_argument("--setting", action="append", default=[], help="KEY=VALUE,... to try")
    p.add_argument("--json", help="write the results to this JSON file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_weight_scales.py needs a CUDA GPU")
    settings = [_parse_setting(s) for s in args.setting]
    warm_gpu()
    results = []
    for text in args.shape or DEFAULT_SHAPES:
        results += bench_shape(text, settings, args.rounds)
    report(results, args.json)


if __name__ == "__main__":
    main()
