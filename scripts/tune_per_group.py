"""Sweep the per-group scaling kernels' tile sizes on the current GPU.

    python scripts/tune_per_group.py [--json out.json]

x (16640, 8192) bf16, 1/16/64 jagged groups; prints microseconds and effective GB/s
(3 bytes per element) for each rowwise (BLOCK_N, BLOCK_C, warps) and colwise
(BLOCK_M, BLOCK_K); the best go into mxfp8_a2a/_config.py.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
from tabulate import tabulate

from mxfp8_a2a import _config, per_group_colwise_scales, per_group_rowwise_scales

N, M = 16640, 8192


def offsets(total: int, n_groups: int, g: torch.Generator) -> torch.Tensor:
    cuts = torch.randperm(total // 16 - 1, generator=g)[: n_groups - 1].add(1).mul(16).sort().values
    return torch.cat([cuts, torch.tensor([total])]).to(torch.int32).cuda()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, M, dtype=torch.bfloat16).cuda()
    rows = []
    for n_groups in (1, 16, 64):
        offs1, offs0 = offsets(M, n_groups, g), offsets(N, n_groups, g)
        for bn, bc, warps in itertools.product([4, 8, 16, 32], [128, 256, 512, 1024], [4, 8]):
            if bn * bc > 16384:
                continue
            _config.ROWWISE_BLOCK_N, _config.ROWWISE_BLOCK_C, _config.ROWWISE_NUM_WARPS = (
                bn,
                bc,
                warps,
            )
            ms = triton.testing.do_bench(
                lambda o=offs1: per_group_rowwise_scales(x, o, method="direct"),
                return_mode="median",
            )
            rows.append(
                {
                    "fn": "rowwise",
                    "groups": n_groups,
                    "tile": f"{bn}x{bc} w{warps}",
                    "us": ms * 1e3,
                    "GB/s": 3 * N * M / ms / 1e6,
                }
            )
        for bm, bk in itertools.product([32, 64, 128], [64, 128, 256]):
            _config.COLWISE_BLOCK_M, _config.COLWISE_BLOCK_K = bm, bk
            ms = triton.testing.do_bench(
                lambda o=offs0: per_group_colwise_scales(x, o), return_mode="median"
            )
            rows.append(
                {
                    "fn": "colwise",
                    "groups": n_groups,
                    "tile": f"{bm}x{bk}",
                    "us": ms * 1e3,
                    "GB/s": 3 * N * M / ms / 1e6,
                }
            )
    print(tabulate(rows, headers="keys", floatfmt=".1f"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
