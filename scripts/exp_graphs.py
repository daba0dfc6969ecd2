"""Experiment: the exchange captured in a CUDA graph (fixed shapes and splits) against eager.

    torchrun --nproc-per-node=2 scripts/exp_graphs.py

Per shape: eager and graphed bf16 all_to_all_single and mxfp8 exchange (forward, and
forward+backward), ms as bench_a2a times them (barrier + sync before each call, CUDA
events, median over calls, max over ranks); and whether a replay on new input gives the
eager result bit for bit.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

import mxfp8_a2a as mx
from mxfp8_a2a._launch import capture_graph, init_from_torchrun


def timed(fn, reps: int = 30) -> float:
    times = []
    for _ in range(reps + 5):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    t = torch.tensor([statistics.median(times[5:])], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def graphed(fn):
    """(replay, outputs) of fn captured in a CUDA graph."""
    graph, out = capture_graph(fn)
    return graph.replay, out


def shape_row(tokens: int, device: torch.device, world: int) -> dict:
    k = 5120
    splits = [tokens // world] * world
    out_splits = mx.compute_output_splits(splits)
    x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    grad = torch.randn(sum(out_splits), k, device=device, dtype=torch.bfloat16)
    y16 = torch.empty(sum(out_splits), k, device=device, dtype=torch.bfloat16)

    def bf16():
        dist.all_to_all_single(y16, x, out_splits, splits)
        return y16

    def fwd():
        with torch.no_grad():
            return mx.to_mxfp8_a2a_dequant(x, out_splits, splits)

    def fwd_bwd():
        xg.grad = None
        y = mx.to_mxfp8_a2a_dequant(xg, out_splits, splits)
        y.backward(grad)
        return y, xg.grad

    row = {"tokens": tokens}
    for name, fn in (("bf16", bf16), ("mxfp8 fwd", fwd), ("mxfp8 fwd+bwd", fwd_bwd)):
        row[name] = timed(fn)
        replay, _ = graphed(fn)
        row[name + " graph"] = timed(replay)
    # bit for bit: replay on new input == eager on it
    replay, out = graphed(fwd)
    x.copy_(torch.randn_like(x))
    replay()
    row["graph exact"] = bool(torch.equal(out, fwd()))
    replay, (y, gx) = graphed(fwd_bwd)
    xg.data.copy_(torch.randn_like(x))
    replay()
    y_e, gx_e = fwd_bwd()
    row["graph exact bwd"] = bool(torch.equal(y, y_e) and torch.equal(gx, gx_e))
    return row


def main() -> None:
    device = init_from_torchrun()
    rank, world = dist.get_rank(), dist.get_world_size()
    for tokens in (256, 2048, 8192, 131072):
        row = shape_row(tokens, device, world)
        if rank == 0:
            print(row, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
