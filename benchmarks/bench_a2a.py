"""bf16 vs MXFP8 all-to-all exchange, forward, backward and forward+backward.

Start with torchrun, one process per GPU (NCCL), or on a machine without GPUs (gloo):

    torchrun --nproc-per-node=2 benchmarks/bench_a2a.py
    torchrun --nproc-per-node=2 benchmarks/bench_a2a.py --shape 256x512 --iters 3 --json out.json

Each timed iteration: barrier, device sync, then CUDA events (host clock on CPU) around
exactly what a training step calls. The median over --iters iterations after warm-up is
taken per rank, then the max over ranks. Shapes are TOKENSxDIM per rank.

The bf16 baseline is the library's own exchange of unquantized rows
(mxfp8_a2a.exchange.plain.all_to_all_rows, a plain differentiable all-to-all).
Columns: algbw = logical bf16 bytes each rank sends (tokens x dim x 2) / time, in GB/s;
busbw = algbw * the share of those rows that leave the rank (the max over ranks; (n-1)/n
with equal splits, as nccl-tests define it); SQNR of the forward output and of the
gradient against the bf16 exchange, in dB; the mxfp8 phases are quantize, a packed uint8
all_to_all_single of all rows (the NCCL transport sends only the rows that leave the rank,
in 16-byte wire rows) and dequantize, each timed alone. --splits: equal, skewed (each rank
keeps the most; every rank receives the same total) or hot (rank 0 receives the most).
--transport picks the MXFP8 transports compared: nccl (default), copy_engine (automatic row
ranges) or copy_engine:R (R row ranges); repeat to compare.

Environment: NCCL_P2P_DISABLE=1 makes NCCL go through host memory on one host, a stand-in
for an inter-node link. MXFP8_A2A_VALIDATE=1 turns on the split check (one extra small
collective per call).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from common import Help, Progress, Timer, parse_shape, sqnr_db, versions, write_json
from tabulate import tabulate

import mxfp8_a2a as mx
from mxfp8_a2a._torchrun import capture_graph, init_from_torchrun
from mxfp8_a2a.exchange.plain import all_to_all_rows
from mxfp8_a2a.formats.dequantize import dequantize_packed
from mxfp8_a2a.formats.quantize import quantize_packed

GPU_SHAPES = [f"{t}x5120" for t in (256, 2048, 8192, 16384, 32768, 65536, 131072)] + ["16384x7168"]
CPU_SHAPES = ["256x512"]


def make_splits(tokens: int, world: int, rank: int, kind: str) -> list[int]:
    """Rows this rank sends to each rank. "equal"; "skewed": destination j counted from this
    rank gets weight 1 / (j + 1) (every rank keeps the most and receives the same total);
    "hot": destination j gets weight 1 / (j + 1) on every rank (rank 0 receives the most,
    as a rank holding popular experts does)."""
    if kind == "equal":
        base = [tokens // world] * world
    else:
        w = [1.0 / ((j - rank if kind == "skewed" else j) % world + 1) for j in range(world)]
        base = [int(tokens * v / sum(w)) for v in w]
    base[rank] += tokens - sum(base)
    return base


def wire_fraction(in_splits: list[int], out_splits: list[int], rank: int) -> dict[str, float]:
    """Per direction, the share of the rows a rank sends that leave it (the max over ranks),
    for busbw: (n - 1) / n with equal splits, as nccl-tests count it."""
    fractions = []
    for sent in (in_splits, out_splits):  # forward, then backward (splits swapped)
        fractions.append((sum(sent) - sent[rank]) / max(sum(sent), 1))
    t = torch.tensor(fractions, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    fwd, bwd = t.tolist()
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": (fwd + bwd) / 2}


def time_directions(name, f, x, grad, timer) -> dict:
    """Forward (no grad), backward alone (graph built untimed), forward+backward."""

    def fwd_graph():
        return f(x.detach().requires_grad_(True))

    with torch.no_grad():
        fwd = timer(lambda _: f(x))
    bwd = timer(lambda y: y.backward(grad), setup=fwd_graph)
    both = timer(lambda _: fwd_graph().backward(grad))
    return {f"{name} fwd": fwd, f"{name} bwd": bwd, f"{name} fwd+bwd": both}


def time_graphed(name, f, x, grad, timer) -> dict:
    """Replays of f's forward (no grad) and forward+backward captured in CUDA graphs."""

    def fwd():
        with torch.no_grad():
            f(x)

    def both():
        f(x.detach().requires_grad_(True)).backward(grad)

    res = {}
    for phase, fn in (("fwd", fwd), ("fwd+bwd", both)):
        graph, _ = capture_graph(fn)
        res[f"{name} graph {phase}"] = timer(lambda _, g=graph: g.replay())
        del graph
    return res


