"""Per-row FP8 scales (the rowwise operands of the FP8 grouped GEMMs) at the MoE benchmark's
operand shapes: the one-pass kernel (grouped/row_scales.py) against the row-block kernel
with one group per row (the path it replaces) and a device copy.

    python benchmarks/bench_row_scales.py [--shape 65536x768 ...] [--rounds 3]
        [--tile 8192 --warps 4 ...] [--json out.json]

GB/s counts bytes read + written once (bf16 in, e4m3 + one fp32 scale per row out). Single
timings of one call on an H200 vary between repeats (scripts/timing_spread.py), so every
op runs in ``--rounds`` interleaved rounds; the table gives the fastest and the median.
``--tile`` / ``--warps`` (repeatable, paired) try other settings of _config.ROW_SCALES_*.
Prints whether each kernel's output equals the reference's bits. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from common import Help, do_bench_ms, parse_shape, report, warm_gpu

from mxfp8_a2a import _config, per_group_rowwise_scales
from mxfp8_a2a.grouped.reference import per_group_rowwise_reference
from mxfp8_a2a.grouped.row_scales import row_scales

# the rowwise operands of bench_moe_layer.py's shapes: tokens x hidden / ffn per rank, and
# the weights' rows (grad_x's operand, experts x K rows of N)
DEFAULT_SHAPES = ["32768x7168", "32768x2048", "65536x2048", "65536x768", "229376x2048"]


def _same(got, want) -> bool:
    (dg, sg), (dw, sw) = got, want
    same_data = torch.equal(dg.view(torch.uint8), dw.view(torch.uint8))
    return same_data and torch.equal(sg.reshape(-1), sw.reshape(-1))


def bench_shape(text: str, settings: list[tuple[int, int]], rounds: int) -> list[dict]:
    r, c = parse_shape(text)
    x = torch.randn(r, c, device="cuda", dtype=torch.bfloat16) * 3
    whole = torch.full((1,), c, dtype=torch.int32, device="cuda")
    want = per_group_rowwise_reference(x, whole)
    dst = torch.empty_like(x)
    nbytes = 3 * r * c + 4 * r
    row_block = lambda: per_group_rowwise_scales(x, whole, validate=False)  # noqa: E731
    ops = [
        ("device copy (bf16)", None, lambda: dst.copy_(x), 4 * r * c),
        ("row-block kernel", None, row_block, nbytes),
    ]
    for tile, w in settings:
        ops.append((f"row_scales tile {tile}, {w} warps", (tile, w), lambda: row_scales(x), nbytes))
    times: dict[str, list[float]] = {name: [] for name, *_ in ops}
    checks = {}
    for _ in range(rounds):
        for name, setting, fn, _n in ops:
            if setting:
                _config.ROW_SCALES_TILE, _config.ROW_SCALES_NUM_WARPS = setting
            if name not in checks and name != "device copy (bf16)":
                checks[name] = _same(fn(), want)
            times[name].append(do_bench_ms(fn))
    rows = []
    for name, _s, _f, n in ops:
        best = min(times[name])
        rows.append(
            {"shape": text, "op": name, "min ms": best,
             "median ms": statistics.median(times[name]), "GB/s (min)": n / best / 1e6,
             "same bits": checks.get(name, "")}
        )  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    p.add_argument(
        "--shape", action="append", help=f"RxC (repeatable); default: {' '.join(DEFAULT_SHAPES)}"
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    p.add_argument("--tile", type=int, action="append", help="ROW_SCALES_TILE to try")
    p.add_argument("--warps", type=int, action="append", help="ROW_SCALES_NUM_WARPS to try")
    p.add_argument("--json", help="write the results to this JSON file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_row_scales.py needs a CUDA GPU")
    tiles = args.tile or [_config.ROW_SCALES_TILE]
    warps = args.warps or [_config.ROW_SCALES_NUM_WARPS] * len(tiles)
    if len(warps) != len(tiles):
        sys.exit("--tile and --warps pair up: give as many of each")
    warm_gpu()
    results = []
    for text in args.shape or DEFAULT_SHAPES:
        results += bench_shape(text, list(zip(tiles, warps, strict=True)), args.rounds)
    report(results, args.json)


if __name__ == "__main__":
    main()
