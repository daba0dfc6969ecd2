"""The FP8 experts' colwise pieces at the MoE benchmark's shapes under several colwise
tilings, in interleaved rounds (single timings on the H200 vary: scripts/timing_spread.py).

    python scripts/compare_colwise_tilings.py [--rounds 5] [--tiling FIELD=VALUE,...]... [--json F]

Each --tiling is _config.COLWISE_TILING with the fields given replaced (e.g.
``amax_stages=0,cast_stages=0``); the default compares the current tiling with itself
without pipelining. Pieces: the forward's weights per (expert, column) and the grad_w
operands padded per group (fp8_rowwise.py), plus one rowwise cast as a control that no
colwise tiling touches. Prints min / median / max microseconds per piece and tiling.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
from pathlib import Path

import torch
import triton

from mxfp8_a2a import _config

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import versions, warm_gpu, write_json  # noqa: E402
from profile_grouped_mm import uneven_offsets  # noqa: E402

fr = importlib.import_module("mxfp8_a2a.grouped.fp8_rowwise")


def parse_tiling(text: str) -> _config.ColwiseTiling:
    fields = dict(item.split("=") for item in text.split(",") if item)
    return _config.COLWISE_TILING._replace(**{k: int(v) for k, v in fields.items()})


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tiling", action="append", metavar="FIELD=VALUE,...")
    p.add_argument("--json", help="write every round's times to this JSON file")
    args = p.parse_args()
    tilings = [parse_tiling(t) for t in (args.tiling or ["", "amax_stages=0,cast_stages=0"])]
    g = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=g).to("cuda", torch.bfloat16)  # noqa: E731
    w_small, w_big = randn(16, 2048, 768), randn(32, 7168, 2048)
    a768, a2048, a7168 = randn(65536, 768), randn(32768, 2048), randn(32768, 7168)
    o16, o32 = uneven_offsets(65536, 16, g), uneven_offsets(32768, 32, g)
    cases = {
        "w per column [16, 2048, 768]": lambda: fr._weights_per_column(w_small),
        "w per column [32, 7168, 2048]": lambda: fr._weights_per_column(w_big),
        "padded per group [65536, 768], 16": lambda: fr.padded_token_scales(a768, o16),
        "padded per group [32768, 2048], 32": lambda: fr.padded_token_scales(a2048, o32),
        "padded per group [32768, 7168], 32": lambda: fr.padded_token_scales(a7168, o32),
        "control: scale rows [32768, 2048]": lambda: fr._scale_rows(a2048),
    }
    warm_gpu()
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for i, tiling in enumerate(tilings):
            _config.COLWISE_TILING = tiling
            for name, fn in cases.items():
                ms = triton.testing.do_bench(fn, warmup=50, rep=150, return_mode="median")
                times.setdefault((name, i), []).append(ms * 1e3)
    for i, tiling in enumerate(tilings):
        print(f"tiling {i}: {tuple(tiling)}")
    print(f"{'piece':38s} tiling   min us   median      max")
    for (name, i), v in times.items():
        print(f"{name:38s} {i:6d} {min(v):8.1f} {statistics.median(v):8.1f} {max(v):8.1f}")
    rows = [{"piece": name, "tiling": list(tilings[i]), "us": v} for (name, i), v in times.items()]
    write_json(args.json, {"versions": versions(), "results": rows})


if __name__ == "__main__":
    main()