def transport_for(text: str, group=None):
    """The transport argument for a --transport value."""
    if text == "nccl":
        return "nccl"
    name, _, ranges = text.partition(":")
    if name != "copy_engine":
        raise SystemExit(f"--transport must be nccl, copy_engine or copy_engine:R, got {text!r}")
    return mx.CopyEngineTransport(group, row_ranges=int(ranges) if ranges else None)


def bench_shape(tokens, dim, kind, timer, device, mode, transports, graphs=False):
    world, rank = dist.get_world_size(), dist.get_rank()
    in_splits = make_splits(tokens, world, rank, kind)
    out_splits = mx.compute_output_splits(in_splits)
    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)
    grad = torch.randn(sum(out_splits), dim, device=device, dtype=torch.bfloat16)

    def bf16(x_):  # the library's own bf16 exchange (a plain differentiable all-to-all)
        return all_to_all_rows(x_, out_splits, in_splits)

    def mxfp8(transport):
        return lambda x_: mx.to_mxfp8_a2a_dequant(
            x_, out_splits, in_splits, scaling_mode=mode, transport=transport
        )

    res = time_directions("bf16", bf16, x, grad, timer)
    for label, transport in transports.items():
        res.update(time_directions(f"mxfp8 {label}", mxfp8(transport), x, grad, timer))
    if graphs:
        res |= time_graphed("bf16", bf16, x, grad, timer)
        res |= time_graphed("mxfp8 nccl", mxfp8("nccl"), x, grad, timer)
    packed = quantize_packed(x, scaling_mode=mode)
    recv = packed.new_empty((sum(out_splits), packed.shape[1]))
    res["quant"] = timer(lambda _: quantize_packed(x, scaling_mode=mode))
    res["exchange"] = timer(lambda _: dist.all_to_all_single(recv, packed, out_splits, in_splits))
    res["dequant"] = timer(lambda _: dequantize_packed(recv))
    with torch.no_grad():
        res["sqnr_fwd_db"] = sqnr_db(bf16(x), mx.to_mxfp8_a2a_dequant(x, out_splits, in_splits))
        # the backward exchange: the gradient goes the other way, with the splits swapped
        back = mx.to_mxfp8_a2a_dequant(grad, in_splits, out_splits)
        res["sqnr_bwd_db"] = sqnr_db(all_to_all_rows(grad, in_splits, out_splits), back)
    res["bytes_per_rank_bf16"] = tokens * dim * 2
    res["bytes_per_rank_mxfp8"] = tokens * mx.packed_row_bytes(dim)
    res["wire_fraction"] = wire_fraction(in_splits, out_splits, rank)
    return res


def table_rows(shape: str, kind: str, r: dict, world: int, labels, cuda: bool) -> list[list]:
    rows = []
    for label in labels:
        shown = label if cuda else f"{label} (over gloo)"  # the transport runs on either
        for phase, factor in (("fwd", 1), ("bwd", 1), ("fwd+bwd", 2)):
            b, m = r[f"bf16 {phase}"], r[f"mxfp8 {label} {phase}"]
            nbytes = r["bytes_per_rank_bf16"] * factor
            algbw_b, algbw_m = nbytes / b / 1e6, nbytes / m / 1e6
            bus = r["wire_fraction"][phase]
            sqnr = r["sqnr_bwd_db"] if phase == "bwd" else r["sqnr_fwd_db"]
            if phase == "fwd+bwd":
                sqnr = min(r["sqnr_fwd_db"], r["sqnr_bwd_db"])
            rows.append(
                [shape, kind, shown, phase, b, m, b / m, algbw_b, algbw_b * bus, algbw_m,
                 algbw_m * bus, sqnr]
            )  # fmt: skip
    return rows


GRAPH_HEADERS = ["shape", "dir", "bf16 ms", "bf16 graph ms", "mxfp8 graph ms", "vs bf16"]
GRAPH_HEADERS += ["vs bf16 graph"]


def graph_rows(results: dict) -> list[list]:
    rows = []
    for shape, r in results.items():
        for phase in ("fwd", "fwd+bwd"):
            b, bg = r[f"bf16 {phase}"], r[f"bf16 graph {phase}"]
            mg = r[f"mxfp8 nccl graph {phase}"]
            rows.append([shape, phase, b, bg, mg, b / mg, bg / mg])
    return rows


