"""The figures README.md and BENCHMARKS.md quote, computed from the results files.

    python benchmarks/figures.py          # each figure, its value, source files, card and date
    python benchmarks/figures.py --check  # exit 1 if a document lacks a figure's current text
                                          # or a results file is cited nowhere

Each figure is computed here from files under benchmarks/results/ and quoted in the documents
as the exact text this script prints; tests/test_figures.py runs the check, so a figure edited
in a document without its file (or a file replaced without the documents) fails the tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
LAYER = "2026-12-04/moe_layer_static.json"
EXPERTS = "2026-12-02/experts_step_inverse.json"
PUSH = "2026-12-04/push_8ranks.json"
NODES = "2026-12-06/nodes.json"
AB = "2026-12-05/engine_ab/ab_{}_{}.json"
LM = "2026-12-05/lm_h100/lm_{}_bf16_{}.json"
LM_FILES = "2026-12-05/lm_h100/lm_*.json"
SHAPES = ("4096x7168x8x32x2048", "8192x2048x8x16x768")


def load(name: str) -> dict:
    with open(RESULTS / name) as f:
        return json.load(f)


def layer_ms(shape: str, variant: str) -> float:
    rows = load(LAYER)["results"]
    return next(r["total"] for r in rows if r["shape"] == shape and r["variant"] == variant)


def ratios(values: list[float], fmt: str = "{:.2f}x") -> str:
    """'a / b' for two values, 'lo-hi' for more."""
    if len(values) == 2:
        return " / ".join(fmt.format(v) for v in values)
    return f"{min(values):.2f}-{fmt.format(max(values))}"


def graph_gain() -> str:
    """The static bf16 layer replayed from a CUDA graph over the host-synced bf16 layer eager."""
    return ratios([layer_ms(s, "sync bf16") / layer_ms(s, "static bf16, graph") for s in SHAPES])


def graph_wire() -> str:
    """Graph against graph: static bf16 over static MXFP8 (one rank: no wire to save)."""
    return ratios(
        [layer_ms(s, "static bf16, graph") / layer_ms(s, "static mxfp8, graph") for s in SHAPES]
    )


def engine_gain() -> str:
    """The host-synced layer eager, before / after it moved onto the shared row engine (mean
    of the alternated runs), both shapes and wires."""
    gains = []
    for shape in SHAPES:
        for variant in ("sync-bf16", "sync-mxfp8"):
            mean = {}
            for side in ("before", "after"):
                runs = [load(AB.format(side, i))["results"] for i in (1, 2)]
                mean[side] = statistics.mean(
                    next(r["total"] for r in rs if r["shape"] == shape and r["variant"] == variant)
                    for rs in runs
                )
            gains.append(mean["before"] / mean["after"])
    return ratios(gains)


def fp8_experts() -> str:
    """The experts' step alone replayed from a CUDA graph: bf16 over each FP8 precision."""
    rows = load(EXPERTS)["experts"]
    us = {(r["shape"], r["precision"]): r["graph_replay_us"] for r in rows}
    return ratios([us[s, "bf16"] / us[s, p] for s in SHAPES
                   for p in ("fp8_rowwise", "fp8_rowwise_gw_hp")])  # fmt: skip


def push_speed() -> str:
    """The push send kernel's speed over the NCCL path's local-buffer send, 8 ranks."""
    rows = load(PUSH)["results"]
    us = {(r["shape"], r["kernel"]): r["us"] for r in rows}
    shapes = sorted({s for s, _ in us})
    return ratios([us[s, "send, local buffer"] / us[s, "send, push"] for s in shapes])


def lm_bits(exchange: str, seed: int) -> float:
    return load(LM.format(exchange, seed))["final_bits_per_byte"]


def loss_range(exchange: str) -> str:
    """Held-out bits per byte against bf16's of the same seed, lowest to highest."""
    d = [100 * (lm_bits(exchange, s) / lm_bits("bf16", s) - 1) for s in range(3)]
    return f"{min(d):+.2f}% to {max(d):+.2f}%"


def loss_mean(exchange: str) -> str:
    """The mean over seeds of bits per byte against bf16's mean."""
    mean = statistics.mean(lm_bits(exchange, s) for s in range(3))
    return f"{100 * (mean / statistics.mean(lm_bits('bf16', s) for s in range(3)) - 1):+.2f}%"


def bf16_spread() -> str:
    """bf16's own spread between seeds: (max - min) / mean of bits per byte."""
    v = [lm_bits("bf16", s) for s in range(3)]
    return f"{100 * (max(v) - min(v)) / statistics.mean(v):.2f}%"


def node_rows(route: str) -> str:
    """Rows per token crossing nodes at 2 / 4 nodes (the model, checked on the code); two
    decimals where the value is not near a whole number of rows."""
    rows = load(NODES)["model"]
    found = [r["rows_between"] for n in (2, 4) for r in rows
             if r["nodes"] == n and r["route"] == route and r["max_nodes"] == "-"]  # fmt: skip
    return " / ".join(f"{v:.1f}" if abs(v - round(v)) < 0.05 else f"{v:.2f}" for v in found)


