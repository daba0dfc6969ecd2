"""Sweep the launch configuration of casts that run beside a collective (BESIDE_COMM_* in
mxfp8_a2a/_config.py) on the current GPU, alone: the grid capped at SMs - free programs.

    python scripts/tune_beside.py [--free 32] [--json out.json]

The work is what the exchange of 131072x5120 bf16 rows between 2 ranks with 4 column pieces
gives each rank: quantize one piece (65536 x 1280 of a 131072 x 5120 tensor) into 16-byte
aligned packed rows, dequantize one piece back into its columns, and the round trip of the
65536 kept rows (x 5120). Prints GB/s (bytes read + written) per configuration and the
best one by total time (one round trip + 3 quantize + 3 dequantize pieces, as in the
exchange).
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial

import torch
import triton
from tabulate import tabulate

from mxfp8_a2a import _config
from mxfp8_a2a._exchange import _dequantize_into, _quantize_into, _roundtrip_into, _wire_row

CONFIGS = list(itertools.product([256, 512, 1024, 2048], [4, 8, 16, 32]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--free", type=int, default=_config.BESIDE_COMM_FREE_SMS)
    p.add_argument("--json")
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = sms - args.free
    m, k, w = 131072, 5120, 1280
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    half = m // 2
    buf = torch.empty(half, _wire_row(w), dtype=torch.uint8, device="cuda")
    out = torch.empty_like(x)
    _quantize_into(x[:, :w], buf, "rceil", (0, half))
    bytes_q = half * w * 2 + half * (w + w // 32)
    bytes_d = half * (w + w // 32) + half * w * 2
    bytes_rt = half * k * 4
    rows = []
    for block_g, warps in CONFIGS:
        _config.BESIDE_COMM_BLOCK_G, _config.BESIDE_COMM_NUM_WARPS = block_g, warps
        fns = {
            "quantize": partial(_quantize_into, x[:, w : 2 * w], buf, "rceil", (0, half), programs),
            "dequantize": partial(_dequantize_into, buf, out[half:, w : 2 * w], (0, 0), programs),
            "round trip": partial(_roundtrip_into, x[:half], out[:half], "rceil", programs),
        }
        try:
            t = {n: triton.testing.do_bench(f, return_mode="median") for n, f in fns.items()}
        except Exception as e:  # noqa: BLE001 - a configuration out of resources
            print(f"BLOCK_G={block_g} warps={warps}: {type(e).__name__}")
            continue
        total = t["round trip"] + 3 * t["quantize"] + 3 * t["dequantize"]
        rows.append(
            {
                "BLOCK_G": block_g,
                "warps": warps,
                "quantize us": t["quantize"] * 1e3,
                "quantize GB/s": bytes_q / t["quantize"] / 1e6,
                "dequantize us": t["dequantize"] * 1e3,
                "dequantize GB/s": bytes_d / t["dequantize"] / 1e6,
                "round trip us": t["round trip"] * 1e3,
                "round trip GB/s": bytes_rt / t["round trip"] / 1e6,
                "total us": total * 1e3,
            }
        )
    print(f"{torch.cuda.get_device_name()}: {programs} programs ({sms} SMs, {args.free} free)")
    print(tabulate(rows, headers="keys", floatfmt=".0f"))
    best = min(rows, key=lambda r: r["total us"])
    print(f"best: {best['BLOCK_G']},{best['warps']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"programs": programs, "free": args.free, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
