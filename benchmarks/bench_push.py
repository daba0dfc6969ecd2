"""The static dispatch's push transport on one GPU, W ranks emulated (exchange/push.py).

    python benchmarks/bench_push.py [--ranks 2 4 8] [--factor 1.25] [--json out.json]

Per-rank MoE shapes (tokens x hidden, top-k, experts): DeepSeek-V3 4096x7168 top-8 of 256,
Qwen3-30B-A3B 8192x2048 top-8 of 128; random routing; capacity = capacity_for(T, k, W,
factor). On one GPU every store lands in the same HBM, so these are HBM-bound numbers, to
compare with the device copy, not with NVLink:

- send, local: the NCCL path's encoder (scatter_encode into a send buffer of W * cap rows);
- send, push: the same encoder storing straight into W emulated receive buffers (what one
  rank does);
- receive: decoding this rank's buffer into the expert-major output (static_rows rows);
- dispatch, W ranks: the whole forward of dispatch_static on every rank at once (counts
  exchange, 4 barriers, send, receive; one CUDA graph of W streams), per call.

GB/s: bytes read + written once (x, wire rows sent, output written) over the time.
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import Help, do_bench_ms, report, warm_gpu

import mxfp8_a2a as mx
from mxfp8_a2a.exchange.push import PushBuffer
from mxfp8_a2a.exchange.rows import wire_row
from mxfp8_a2a.moe import row_kernels as sk
from mxfp8_a2a.moe.plan import receive_plan, send_plan

SHAPES = [("DeepSeek-V3", 4096, 7168, 8, 256), ("Qwen3-30B-A3B", 8192, 2048, 8, 128)]
SPINS = 10_000_000  # bounded barriers: a benchmark must not hang


def _row(shape, w, name, ms, nbytes, copy_gbs):
    gbs = nbytes / ms / 1e6
    return {"shape": shape, "ranks": w, "kernel": name, "us": round(ms * 1e3, 1),
            "GB/s": round(gbs), "of copy": f"{gbs / copy_gbs:.0%}"}  # fmt: skip


def _graph_of_ranks(bufs, xs, ids, experts, cap):
    """One CUDA graph: every rank's dispatch_static forward on a stream of its own."""

    def issue():
        cur = torch.cuda.current_stream()
        streams = [torch.cuda.Stream() for _ in bufs]
        for r, (b, s) in enumerate(zip(bufs, streams, strict=True)):
            s.wait_stream(cur)
            with torch.cuda.stream(s):
                mx.dispatch_static(xs[r], ids[r], experts, cap, transport=b)
        for s in streams:  # (joined after all are queued: the ranks must run at once)
            cur.wait_stream(s)

    for b in bufs:  # (every kernel loaded before any barrier waits)
        b.spin_limit = 0
    with torch.no_grad():
        issue()
        torch.cuda.synchronize()
        for b in bufs:
            b.reset()
            b.spin_limit = SPINS
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            issue()
    return g


def bench(name, t, h, k, experts, w, factor):
    shape = f"{name} {t}x{h} top-{k}/{experts}"
    cap = mx.capacity_for(t, k, w, factor)
    g = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(w)]
    ids = [torch.rand(t, experts, device="cuda", generator=g).topk(k, 1).indices for _ in range(w)]
    bufs = PushBuffer.emulated(w, h, experts, capacity=cap, spin_limit=SPINS)
    rows_of = send_plan(ids[0], experts, w, cap)[0]
    recv = torch.stack([send_plan(i, experts, w, cap)[1][0] for i in ids])  # rank 0's [W, L]
    src_row = receive_plan(recv, cap, 16)[0]
    x_bytes, wire = t * h * 2, wire_row(h)
    send_bytes = x_bytes + int((rows_of >= 0).sum()) * wire
    recv_bytes = int(recv.sum()) * wire + src_row.numel() * h * 2
    copy = torch.empty_like(xs[0])
    copy_ms = do_bench_ms(lambda: copy.copy_(xs[0]))
    copy_gbs = 2 * x_bytes / copy_ms / 1e6
    table = bufs[0].table("rows", cap, wire)
    own = bufs[0].received("rows", w * cap, wire, torch.uint8)
    rows = [_row(shape, w, "device copy of x", copy_ms, 2 * x_bytes, copy_gbs)]
    ms = do_bench_ms(lambda: sk.scatter_encode(xs[0], rows_of, w * cap, "mxfp8", "rceil"))
    rows.append(_row(shape, w, "send, local buffer", ms, send_bytes, copy_gbs))
    ms = do_bench_ms(lambda: sk.scatter_encode_into(xs[0], rows_of, table, wire, cap, "mxfp8",
                                                    "rceil", True))  # fmt: skip
    rows.append(_row(shape, w, "send, push", ms, send_bytes, copy_gbs))
    ms = do_bench_ms(lambda: sk.gather_decode(own, src_row, h, torch.bfloat16, "mxfp8"))
    rows.append(_row(shape, w, "receive", ms, recv_bytes, copy_gbs))
    graph = _graph_of_ranks(bufs, xs, ids, experts, cap)
    ms = do_bench_ms(graph.replay)
    for b in bufs:
        b.check()
    rows.append(_row(shape, w, f"dispatch, {w} ranks", ms, w * (send_bytes + recv_bytes),
                     copy_gbs))  # fmt: skip
    for b in bufs:
        b.free()
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="ranks emulated")
    p.add_argument("--factor", type=float, default=1.25, help="capacity factor")
    p.add_argument("--json", help="write the results to this JSON file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_push.py needs a CUDA GPU")
    warm_gpu()
    results = []
    for name, t, h, k, e in SHAPES:
        for w in args.ranks:
            results += bench(name, t, h, k, e, w, args.factor)
    report(results, args.json)


if __name__ == "__main__":
    main()
