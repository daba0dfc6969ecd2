"""Sweep the per-group scaling kernels' tilings on the current GPU.

    python scripts/tune_per_group.py [--kind rowwise|colwise|both] [--json out.json]
        [--rowwise TILE,ITEM,MAX_CLASS,WARPS[,MAXNREG]]...
        [--colwise BO,AMAX_ROWS,CAST_ROWS,SUB,WARPS[,MIN_PROGRAMS[,AMAX_STAGES[,CAST_STAGES]]]]...

x (16640, 8192) bf16, 1/16/64 jagged groups (end offsets multiples of 16), validate=False;
prints microseconds and effective GB/s (3 bytes per element) for each tiling tried:
rowwise: per_group_rowwise_scales(x, offs) (the row-block kernel, ``_config.RowBlockTiling``);
colwise: the colwise kernels (``_config.ColwiseTiling``) in the grad_w layout,
per_group_colwise_scales(x, offs, data_layout="column_major"), and with row-major data.
The best go into mxfp8_a2a/_config.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
from tabulate import tabulate

from mxfp8_a2a import _config, per_group_colwise_scales, per_group_rowwise_scales

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_per_group_scales import K, M, jagged_offsets  # noqa: E402

ROWWISE = [  # tile, item, max_class, warps, maxnreg
    (4096, 8192, 512, 4, 64), (4096, 8192, 512, 4, 0), (4096, 8192, 256, 4, 64),
    (4096, 16384, 512, 4, 64), (2048, 8192, 512, 4, 64),
]  # fmt: skip
COLWISE = [  # block_other, amax_rows, cast_rows, sub, warps, min_programs, stages (amax,
    # cast): the 2026-12-01 pipelining sweep's settings, the shipped one first
    (128, 512, 128, 32, 4, 2048, 3, 3), (128, 512, 128, 32, 4, 2048, 0, 0),
    (128, 512, 128, 32, 4, 2048, 2, 0), (128, 512, 128, 32, 4, 2048, 4, 0),
    (128, 512, 128, 32, 4, 2048, 3, 2), (128, 512, 128, 32, 4, 2048, 2, 2),
    (128, 512, 128, 64, 4, 2048, 3, 3),
]  # fmt: skip


def rowwise_tiling(v) -> _config.RowBlockTiling:
    tile, item, max_class, warps, *maxnreg = v
    return _config.RowBlockTiling(tile, item, 32, max_class, warps, *maxnreg)


def colwise_tiling(v) -> _config.ColwiseTiling:
    return _config.ColwiseTiling(*v)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--json")
    p.add_argument("--kind", choices=["rowwise", "colwise", "both"], default="both")
    p.add_argument("--rowwise", action="append", metavar="TILE,ITEM,MAX_CLASS,WARPS[,MAXNREG]")
    p.add_argument(
        "--colwise",
        action="append",
        metavar="BO,AMAX_ROWS,CAST_ROWS,SUB,WARPS[,MIN_PROGRAMS[,AMAX_STAGES[,CAST_STAGES]]]",
    )
    p.add_argument("--groups", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--rounds", type=int, default=1, help="times through the list, interleaved")
    p.add_argument(
        "--draws", type=int, default=1,
        help="offsets drawn per group count (draw 0: the benchmark's, seed 0; draw d: seed d)",
    )  # fmt: skip
    args = p.parse_args()
    parse = lambda texts: [tuple(int(v) for v in t.split(",")) for t in texts]  # noqa: E731
    chosen = {
        "rowwise": [rowwise_tiling(v) for v in (parse(args.rowwise) if args.rowwise else ROWWISE)],
        "colwise": [colwise_tiling(v) for v in (parse(args.colwise) if args.colwise else COLWISE)],
    }
    x = torch.randn(M, K, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0)).cuda()
    offs = {}
    for d in range(args.draws):
        g = torch.Generator().manual_seed(d)
        for n in args.groups:
            offs[n, d] = {M: jagged_offsets(M, n, g), K: jagged_offsets(K, n, g)}
    cases = {
        "rowwise": [("rowwise", K, lambda o: per_group_rowwise_scales(x, o, validate=False))],
        "colwise": [
            ("colwise col-major", M, lambda o: per_group_colwise_scales(
                x, o, data_layout="column_major", validate=False)),
            ("colwise row-major", M, lambda o: per_group_colwise_scales(x, o, validate=False)),
        ],
    }  # fmt: skip
    rows = []
    for kind, attr in (("rowwise", "ROWWISE_TILING"), ("colwise", "COLWISE_TILING")):
        if args.kind not in (kind, "both"):
            continue
        for tiling in chosen[kind] * args.rounds:
            setattr(_config, attr, tiling)
            for name, total, fn in cases[kind]:
                for (n_groups, draw), o in offs.items():
                    ms = triton.testing.do_bench(
                        lambda o=o[total], fn=fn: fn(o), warmup=100, return_mode="median"
                    )
                    rows.append(
                        {"fn": name, "groups": n_groups, "draw": draw, "tiling": str(tuple(tiling)),
                         "us": ms * 1e3, "GB/s": 3 * M * K / ms / 1e6}
                    )  # fmt: skip
                    print(rows[-1], flush=True)
    print(tabulate(rows, headers="keys", floatfmt=".1f"))
    if args.rounds > 1:
        runs: dict[tuple, list[float]] = {}
        for r in rows:
            runs.setdefault((r["fn"], r["tiling"], r["groups"], r["draw"]), []).append(r["us"])
        summary = [
            {"fn": k[0], "tiling": k[1], "groups": k[2], "draw": k[3],
             "median us": statistics.median(v), "min us": min(v), "max us": max(v)}
            for k, v in runs.items()
        ]  # fmt: skip
        print(tabulate(summary, headers="keys", floatfmt=".1f"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
