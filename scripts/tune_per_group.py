"""Sweep the per-group scaling kernel's tilings on the current GPU.

    python scripts/tune_per_group.py [--json out.json]

x (16640, 8192) bf16, 1/16/64 jagged groups (end offsets multiples of 16); prints
microseconds and effective GB/s (3 bytes per element) of per_group_rowwise_scales
(method="direct") and per_group_colwise_scales for each tiling tried
(``_config.RowBlockTiling``, ``_config.GroupItemTiling``); the best go into
mxfp8_a2a/_config.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
from tabulate import tabulate

from mxfp8_a2a import _config, per_group_colwise_scales, per_group_rowwise_scales

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_per_group_scales import M, N, jagged_offsets  # noqa: E402


def tilings(kind: str) -> list:
    """Rowwise (row-block kernel): tiles of 2048-4096 elements, the widest class 256-1024
    columns, items of 8192-16384 elements. Colwise (group-item kernel): the last class is
    ``min_other`` columns wide."""
    out = []
    if kind == "rowwise":
        for tile, item, max_class, warps in [
            (4096, 8192, 512, 4), (4096, 8192, 256, 4), (4096, 8192, 1024, 4),
            (4096, 16384, 512, 4), (2048, 8192, 512, 4), (2048, 8192, 256, 4),
            (2048, 16384, 512, 4), (4096, 8192, 512, 8), (8192, 16384, 1024, 8),
            (4096, 4096, 512, 4),
        ]:  # fmt: skip
            out.append(_config.RowBlockTiling(tile, item, 32, max_class, warps))
    else:
        for tile, min_other, warps in itertools.product([8192, 16384], [16, 32], [4, 8]):
            n_classes = (tile // (16 * min_other)).bit_length()  # classes 16 .. tile/min_other rows
            out.append(_config.GroupItemTiling(tile, 16, n_classes, 16, 512, warps, 4))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--kind", choices=["rowwise", "colwise", "both"], default="both")
    p.add_argument(
        "--rowwise", action="append", metavar="TILE,ITEM,MAX_CLASS,WARPS[,MAXNREG]",
        help="rowwise tilings to try instead of the built-in list (repeatable)",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=1, help="times through the list, interleaved")
    p.add_argument(
        "--draws", type=int, default=1,
        help="offsets drawn per group count (draw 0: the benchmark's, seed 0; draw d: seed d)",
    )  # fmt: skip
    args = p.parse_args()
    chosen = {"rowwise": tilings("rowwise"), "colwise": tilings("colwise")}
    if args.rowwise:
        chosen["rowwise"] = []
        for text in args.rowwise:
            tile, item, max_class, warps, *maxnreg = (int(v) for v in text.split(","))
            chosen["rowwise"].append(
                _config.RowBlockTiling(tile, item, 32, max_class, warps, *maxnreg)
            )
    x = torch.randn(N, M, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0)).cuda()
    offs = {}
    for d in range(args.draws):
        g = torch.Generator().manual_seed(d)
        for n in (1, 16, 64):
            offs[n, d] = (jagged_offsets(M, n, g), jagged_offsets(N, n, g))
    rows = []
    for kind, fn in (
        ("rowwise", lambda o: per_group_rowwise_scales(x, o[0], method="direct", validate=False)),
        ("colwise", lambda o: per_group_colwise_scales(x, o[1], validate=False)),
    ):
        if args.kind not in (kind, "both"):
            continue
        for tiling in chosen[kind] * args.rounds:
            setattr(_config, f"{kind.upper()}_TILING", tiling)
            for (n_groups, draw), o in offs.items():
                ms = triton.testing.do_bench(
                    lambda o=o, fn=fn: fn(o), warmup=100, return_mode="median"
                )
                rows.append(
                    {
                        "fn": kind,
                        "groups": n_groups,
                        "draw": draw,
                        "tiling": str(tuple(tiling)),
                        "us": ms * 1e3,
                        "GB/s": 3 * N * M / ms / 1e6,
                    }
                )
                print(rows[-1], flush=True)
    print(tabulate(rows, headers="keys", floatfmt=".1f"))
    if args.rounds > 1:
        runs: dict[tuple, list[float]] = {}
        for r in rows:
            runs.setdefault((r["fn"], r["tiling"], r["groups"], r["draw"]), []).append(r["us"])
        summary = [
            {"fn": k[0], "tiling": k[1], "groups": k[2], "draw": k[3],
             "median us": statistics.median(v),
             "min us": min(v), "max us": max(v)}
            for k, v in runs.items()
        ]  # fmt: skip
        print(tabulate(summary, headers="keys", floatfmt=".1f"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
