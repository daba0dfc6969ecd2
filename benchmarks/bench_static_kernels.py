"""The static dispatch's kernels one by one (MXFP8 wire, bf16 rows, a group of one rank):
the plan (kernels against the torch reference) and each row kernel, us per call beside
the HBM bound of its bytes (each read and written once, at --copy-tbs), replayed from a
CUDA graph of --reps calls (median of --iters replays, per call).

    python benchmarks/bench_static_kernels.py [--shape 8192x2048x8x16 ...] [--tile 2048 ...]

Shapes are TOKENSxHIDDENxTOPKxEXPERTS (bench_moe_layer.py's, capacity factor 1.25);
--tile repeats the row kernels at other STATIC_ROWS_TILE values (elements per program).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import Help, versions, warm_gpu, write_json
from tabulate import tabulate

from mxfp8_a2a import _config
from mxfp8_a2a.exchange.rows import wire_row
from mxfp8_a2a.moe import capacity_for, plan, static_rows
from mxfp8_a2a.moe import rows as sr


def graph_us(fn, reps: int, iters: int) -> float:
    """Per-call us of ``fn`` replayed ``reps`` times in one CUDA graph, median of iters."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(iters + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times[2:])


def _backward_at(tile: int, prefetch: bool, *args):
    """slot_sum_decode_backward(*args) at this tile and prefetch (read at launch)."""
    saved = _config.STATIC_BACKWARD_TILES
    _config.STATIC_BACKWARD_TILES = ((0, tile, prefetch),)
    try:
        return sr.slot_sum_decode_backward(*args, "mxfp8")
    finally:
        _config.STATIC_BACKWARD_TILES = saved


def bench(text: str, reps: int, iters: int, tbs: float) -> list[dict]:
    tokens, hidden, top_k, experts = (int(v) for v in text.split("x"))
    dev = torch.device("cuda")
    cap = capacity_for(tokens, top_k, 1, 1.25)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, hidden, device=dev, generator=g).bfloat16()
    grad = torch.randn(tokens, hidden, device=dev, generator=g).bfloat16()
    ids = torch.rand(tokens, experts, device=dev, generator=g).topk(top_k, 1).indices
    w = torch.rand(tokens, top_k, device=dev, generator=g)
    rows_of, sent, _ = plan.send_plan(ids, experts, 1, cap)
    src_row, out_row, _ = plan.receive_plan(sent, cap, 16)
    n_send, n_out = cap, static_rows(cap, 1, experts, 16)
    buf = sr.scatter_encode(x, rows_of, n_send, "mxfp8")
    y = sr.gather_decode(buf, src_row, hidden, torch.bfloat16, "mxfp8")
    back = sr.gather_encode(y, out_row, "mxfp8")
    kept, wire, row = tokens * top_k, wire_row(hidden), 2 * hidden
    steps = {  # name: (call, bytes read + written once)
        "send_plan": (lambda: plan.send_plan(ids, experts, 1, cap), 0),
        "send_plan_reference": (lambda: plan.send_plan_reference(ids, experts, 1, cap), 0),
        "receive_plan": (lambda: plan.receive_plan(sent, cap, 16), 0),
        "receive_plan_reference": (lambda: plan.receive_plan_reference(sent, cap, 16), 0),
        "scatter_encode": (lambda: sr.scatter_encode(x, rows_of, n_send, "mxfp8"),
                           tokens * row + kept * wire),
        "gather_decode": (lambda: sr.gather_decode(buf, src_row, hidden, torch.bfloat16, "mxfp8"),
                          kept * wire + n_out * row),
        "gather_encode": (lambda: sr.gather_encode(y, out_row, "mxfp8"), kept * row + cap * wire),
        "slot_sum_decode": (lambda: sr.slot_sum_decode(back, rows_of, w, hidden, torch.bfloat16,
                                                       "mxfp8"), kept * wire + tokens * row),
        "slot_sum_decode_backward": (
            lambda: sr.slot_sum_decode_backward(grad, back, rows_of, w, n_send, "mxfp8"),
            tokens * row + 2 * kept * wire),
    }  # fmt: skip
    for tile in (2048, 4096):  # the combine backward at other tiles, with and without prefetch
        for pf in (True, False):
            steps[f"slot_sum_decode_backward, tile {tile}{'' if pf else ', no prefetch'}"] = (
                lambda t=tile, p=pf: _backward_at(t, p, grad, back, rows_of, w, n_send),
                tokens * row + 2 * kept * wire)  # fmt: skip
    out = []
    for name, (fn, nbytes) in steps.items():
        us = graph_us(fn, reps, iters)
        bound = nbytes / (tbs * 1e12) * 1e6
        out.append(dict(shape=text, step=name, tile=_config.STATIC_ROWS_TILE, us=us,
                        bound_us=bound, over=us / bound if bound else float("nan")))  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    p.add_argument("--shape", action="append", help="TOKENSxHIDDENxTOPKxEXPERTS")
    p.add_argument("--tile", action="append", type=int, help="STATIC_ROWS_TILE values")
    p.add_argument("--reps", type=int, default=10, help="calls per graph")
    p.add_argument("--iters", type=int, default=10, help="graph replays")
    p.add_argument("--copy-tbs", type=float, default=4.21, help="device copy TB/s (H200)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    warm_gpu()
    results = []
    for tile in args.tile or [_config.STATIC_ROWS_TILE]:
        _config.STATIC_ROWS_TILE = tile
        for text in args.shape or ["4096x7168x8x32", "8192x2048x8x16"]:
            results += bench(text, args.reps, args.iters, args.copy_tbs)
    print(versions())
    rows = [[r["shape"], r["step"], r["tile"], r["us"], r["bound_us"], r["over"]] for r in results]
    print(tabulate(rows, headers=["shape", "step", "tile", "us", "bound us", "x bound"],
                   floatfmt=".1f"))  # fmt: skip
    write_json(args.json, {"versions": versions(), "results": results})


if __name__ == "__main__":
    main()
