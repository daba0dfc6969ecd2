"""Experiment: the exchange captured in a CUDA graph (fixed shapes and splits) against eager.

    torchrun --nproc-per-node=2 scripts/exp_graphs.py

Per shape: eager and graphed bf16 all_to_all_single and mxfp8 exchange (forward, and
forward+backward), ms timed by the benchmarks' Timer (barrier + sync before each call, CUDA
events, median of 30 after 5, max over ranks); and whether a replay on new input gives the
eager result bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

import mxfp8_a2a as mx
from mxfp8_a2a._launch import capture_graph, init_from_torchrun

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import Timer  # noqa: E402


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

    timer = Timer(device, iters=30, warmup=5)
    row = {"tokens": tokens}
    for name, fn in (("bf16", bf16), ("mxfp8 fwd", fwd), ("mxfp8 fwd+bwd", fwd_bwd)):
        row[name] = timer(lambda _, fn=fn: fn())
        graph, _ = capture_graph(fn)
        row[name + " graph"] = timer(lambda _, g=graph: g.replay())
    # bit for bit: replay on new input == eager on it
    graph, out = capture_graph(fwd)
    x.copy_(torch.randn_like(x))
    graph.replay()
    row["graph exact"] = bool(torch.equal(out, fwd()))
    graph, (y, gx) = capture_graph(fwd_bwd)
    xg.data.copy_(torch.randn_like(x))
    graph.replay()
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
