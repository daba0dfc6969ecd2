"""Workers of test_node_edges.py: the node-aware route's edge cases (top_k = 0, capacity 0,
nodes of unequal size, top_k or LOCAL_WORLD_SIZE that differ between ranks), each raising
the same error on every rank or returning what the flat path returns."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import mxfp8_a2a as mx
from mxfp8_a2a.moe import topology as tp


def _raises_alike(fn, *needles: str) -> str:
    """Run fn, which must raise a ValueError holding every needle; return its message, after
    checking (one all_gather) that every rank raised the same."""
    try:
        fn()
    except ValueError as e:
        message = str(e)
    else:
        message = "no error"
    assert all(n in message for n in needles), message
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, message)
    assert len(set(got)) == 1, got
    return message


def _route(dispatch, combine, topology, k, capacity=None):
    """One dispatch and combine of 5 tokens top-k, with the backward: (out, x.grad, w.grad)."""
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(5, 64, generator=g).requires_grad_(True)
    ids = torch.randint(0, 8, (5, k), generator=g)
    w = (torch.rand(5, k, generator=g) + 0.1).requires_grad_(True)
    args = (8,) if capacity is None else (8, capacity)
    ex, _, handle = dispatch(x, ids, *args, topology=topology)
    out = combine(ex * 2, w, handle)
    out.float().square().sum().backward()
    return out.detach(), x.grad, w.grad


def top_k_zero_and_capacity_zero(rank, world):
    """top_k = 0 (host-synced, static, the layer) and capacity 0 (static) on the node route
    give what the flat path gives: zeros, gradients zero, forward and backward."""
    topo = mx.NodeTopology(None, 2)
    synced, static = (mx.dispatch, mx.combine), (mx.dispatch_static, mx.combine_static)
    for (dispatch, combine), k, capacity in ((synced, 0, None), (static, 0, 4), (static, 2, 0)):
        flat = _route(dispatch, combine, None, k, capacity)
        node = _route(dispatch, combine, topo, k, capacity)
        for a, b in zip(flat, node, strict=True):
            assert torch.equal(a, b) and not a.any(), (k, capacity)
    for capacity in (None, 4):  # ExpertParallelMoE(top_k=0), host-synced and static
        kw = {} if capacity is None else {"capacity": capacity, "max_tokens": 5}
        layer = mx.ExpertParallelMoE(64, 32, 8, 0, seed=1, topology=topo, **kw)
        x = torch.randn(5, 64).requires_grad_(True)
        out = layer(x)
        out.sum().backward()
        assert not out.any() and not x.grad.any() and not layer.experts.w1.grad.any()
    dist.barrier()


def unequal_nodes_raise_alike(rank, world):
    """LOCAL_WORLD_SIZE that splits the group into nodes of unequal size (world 3: 2 + 1;
    world 5 would be 2 + 2 + 1), or that differs between the ranks: the same ValueError on
    every rank, with the sizes found, from NodeTopology and the layer's "auto"."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        sizes = f"nodes of [2, {world - 2}] ranks" if world == 3 else "nodes of [2, 2, 1]"
        _raises_alike(lambda: mx.NodeTopology(None), sizes, f"rank(s) {list(range(world))}")
        _raises_alike(lambda: mx.ExpertParallelMoE(64, 32, 2 * world, 2, seed=1), sizes)
        # one rank's LOCAL_WORLD_SIZE differs (its node holds the whole group)
        os.environ["LOCAL_WORLD_SIZE"] = str(world if rank == 0 else 1)
        _raises_alike(lambda: tp.shared_topology(None), "LOCAL_WORLD_SIZE differs between ranks")
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
        tp._shared.clear()
    dist.barrier()


def top_k_differs_raises_alike(rank, world):
    """topk_ids with another k on one rank: the same ValueError on every rank, flat and node
    route, host-synced and static."""
    topo = mx.NodeTopology(None, 2)
    x = torch.randn(4, 64)
    ids = torch.randint(0, 8, (4, 3 if rank == 1 else 2))
    for t in (None, topo):
        _raises_alike(lambda t=t: mx.dispatch(x, ids, 8, topology=t), "top_k differs")
        _raises_alike(lambda t=t: mx.dispatch_static(x, ids, 8, 8, topology=t), "top_k differs")
    dist.barrier()


def kept_topologies_are_never_dropped(rank, world):
    """shared_topology keeps one topology per group for the process's life; past SHARED_MAX
    it refuses (the same ValueError on every rank) instead of dropping one in use."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    old, tp.SHARED_MAX = tp.SHARED_MAX, 1
    try:
        first = tp.shared_topology(None)
        assert first is not None and first.spans_nodes and tp.shared_topology(None) is first
        _raises_alike(lambda: tp.shared_topology(None, 2), "more than SHARED_MAX=1")
        assert tp.shared_topology(None) is first
    finally:
        tp.SHARED_MAX = old
        del os.environ["LOCAL_WORLD_SIZE"]
        tp._shared.clear()
    dist.barrier()
