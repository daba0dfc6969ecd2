"""The push kernel (exchange/push.py) on one GPU, with W destinations emulated by W receive
buffers in the same GPU's memory: its own cost, next to quantize_packed and a device copy.

    python benchmarks/bench_push.py [--shape 131072x5120 ...] [--ranks 2 4 8] [--json out.json]

x [T, K] bf16 is split evenly over W destinations; push_rows stores each quantized row into
its destination's buffer (a per-row address), quantize_packed writes the same bytes into one
tensor. GB/s counts bytes read + written once each. Over NVLink the stores go to peers
instead; this measures the kernel, not the wire. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import parse_shape, report, time_ops, warm_gpu

import mxfp8_a2a as mx
from mxfp8_a2a.exchange.push import push_rows, receive_plan
from mxfp8_a2a.exchange.rows import wire_row

DEFAULT_SHAPES = ["131072x5120", "8192x5120", "2048x7168"]


def bench_shape(m: int, k: int, ranks: list[int]) -> list[dict]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    copy_dst = torch.empty_like(x)
    n = m * k
    q_bytes = 2 * n + n + n // 32
    rows = [
        ("device copy (bf16)", lambda: copy_dst.copy_(x), 4 * n),
        ("quantize_packed", lambda: mx.quantize_packed(x), q_bytes),
    ]
    keep = []  # the table holds raw addresses: the buffers must outlive the timings
    for w in ranks:
        counts = torch.zeros(w, w, dtype=torch.int64, device="cuda")
        counts[0] = torch.tensor([m * (d + 1) // w - m * d // w for d in range(w)])
        start, received, _ = receive_plan(counts, m)
        capacity = int(received.max())
        bufs = [
            torch.empty(capacity, wire_row(k), dtype=torch.uint8, device="cuda") for _ in range(w)
        ]
        table = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device="cuda")
        keep.append(bufs)
        fn = lambda c=counts[0], s=start[0], t=table, cap=capacity: push_rows(x, t, c, s, cap)  # noqa: E731
        rows.append((f"push_rows, {w} destinations", fn, q_bytes))
    return time_ops(f"{m}x{k}", rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--shape", action="append", help=f"TxK (repeatable); default: {' '.join(DEFAULT_SHAPES)}"
    )
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--json", help="write the results to this JSON file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_push.py needs a CUDA GPU")
    warm_gpu()
    results = []
    for text in args.shape or DEFAULT_SHAPES:
        results += bench_shape(*parse_shape(text), args.ranks)
    report(results, args.json)


if __name__ == "__main__":
    main()