def node_bytes() -> str:
    """Bytes crossing 2 nodes, flat bf16 over node-aware MXFP8 (the model)."""
    rows = {(r["nodes"], r["route"], r["max_nodes"]): r for r in load(NODES)["model"]}
    return f"{rows[2, 'flat', '-']['bf16_KB'] / rows[2, 'node', '-']['mxfp8_KB']:.1f}x"


@dataclass(frozen=True)
class Figure:
    name: str
    value: Callable[[], str]
    source: str  # results file(s)
    docs: tuple[str, ...]  # the documents that quote it


R, B = "README.md", "BENCHMARKS.md"
FIGURES = [
    Figure("graph gain (static graph vs synced eager, bf16)", graph_gain, LAYER, (R, B)),
    Figure("graph vs graph, MXFP8 over bf16 wires", graph_wire, LAYER, (B,)),
    Figure("synced layer, shared row engine gain", engine_gain, AB.format("*", "*"), (R, B)),
    Figure("FP8 experts' step vs bf16", fp8_experts, EXPERTS, (R, B)),
    Figure("push send vs NCCL path's send", push_speed, PUSH, (R, B)),
    Figure("loss, mxfp8 vs bf16 per seed", lambda: loss_range("mxfp8"), LM_FILES, (R, B)),
    Figure(
        "loss, mxfp8_to_experts vs bf16 per seed",
        lambda: loss_range("mxfp8_to_experts"),
        LM_FILES,
        (R, B),
    ),  # fmt: skip
    Figure("loss, mxfp8 mean vs bf16 mean", lambda: loss_mean("mxfp8"), LM_FILES, (R, B)),
    Figure("loss, bf16 spread between seeds", bf16_spread, LM_FILES, (R, B)),
    Figure("rows crossing nodes, node-aware", lambda: node_rows("node"), NODES, (R, B)),
    Figure("rows crossing nodes, flat", lambda: node_rows("flat"), NODES, (R, B)),
    Figure("bytes between 2 nodes, flat bf16 / node MXFP8", node_bytes, NODES, (R,)),
]


def card(source: str) -> str:
    """'GPU, date' of a results file (the first match of a pattern)."""
    path = sorted(RESULTS.glob(source))[0]
    info = json.loads(path.read_text()).get("versions")
    if info is None:  # (the runs of one folder share a versions.txt: its first line)
        first = (path.parent / "versions.txt").read_text().splitlines()[0]
        return f"{first}, {path.relative_to(RESULTS).parts[0]}"
    return f"{info.get('gpu', '?')}, {info.get('date', '?')}"


def missing() -> list[str]:
    """'document: figure "text"' for each quoted figure a document lacks."""
    texts = {d: " ".join((ROOT / d).read_text().split()) for d in (R, B)}  # (line breaks)
    return [f'{d}: {f.name} "{f.value()}"' for f in FIGURES for d in f.docs
            if f.value() not in texts[d]]  # fmt: skip


def uncited() -> list[str]:
    """Files under benchmarks/results/ that neither document cites: by name, as NAME.txt`,
    `.json, through a{b,c}d braces, or through a cited folder (results/DATE/FOLDER/)."""
    import re

    text = " ".join(" ".join((ROOT / d).read_text().split()) for d in (R, B))
    names = set(re.findall(r"([\w.-]+)\.txt`, `\.json", text))
    names = {n + ".json" for n in names}
    for head, alts, tail in re.findall(r"([\w-]*)\{([\w,]+)\}([\w.-]*)", text):
        names |= {head + alt + tail for alt in alts.split(",")}
        names |= {head + alt + ".json" for alt in alts.split(",") if "`.json`" in text}
    folders = re.findall(r"results/([\w-]+/[\w-]+)/", text)
    return sorted(
        str(f.relative_to(RESULTS)) for f in RESULTS.rglob("*") if f.is_file()
        and f.name not in text and f.name not in names
        and not any(str(f.relative_to(RESULTS)).startswith(d + "/") for d in folders)
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--check", action="store_true", help="exit 1 if a document lacks a figure")
    args = p.parse_args()
    if args.check:
        if problems := missing():
            print("figures not quoted as computed (update the document or the results file):")
            print("\n".join(problems))
            sys.exit(1)
        if files := uncited():
            print("results files cited nowhere (cite them or delete them):", *files, sep="\n")
            sys.exit(1)
        print(f"all {len(FIGURES)} figures quoted as computed; every results file cited")
        return
    for f in FIGURES:
        print(f"{f.name}: {f.value()}  ({f.source}; {card(f.source)}; in {', '.join(f.docs)})")


if __name__ == "__main__":
    main()
