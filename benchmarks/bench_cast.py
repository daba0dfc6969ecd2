"""Bandwidth of the MXFP8 cast kernels against a device copy and torch.compile'd references.

    python benchmarks/bench_cast.py [--shape 131072x5120 ...] [--json out.json]

GB/s counts bytes read + written once each. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import Help, parse_shape, report, time_ops, warm_gpu

import mxfp8_a2a as mx

DEFAULT_SHAPES = ["131072x5120", "8192x5120", "2048x7168"]


def bench_shape(m: int, k: int) -> list[dict]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    data, scales = mx.quantize(x)
    packed = mx.quantize_packed(x)
    copy_dst = torch.empty_like(x)
    # static shapes: one compile per shape (not a dynamic-shape recompile from the second on)
    q_ref = torch.compile(mx.quantize_reference, dynamic=False)
    dq_ref = torch.compile(mx.dequantize_reference, dynamic=False)
    n = m * k
    q_bytes = 2 * n + n + n // 32
    rows = [
        ("device copy (bf16)", lambda: copy_dst.copy_(x), 4 * n),
        ("quantize", lambda: mx.quantize(x), q_bytes),
        ("quantize_packed", lambda: mx.quantize_packed(x), q_bytes),
        ("torch.compile quantize_reference", lambda: q_ref(x), q_bytes),
        ("dequantize", lambda: mx.dequantize(data, scales), q_bytes),
        ("dequantize_packed", lambda: mx.dequantize_packed(packed), q_bytes),
        ("torch.compile dequantize_reference", lambda: dq_ref(data, scales), q_bytes),
    ]
    return time_ops(f"{m}x{k}", rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    p.add_argument(
        "--shape", action="append", help=f"MxK (repeatable); default: {' '.join(DEFAULT_SHAPES)}"
    )
    p.add_argument("--json", help="write the results to this JSON file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_cast.py needs a CUDA GPU")
    warm_gpu()  # the first row is the copy ceiling: not on a cold GPU
    results = []
    for text in args.shape or DEFAULT_SHAPES:
        results += bench_shape(*parse_shape(text))
    report(results, args.json)


if __name__ == "__main__":
    main()
