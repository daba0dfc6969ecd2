"""Held-out curves of examples/train_lm.py runs: one PNG and a table.

    python scripts/plot_curves.py runs/lm_*.json --out runs/lm_curves.png

Plots each run's held-out bits/byte against the step (one line per run, labelled
exchange/precision/seed) and prints, per run, the final held-out bits/byte and its gap in %
to the run of the same seed with exchange and precision "bf16" (blank where there is none),
then each configuration's mean gap over its seeds.
The plot needs matplotlib (the "plot" or "examples" extra); --no-plot prints the table only.
"""

from __future__ import annotations

import argparse
import json
import sys


def load_runs(paths: list[str]) -> list[dict]:
    """The runs' JSON records, each with "label" (exchange/precision/seed) and "path" added."""
    runs = []
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        if not run.get("complete", True):  # cut short: curves, no final result
            print(f"{path}: incomplete, last held-out eval at step {run['eval']['step'][-1]}")
            continue
        c = run["config"]
        runs.append({**run, "path": path, "label": f"{c['exchange']}/{c['precision']}/{c['seed']}"})
    return runs


def comparable(runs: list[dict]) -> str | None:
    """Why the runs cannot be compared (they differ in world size, model size, tokens per
    step or corpus), or None."""
    keys = {
        "world size": lambda r: r["config"].get("world"),
        "parameters": lambda r: r["config"].get("params", {}).get("total"),
        "tokens per step": lambda r: (
            None if "batch" not in r["config"]
            else r["config"].get("world", 1) * r["config"]["batch"] * r["config"]["seq_len"]
        ),
        "corpus sha256": lambda r: r.get("corpus", {}).get("sha256"),
        "expert-parallel degree": lambda r: r["config"].get("ep"),
    }  # fmt: skip
    for what, get in keys.items():
        seen = {get(r) for r in runs}
        if len(seen) > 1:
            return f"the runs differ in {what}: " + ", ".join(
                f"{r['label']} {get(r)}" for r in runs
            )
    return None


def table(
    runs: list[dict], baseline: str = "bf16/bf16"
) -> list[tuple[str, float, float | None, str]]:
    """[(label, final value, gap in % to the same seed's ``baseline`` run (exchange/precision)
    or None, path)]."""
    base = {
        r["config"]["seed"]: r["final_bits_per_byte"]
        for r in runs
        if f"{r['config']['exchange']}/{r['config']['precision']}" == baseline
    }
    rows = []
    for r in runs:
        ref = base.get(r["config"]["seed"])
        gap = None if ref is None else 100 * (r["final_bits_per_byte"] / ref - 1)
        rows.append((r["label"], r["final_bits_per_byte"], gap, r["path"]))
    return rows


def plot(runs: list[dict], out: str) -> None:
    """One line per run: held-out bits/byte against the step, into the PNG ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    configs = sorted({r["label"].rsplit("/", 1)[0] for r in runs})
    seeds = sorted({r["config"]["seed"] for r in runs})
    styles = ["-", "--", ":", "-."]
    for r in runs:  # a colour per configuration, a line style per seed
        color = f"C{configs.index(r['label'].rsplit('/', 1)[0]) % 10}"
        style = styles[seeds.index(r["config"]["seed"]) % len(styles)]
        ax.plot(r["eval"]["step"], r["eval"]["bits_per_byte"], label=r["label"], lw=1,
                color=color, linestyle=style)  # fmt: skip
    finals = [r["final_bits_per_byte"] for r in runs]
    highest = max(max(r["eval"]["bits_per_byte"]) for r in runs)
    ax.set_ylim(0.97 * min(finals), min(highest, 1.5 * max(finals)) + 1e-3)  # the late steps
    metric = runs[0].get("metric", "held-out bits/byte")
    ax.set(xlabel="step", ylabel=metric, title="examples/train_lm.py" if "metric" not in runs[0]
           else "torchtitan")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("runs", nargs="+", help="JSON files written by train_lm.py --json")
    p.add_argument("--out", default="curves.png", help="the PNG to write")
    p.add_argument("--no-plot", action="store_true", help="print the table only")
    p.add_argument("--compare-anyway", action="store_true",
                   help="compare runs that differ in world size, model size, tokens per step "
                   "or corpus")  # fmt: skip
    p.add_argument("--baseline", default="bf16/bf16",
                   help="exchange/precision of the runs the gaps are taken to")  # fmt: skip
    a = p.parse_args(argv)
    runs = sorted(load_runs(a.runs), key=lambda r: r["label"])
    if (problem := comparable(runs)) is not None and not a.compare_anyway:
        sys.exit(f"{problem}; their gaps would not measure the wire (--compare-anyway to go on)")
    print(f"{'run (exchange/precision/seed)':40s} {'final bits/byte':>16s} {'vs base':>9s}  file")
    gaps: dict[str, list[float]] = {}
    for label, final, gap, path in table(runs, a.baseline):
        print(f"{label:40s} {final:16.4f} {'' if gap is None else f'{gap:+.2f}%':>9s}  {path}")
        if gap is not None:
            gaps.setdefault(label.rsplit("/", 1)[0], []).append(gap)
    for config, g in gaps.items():  # the mean over the seeds that have a bf16 run
        print(f"{config + ' mean':40s} {'':16s} {sum(g) / len(g):+8.2f}%  ({len(g)} seeds)")
    if a.no_plot:
        return
    try:
        plot(runs, a.out)
    except ImportError:
        sys.exit("the plot needs matplotlib: pip install matplotlib (or pass --no-plot)")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
