"""Sweep the cast kernels' launch parameters (BLOCK_G, num_warps) on the current GPU.

    python scripts/tune_cast.py [--json out.json]

Prints GB/s (bytes read + written) for each configuration; the best go into
mxfp8_a2a/_config.py.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from functools import partial
from pathlib import Path

import torch
import triton
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import versions, warm_gpu, write_json  # noqa: E402

import mxfp8_a2a as mx  # noqa: E402
from mxfp8_a2a import _config  # noqa: E402

SHAPES = [(131072, 5120), (8192, 5120), (2048, 7168)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    print(versions())
    warm_gpu()  # the first tiling timed is not to run on a cold GPU
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
    write_json(args.json, {"versions": versions(), "results": rows})


if __name__ == "__main__":
    main()