HEADERS = [
    "shape", "splits", "transport", "dir", "bf16 ms", "mxfp8 ms", "speedup",
    "bf16 algbw GB/s", "bf16 busbw GB/s", "mxfp8 algbw* GB/s", "mxfp8 busbw* GB/s",
    "SQNR dB",
]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    p.add_argument("--shape", action="append", help="TOKENSxDIM per rank (repeatable)")
    p.add_argument("--splits", choices=["equal", "skewed", "hot"], default="equal",
                   help="rows per destination (see above)")  # fmt: skip
    p.add_argument("--iters", type=int, default=20, help="timed iterations (median; default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations first")
    p.add_argument(
        "--transport",
        action="append",
        help="MXFP8 transport: nccl (default), copy_engine or copy_engine:R (R row ranges;"
        " two ranks on CUDA GPUs); repeat to compare",
    )
    p.add_argument("--scaling-mode", choices=["rceil", "floor"], default="rceil",
                   help="how each block's power-of-two scale is rounded")  # fmt: skip
    p.add_argument(
        "--graphs",
        action="store_true",
        help="also time bf16 and mxfp8 (nccl) captured in CUDA graphs (CUDA only)",
    )
    p.add_argument("--json", help="write all numbers to this JSON file (rank 0)")
    p.add_argument("--plot", help="write a PNG of speedup vs tokens (needs matplotlib)")
    args = p.parse_args(argv)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib: pip install matplotlib (or 'mxfp8_a2a[plot]')")

    device = init_from_torchrun()
    cuda = device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes = args.shape or (GPU_SHAPES if cuda else CPU_SHAPES)
    timer = Timer(device, args.iters, args.warmup)
    transports = {t: transport_for(t) for t in (args.transport or ["nccl"])}
    info = versions() | {
        "world_size": world,
        "splits": args.splits,
        "scaling_mode": args.scaling_mode,
        "iters": args.iters,
        "warmup": args.warmup,
        "argv": sys.argv[1:] if argv is None else argv,
    }
    info["NCCL_P2P_DISABLE"] = os.environ.get("NCCL_P2P_DISABLE", "0")
    info["transports"] = list(transports)
    info["graphs"] = bool(args.graphs and cuda)
    progress = Progress(len(shapes), enabled=rank == 0)
    results, rows = {}, []
    for text in shapes:
        tokens, dim = parse_shape(text)
        r = bench_shape(
            tokens, dim, args.splits, timer, device, args.scaling_mode, transports,
            args.graphs and cuda,
        )  # fmt: skip
        results[text] = r
        rows += table_rows(text, args.splits, r, world, transports, cuda)
        progress.step(text)
    if rank == 0:
        if not cuda:
            print("CPU/gloo run: these timings say nothing about GPUs (a smoke test only).")
        if args.iters < 10:
            print(f"{args.iters} timed iterations: medians this few are noise (fwd+bwd may "
                  "come out faster than fwd); take --iters 20 or more to compare")  # fmt: skip
        print(" ".join(f"{k}={v}" for k, v in info.items()))
        print(tabulate(rows, headers=HEADERS, floatfmt=".3f"))
        phases = [
            [s, r["quant"], r["exchange"], r["dequant"], r["bf16 fwd"]] for s, r in results.items()
        ]
        print("\nmxfp8 phases, forward (ms, each timed alone; the exchange of all rows, packed):")
        print(
            tabulate(
                phases,
                headers=["shape", "quant", "exchange", "dequant", "bf16 fwd"],
                floatfmt=".3f",
            )
        )
        print("* mxfp8 GB/s count the logical bf16 bytes, so they compare directly with bf16's.")
        if args.graphs and cuda:
            print("\nCUDA graph replays (ms; speedup of mxfp8 graph over eager and graphed bf16):")
            graphed = graph_rows(results)
            print(tabulate(graphed, headers=GRAPH_HEADERS, floatfmt=".3f"))
        write_json(args.json, {"info": info, "results": results})
        if args.plot:
            plot(results, info, args.plot)
    for t in transports.values():
        if isinstance(t, mx.CopyEngineTransport):
            t.close()
    dist.destroy_process_group()


def plot(results: dict, info: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    items = sorted(((parse_shape(s), r) for s, r in results.items()), key=lambda t: t[0])
    for phase in ("fwd", "bwd", "fwd+bwd"):
        xs = [t for (t, _), _ in items]
        label = info["transports"][0]
        ys = [r[f"bf16 {phase}"] / r[f"mxfp8 {label} {phase}"] for _, r in items]
        ax.plot(xs, ys, marker="o", label=phase)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("speedup of mxfp8 over bf16")
    p2p = " NCCL_P2P_DISABLE=1" if info.get("NCCL_P2P_DISABLE") == "1" else ""
    ax.set_title(f"{info['gpu']} x{info['world_size']}{p2p}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
