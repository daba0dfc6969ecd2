"""Sweep the cast kernels' launch parameters (BLOCK_G, num_warps) on the current GPU.

    python scripts/tune_cast.py [--json out.json]

Prints GB/s (bytes read + written) for each configuration; the best go into
mxfp8_a2a/_config.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial

import torch
import triton
from tabulate import tabulate

import mxfp8_a2a as mx
from mxfp8_a2a import _config

SHAPES = [(131072, 5120), (8192, 5120), (2048, 7168)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    for m, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        packed = mx.quantize_packed(x)
        nbytes = 3 * m * k + m * k // 32
        for block_g, warps in itertools.product([32, 64, 128, 256], [4, 8]):
            _config.QUANTIZE_BLOCK_G = _config.DEQUANTIZE_BLOCK_G = block_g
            _config.QUANTIZE_NUM_WARPS = _config.DEQUANTIZE_NUM_WARPS = warps
            q = triton.testing.do_bench(partial(mx.quantize_packed, x), return_mode="median")
            d = triton.testing.do_bench(partial(mx.dequantize_packed, packed), return_mode="median")
            rows.append(
                {
                    "shape": f"{m}x{k}",
                    "BLOCK_G": block_g,
                    "warps": warps,
                    "quant GB/s": nbytes / q / 1e6,
                    "dequant GB/s": nbytes / d / 1e6,
                }
            )
    print(tabulate(rows, headers="keys", floatfmt=".0f"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
