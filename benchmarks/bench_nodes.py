"""Bytes between nodes per token, flat against node-aware dispatch, bf16 against MXFP8: a
model of DeepSeek-V3's MoE layer at 2 to 16 nodes, and a check that the real code sends the
model's bytes.

The model draws routing as ExpertParallelMoE's router does (softmax top-k of random logits;
with --max-nodes M also DeepSeek-V3's node-limited choice of the M best nodes) and counts,
per token: flat, one row per (token, slot) whose expert is on another node; node-aware, one
row per other node the token reaches (moe/node_plan.py). Per leg, a row is wire_row(H) bytes
on MXFP8 and 2H on bf16; a step moves four legs (dispatch and combine, forward and
backward), each preset with its own wires. The modelled time of one leg on one rank:
node-aware, its bytes between nodes at --ib-gbs then its bytes within the node at
--nvlink-gbs (the two hops run one after the other); flat, the larger of the two (one
all-to-all carries both at once). Link speeds are the user's figures, not measurements.

Without torchrun: the model's table. Under torchrun (gloo on CPU, NCCL on GPUs, e.g.
``torchrun --nproc-per-node=4 benchmarks/bench_nodes.py --check 2``): also dispatch and
combine of the real code at a small size on emulated nodes of --check ranks, whose
sent_bytes, summed over the ranks, must equal the model's count for the same routing (the
script fails if not); with --time, the time of dispatch + combine, forward and backward, flat
against node-aware, per preset, at --tokens x --hidden with --experts (median of --iters, max
over ranks). Nodes emulated inside one host cross NVLink, not a network: such times say what
the two hops cost there, not what they save between real nodes.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from common import Help, Timer, versions
from tabulate import tabulate

import mxfp8_a2a as mx
from mxfp8_a2a.exchange.rows import wire_row
from mxfp8_a2a.exchange.wires import layer_wires
from mxfp8_a2a.moe.routing import _route

PRESETS = ("bf16", "mxfp8_to_experts", "mxfp8")
LEGS = ("dispatch_fwd", "dispatch_bwd", "combine_fwd", "combine_bwd")


def draw_ids(tokens, experts, top_k, nodes, max_nodes, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    groups = None if max_nodes is None or max_nodes >= nodes else (nodes, max_nodes)
    return _route(logits, top_k, None, groups)[1]


def rows_per_token(ids, src_rank, experts, ranks, per_node) -> dict[str, tuple[int, int]]:
    """(rows within, rows between nodes) that tokens of ``src_rank`` send, summed over them,
    for one forward leg: {"flat": ..., "node": ...}."""
    dest = ids // (experts // ranks)  # expert ranks [T, k]
    node, src_node = dest // per_node, src_rank // per_node
    flat_between = int((node != src_node).sum())
    flat_within = int(((node == src_node) & (dest != src_rank)).sum())
    reached = torch.zeros(ids.shape[0], ranks // per_node, dtype=torch.bool)
    reached.scatter_(1, node, True)
    reached[:, src_node] = False
    forwarder = node * per_node + src_rank % per_node
    node_within = int((dest != forwarder).sum())
    return {"flat": (flat_within, flat_between), "node": (node_within, int(reached.sum()))}


def model(args) -> list[dict]:
    rows = []
    for nodes in args.nodes:
        ranks = nodes * args.per_node
        limits = [None]  # node-limited routing only where it limits: M < nodes
        if args.max_nodes is not None and 0 < args.max_nodes < nodes:
            limits.append(args.max_nodes)
        for limit in limits:
            ids = draw_ids(args.tokens, args.experts, args.top_k, nodes, limit, args.seed)
            # (a rank's tokens; the source's local index does not change the counts' law)
            per = rows_per_token(ids, 0, args.experts, ranks, args.per_node)
            for route in ("flat", "node"):
                within, between = (v / args.tokens for v in per[route])
                row = {"nodes": nodes, "max_nodes": limit or "-", "route": route}
                row |= {"rows_between": round(between, 3), "rows_within": round(within, 3)}
                for preset in PRESETS:
                    wires = layer_wires(preset)
                    size = {"mxfp8": wire_row(args.hidden), "bf16": 2 * args.hidden}
                    legs = [size[w] for w in wires]
                    kb = sum(legs) * between / 1024
                    t = []
                    for b in legs:
                        ib = between * b * args.tokens / (args.ib_gbs * 1e9) * 1e3
                        nv = within * b * args.tokens / (args.nvlink_gbs * 1e9) * 1e3
                        t.append(ib + nv if route == "node" else max(ib, nv))
                    row[f"{preset}_KB"] = round(kb, 1)
                    row[f"{preset}_ms_modelled"] = round(sum(t), 2)
                rows.append(row)
    return rows


def check(args, device, topo) -> dict:
    """The real code on emulated nodes: sent_bytes summed over ranks == the model's count."""
    rank, world = dist.get_rank(), dist.get_world_size()
    experts, hidden, top_k, tokens = 4 * world, 64, min(args.top_k, 4 * world), 48
    nodes = world // args.check
    ids = draw_ids(tokens, experts, top_k, nodes, None, args.seed + rank).to(device)
    x = torch.randn(tokens, hidden, device=device).bfloat16()
    result = {}
    for preset in PRESETS:
        wires = layer_wires(preset)
        size = {"mxfp8": wire_row(hidden), "bf16": 2 * hidden}
        per = rows_per_token(ids.cpu(), rank, experts, world, args.check)
        for route, kw in (("flat", {}), ("node", {"topology": topo})):
            ex, _, handle = mx.dispatch(x.requires_grad_(), ids, experts, exchange=preset, **kw)
            mx.combine(ex, torch.rand(tokens, top_k, device=device), handle).sum().backward()
            got = mx.sent_bytes(handle, topo)
            for leg, wire in zip(LEGS, wires, strict=True):
                want = [per[route][0] * size[wire], per[route][1] * size[wire]]
                pair = torch.tensor([got[leg]["within"], got[leg]["between"], *want], device=device)
                dist.all_reduce(pair)
                pair = pair.tolist()
                if pair[:2] != pair[2:]:
                    raise SystemExit(f"{route} {preset} {leg}: sent {pair[:2]}, model {pair[2:]}")
                result[f"{route}/{preset}/{leg}"] = pair[:2]
    return result


