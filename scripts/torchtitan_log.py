"""A torchtitan trainer log -> the JSON record scripts/plot_curves.py reads.

    python scripts/torchtitan_log.py run.txt --wire mxfp8 --seed 0 --ep 2 --json run.json

Reads the trainer's "step: N  loss: X ... tps: Y" lines (colour codes stripped): the
training loss per step, the median tokens/s per GPU past the first 5 steps, and the final
loss (the mean of the last 10 steps', the figure plot_curves.py compares). Runs of wire
"torchtitan" (torchtitan's own dispatcher) are the baseline the others' gaps are taken to.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics

LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.eE+na]+).*?tps:\s*([\d,]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse(text: str) -> tuple[list[int], list[float], list[float]]:
    """(steps, losses, tokens/s per GPU) of the trainer's metric lines."""
    steps, losses, tps = [], [], []
    for line in ANSI.sub("", text).splitlines():
        if (m := LINE.search(line)) is not None:
            steps.append(int(m[1]))
            losses.append(float(m[2]))
            tps.append(float(m[3].replace(",", "")))
    return steps, losses, tps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("log", help="the trainer's output")
    p.add_argument("--wire", required=True, help='"torchtitan" or the preset the run used')
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--ep", type=int, required=True, help="expert-parallel degree")
    p.add_argument("--json", required=True, help="the record to write")
    a = p.parse_args(argv)
    with open(a.log) as f:
        steps, losses, tps = parse(f.read())
    if not steps:
        raise SystemExit(f"{a.log}: no 'step: N  loss: X ... tps: Y' lines (did the run fail?)")
    final = sum(losses[-10:]) / len(losses[-10:])
    record = {
        "config": {"exchange": "bf16" if a.wire == "torchtitan" else a.wire,
                   "precision": "torchtitan" if a.wire == "torchtitan" else "bf16",
                   "seed": a.seed, "ep": a.ep},
        "metric": "training loss",
        "eval": {"step": steps, "bits_per_byte": losses},
        "tokens_per_s_per_gpu": statistics.median(tps[5:] or tps),
        "final_bits_per_byte": final, "complete": True,
    }  # fmt: skip
    with open(a.json, "w") as f:
        json.dump(record, f)
    print(f"{a.log}: {len(steps)} steps, final loss {final:.4f}, "
          f"{record['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU")  # fmt: skip


if __name__ == "__main__":
    main()