def time_routes(args, device, topo) -> list[dict]:
    """ms of dispatch + combine forward and backward per route and preset (Timer: barrier,
    CUDA events, median, max over ranks)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes = world // args.check
    ids = draw_ids(args.tokens, args.experts, args.top_k, nodes, None, args.seed + rank)
    ids, w = ids.to(device), torch.rand(args.tokens, args.top_k, device=device)
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=torch.bfloat16)
    timer, rows = Timer(device, args.iters, args.warmup), []
    for preset in PRESETS:
        row = {"preset": preset}
        for route, kw in (("flat", {}), ("node", {"topology": topo})):

            def step(_, kw=kw, preset=preset):
                xi = x.detach().requires_grad_()
                ex, _, handle = mx.dispatch(xi, ids, args.experts, exchange=preset, **kw)
                mx.combine(ex, w, handle).float().sum().backward()

            row[f"{route}_ms"] = round(timer(step), 3)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8, 16], help="node counts")
    p.add_argument("--per-node", type=int, default=8, help="GPUs per node")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=7168, help="values per row")
    p.add_argument("--experts", type=int, default=256, help="in all")
    p.add_argument("--top-k", type=int, default=8, help="experts per token")
    p.add_argument("--max-nodes", type=int, default=4, help="the node-limited routing's M")
    p.add_argument("--ib-gbs", type=float, default=50.0, help="GB/s per GPU between nodes")
    p.add_argument("--nvlink-gbs", type=float, default=450.0, help="GB/s per GPU in a node")
    p.add_argument("--seed", type=int, default=0, help="of the routing's random logits")
    p.add_argument("--check", type=int, default=0, help="ranks per emulated node (torchrun)")
    p.add_argument("--time", action="store_true", help="time flat vs node-aware (torchrun)")
    p.add_argument("--iters", type=int, default=20, help="--time: timed iterations")
    p.add_argument("--warmup", type=int, default=5, help="--time: untimed first")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    distributed = args.check > 0
    device = torch.device("cpu")
    if distributed:
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rows = model(args)
    out = {"versions": versions(), "args": vars(args), "model": rows}
    if distributed:
        topo = mx.NodeTopology(None, args.check)  # (its sub-groups: once)
        out["check"] = check(args, device, topo)
        if args.time:
            out["time"] = time_routes(args, device, topo)
    if not distributed or dist.get_rank() == 0:
        print(tabulate(rows, headers="keys"))
        print(
            f"rows: per token and leg; KB: per token and step (the four legs), between "
            f"nodes; ms_modelled: per step and rank, {args.tokens} tokens, at an assumed "
            f"{args.ib_gbs} GB/s between nodes and {args.nvlink_gbs} within (not measured)"
        )
        if distributed:
            print(f"check: sent_bytes equal the model on every leg ({len(out['check'])} legs)")
        if "time" in out:
            shape = f"{args.tokens}x{args.hidden}, {args.experts} experts top-{args.top_k}"
            print(f"measured: dispatch + combine, forward + backward, ms ({device.type}, {shape}):")
            print(tabulate(out["time"], headers="keys"))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
