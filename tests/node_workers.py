"""Workers of test_nodes.py: the node-aware route (dispatch(..., topology=...)) on emulated
nodes, against the flat path and a plain-torch model of its hops (:func:`node_model`).

The model, for experts y = x * FACTOR and the loss sum(out * grad): dispatch's rows are the
flat path's; each expert row (t, j) is weighted where the expert is, z = (w rounded to bf16)
* y in fp32, rounded; combine sends z on its forward wire to the forwarder of its node,
which sums the token's rows of the node in fp32 (slot order), rounds and sends the sum on
the same wire; the source sums its nodes in the order of their first slots in fp32, one
rounding. Backward: each slot's row receives grad[t] through the combine's backward wire
(one copy per node, the same bits), and x's gradient sums like combine's forward."""

from __future__ import annotations

import torch
import torch.distributed as dist
from wires_workers import FACTOR, leg

import mxfp8_a2a as mx
from mxfp8_a2a.exchange.wires import layer_wires

HIDDEN = 64


def node_inputs(src, seed, tokens, top_k, experts, hidden=HIDDEN):
    """x bf16 [T, H] (rank-encoded), ids [T, k] drawn with repeats, weights fp32 [T, k],
    grad bf16 [T, H] of rank src."""
    g = torch.Generator().manual_seed(seed * 100 + src)
    scale = torch.exp2(torch.randint(-8, 9, (tokens, 1), generator=g).float())
    x = torch.randn(tokens, hidden, generator=g) * scale
    x[:, 0], x[:, 1] = src + 1, torch.arange(tokens).float()
    ids = torch.randint(0, experts, (tokens, top_k), generator=g)
    w = torch.rand(tokens, top_k, generator=g) + 0.1
    grad = torch.randn(tokens, hidden, generator=g)
    return x.bfloat16(), ids, w, grad.bfloat16()


def _sum_by_node(rows, node, wire):
    """rows [k, H] of one token (bf16), node [k]: the two-level sum of the hops."""
    acc = torch.zeros(rows.shape[1])
    for m in dict.fromkeys(node.tolist()):  # nodes in the order of their first slots
        part = torch.zeros(rows.shape[1])
        for j in torch.nonzero(node == m).flatten().tolist():
            part = part + leg(rows[j : j + 1], wire).float()[0]
        acc = acc + leg(part.bfloat16()[None], wire).float()[0]
    return acc.bfloat16()


def node_model(rank, world, g, seed, tokens, top_k, per_rank, wires: mx.Wires):
    """Rank ``rank``'s expected (rows by local expert, their gradients, out, x's gradient,
    the weights' gradient fp32 [T, k] and the sums of its terms' magnitudes)."""
    experts, per_node = per_rank * world, per_rank * g
    rows = [[] for _ in range(per_rank)]
    grads = [[] for _ in range(per_rank)]
    for s in range(world):
        x, ids, w, gr = node_inputs(s, seed, tokens[s], top_k, experts)
        for lid in range(per_rank):
            t_idx, j_idx = torch.nonzero(ids == rank * per_rank + lid, as_tuple=True)
            rows[lid].append(leg(x[t_idx], wires.dispatch_fwd))
            gz = leg(gr[t_idx], wires.combine_bwd).float()
            grads[lid].append((w.bfloat16().float()[t_idx, j_idx, None] * gz).bfloat16())
    x, ids, w, gr = node_inputs(rank, seed, tokens[rank], top_k, experts)
    out, gx = torch.zeros(x.shape, dtype=torch.bfloat16), torch.zeros(x.shape).bfloat16()
    gw, gw_abs = torch.zeros(w.shape), torch.zeros(w.shape)
    wb = w.bfloat16().float()
    y = leg(x, wires.dispatch_fwd) * FACTOR
    gz = leg(gr, wires.combine_bwd).float()
    for t in range(x.shape[0]):
        node = ids[t] // per_node
        z = (wb[t, :, None] * y[t].float()).bfloat16()  # [k, H]
        out[t] = _sum_by_node(z, node, wires.combine_fwd)
        gy = (wb[t, :, None] * gz[t]).bfloat16() * FACTOR
        gx[t] = _sum_by_node(gy, node, wires.dispatch_bwd)
        gw[t] = (gz[t] * y[t].float()).sum(-1)
        gw_abs[t] = (gz[t] * y[t].float()).abs().sum(-1)
    rows, grads = [torch.cat(r) for r in rows], [torch.cat(r) for r in grads]
    return rows, grads, out, gx, gw, gw_abs


def route_matches_model(rank, world, backend, seed, tokens, top_k, per_rank, layouts, exchanges):
    """For each ranks-per-node G in ``layouts`` and each exchange: the node-aware dispatch's
    rows equal the flat path's bit for bit, and everything equals :func:`node_model`."""
    experts = per_rank * world
    x, ids, w, grad = node_inputs(rank, seed, tokens[rank], top_k, experts)
    for g in layouts:
        topo = mx.NodeTopology(None, g)
        for exchange in exchanges:
            wires = layer_wires(exchange)
            flat, _, _ = mx.dispatch(x, ids, experts, exchange=exchange)
            xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            ex, counts, handle = mx.dispatch(xi, ids, experts, exchange=exchange, topology=topo)
            what = f"{g} per node, {exchange}, rank {rank}"
            assert torch.equal(ex.detach(), flat), what
            y = ex * FACTOR
            y.retain_grad()
            out = mx.combine(y, wi, handle)
            (out.float() * grad.float()).sum().backward()
            if g == world:  # one node: the flat path itself
                assert handle.nodes is None
                continue
            assert handle.nodes is not None
            want = node_model(rank, world, g, seed, tokens, top_k, per_rank, wires)
            starts = [0, *torch.tensor(counts).cumsum(0).tolist()[:-1]]
            for lid, a in enumerate(starts):
                n = want[0][lid].shape[0]
                assert torch.equal(ex[a : a + n].detach(), want[0][lid]), (what, lid)
                assert torch.equal(y.grad[a : a + n], want[1][lid]), (what, lid)
            assert torch.equal(out.detach(), want[2]), what
            assert torch.equal(xi.grad, want[3]), what
            bound = 2 * HIDDEN * 2.0**-24 * want[5] + 1e-6
            assert ((wi.grad - want[4]).abs() <= bound).all(), what
    dist.barrier()


def expected_bytes(world, g, seed, tokens, top_k, per_rank, row: int, ids_of=None):
    """Every rank's bytes to other ranks on one leg, summed over the ranks, from the routing
    alone: {"node": (within, between), "flat": (within, between)}: node-aware, a row per
    (token, node) between nodes and a row per slot from the forwarder to other ranks of the
    node; flat, a row per slot."""
    experts = per_rank * world
    node_w = node_b = flat_w = flat_b = 0
    for s in range(world):
        ids = ids_of(s) if ids_of else node_inputs(s, seed, tokens[s], top_k, experts)[1]
        dest = ids // per_rank  # the experts' ranks
        for t in range(ids.shape[0]):
            nodes = {int(d) // g for d in dest[t]}
            node_b += len(nodes - {s // g})
            for d in dest[t].tolist():
                forwarder = d // g * g + s % g
                node_w += d != forwarder
                flat_b += d // g != s // g
                flat_w += d // g == s // g and d != s
    return {"node": (node_w * row, node_b * row), "flat": (flat_w * row, flat_b * row)}


def bytes_match_routing(rank, world, backend, seed, tokens, top_k, per_rank, layouts):
    """sent_bytes of the node-aware and the flat dispatch, summed over the ranks, against
    :func:`expected_bytes` on every leg; routing kept within each token's own node sends
    nothing between nodes."""
    experts = per_rank * world
    for g in layouts:
        topo = mx.NodeTopology(None, g)

        def own(s, g=g):  # ids on the source's own node only
            ids = node_inputs(s, seed, tokens[s], top_k, experts)[1]
            return ids % (per_rank * g) + s // g * per_rank * g

        for ids_of in (None, own):
            x, ids, _, _ = node_inputs(rank, seed, tokens[rank], top_k, experts)
            ids = ids_of(rank) if ids_of else ids
            for exchange, row in (("mxfp8", 80), ("bf16", 2 * HIDDEN)):
                want = expected_bytes(world, g, seed, tokens, top_k, per_rank, row, ids_of)
                for key, kwargs in (("node", {"topology": topo}), ("flat", {})):
                    _, _, handle = mx.dispatch(x, ids, experts, exchange=exchange, **kwargs)
                    got = mx.sent_bytes(handle, topo)
                    for name in ("dispatch_fwd", "dispatch_bwd", "combine_fwd", "combine_bwd"):
                        t = torch.tensor([got[name]["within"], got[name]["between"]])
                        dist.all_reduce(t)
                        assert tuple(t.tolist()) == want[key], (g, exchange, key, name, t, want)
                    if ids_of is own:
                        assert want[key][1] == 0
    dist.barrier()


def layer_takes_the_route(rank, world, backend, path, g):
    """ExpertParallelMoE with a NodeTopology: close to the flat layer (the same experts; the
    sums in another order), under DistributedDataParallel after prepare_ddp, and its
    state dict through torch.distributed.checkpoint the flat layer's; host-synced and static."""
    topo = mx.NodeTopology(None, g)
    x = torch.randn(5 + rank, 64, generator=torch.Generator().manual_seed(rank))
    for static in ({"capacity": 32}, {}):  # (dropless)
        kw = {"exchange": "bf16", "seed": 3, **static}
        node = mx.ExpertParallelMoE(64, 32, 2 * world, 3, topology=topo, **kw)
        flat = mx.ExpertParallelMoE(64, 32, 2 * world, 3, topology=None, **kw)
        assert node.topology is topo and flat.topology is None
        _close_under_ddp(node, flat, x)
        assert node.read_dispatch_stats()["dropped"] == 0
    _dcp_round_trip(node, flat, path, world)
    dist.barrier()


def _close_under_ddp(node, flat, x) -> None:
    outs = []
    for layer in (node, flat):
        net = torch.nn.Sequential(layer)
        mx.prepare_ddp(net)
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        out = ddp(x)
        out.square().sum().backward()
        outs.append((out.detach(), layer.router.grad, layer.experts.w1.grad))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _dcp_round_trip(node, flat, path, world) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(node.state_dict(), checkpoint_id=path)
    other = mx.ExpertParallelMoE(64, 32, 2 * world, 3, exchange="bf16", seed=4, topology=None)
    state = other.state_dict()
    dcp.load(state, checkpoint_id=path)
    other.load_state_dict(state)
    assert torch.equal(other.experts.w1, flat.experts.w1)
    assert torch.equal(other.router, flat.router)


def bad_topology_fails_everywhere(rank, world, backend):
    """A rank that describes other nodes than the others: the same error on every rank."""
    try:
        mx.NodeTopology(None, 1 if rank == 1 else 2)
    except ValueError as e:
        assert "ranks_per_node differs between ranks ([2, 1, 2, 2] by rank)" in str(e), e
    else:
        raise AssertionError("no error")
    try:
        mx.NodeTopology(None, 3 if rank == 0 else 2)
    except ValueError as e:
        assert "rank(s) [0]" in str(e) and "ranks_per_node must be a positive int" in str(e), e
    else:
        raise AssertionError("no error")
    from torch.distributed.device_mesh import DeviceMesh

    try:  # a mesh whose rows are not the group's ranks in order
        mx.NodeTopology(None, mesh=DeviceMesh("cpu", [[0, 2], [1, 3]]))
    except ValueError as e:
        assert "mesh's ranks [0, 2, 1, 3] (row-major) must be the group's ranks" in str(e), e
    else:
        raise AssertionError("no error")
    topo = mx.NodeTopology(None, 2)  # one rank passes none: dispatch tells every rank
    x, ids = torch.randn(4, 64), torch.randint(0, 8, (4, 2))
    try:
        mx.dispatch(x, ids, 8, topology=None if rank == 2 else topo)
    except ValueError as e:
        assert "topology differs between ranks" in str(e), e
    else:
        raise AssertionError("no error")
    dist.barrier()


def topology_sources_agree(rank, world, backend):
    """The three ways to describe 2 nodes of 2 ranks build the same topology, and route alike:
    ranks_per_node, a 2-D DeviceMesh, torchrun's LOCAL_WORLD_SIZE (also the layer's "auto",
    one topology shared per group)."""
    import os

    from torch.distributed.device_mesh import init_device_mesh

    from mxfp8_a2a.moe import topology as tp

    explicit = mx.NodeTopology(None, 2)
    meshed = mx.NodeTopology(None, mesh=init_device_mesh("cpu", (2, 2)))
    assert mx.NodeTopology(None).spans_nodes is False  # no LOCAL_WORLD_SIZE: one node
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        auto = tp.shared_topology(None)
        layer = mx.ExpertParallelMoE(64, 32, 8, 2, seed=1)
        assert layer.topology is auto and tp.shared_topology(None) is auto
        assert mx.ExpertParallelMoE(64, 32, 8, 2, seed=1, capacity=8).topology is auto
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
        tp._shared.clear()
    x, ids, _, _ = node_inputs(rank, 5, 7, 3, 8)
    outs = []
    for topo in (explicit, meshed, auto):
        assert (topo.nodes, topo.ranks_per_node, topo.node, topo.local) == (2, 2, *divmod(rank, 2))
        ex, _, handle = mx.dispatch(x, ids, 8, topology=topo)
        outs.append((ex, mx.combine(ex, torch.ones(ids.shape), handle)))
    for ex, out in outs[1:]:
        assert torch.equal(ex, outs[0][0]) and torch.equal(out, outs[0][1])
    # a group whose ranks do not ascend (group rank 0 is global rank 2): its order kept
    from mxfp8_a2a.moe.topology import KEEPS_ORDER

    if not KEEPS_ORDER:  # (torch 2.11: NodeTopology refuses such a group, see topology.py)
        dist.barrier()
        return
    turned = dist.new_group([2, 3, 0, 1], sort_ranks=False)
    topo = mx.NodeTopology(turned, 2)
    me = dist.get_rank(turned)
    assert (topo.node, topo.local) == divmod(me, 2)
    x, ids, _, _ = node_inputs(me, 6, 5, 3, 8)
    flat, _, _ = mx.dispatch(x, ids, 8, turned)
    ex, _, handle = mx.dispatch(x, ids, 8, turned, topology=topo)
    assert handle.nodes is not None and torch.equal(ex, flat)
    dist.barrier()


def weights_grad_on_some_ranks(rank, world, backend):
    """Weights that require grad on some ranks only: combine's backward runs the same
    collectives everywhere (no hang) and x's gradient is the one of weights with grad."""
    topo = mx.NodeTopology(None, 2)
    x, ids, w, grad = node_inputs(rank, 11, 6, 3, 8)
    grads = []
    for with_grad in (True, rank != 0):
        xi = x.clone().requires_grad_(True)
        ex, _, handle = mx.dispatch(xi, ids, 8, topology=topo)
        out = mx.combine(ex * FACTOR, w.clone().requires_grad_(with_grad), handle)
        (out.float() * grad.float()).sum().backward()
        grads.append(xi.grad)
    assert torch.equal(*grads)
    dist.barrier()


def _by_token(rows: torch.Tensor) -> torch.Tensor:
    """Rows sorted by their (source rank + 1, token) columns (node_inputs' encoding)."""
    key = rows[:, 0].float() * 4096 + rows[:, 1].float()
    return rows[key.argsort(stable=True)]


def static_route_matches(rank, world, backend, seed, tokens, top_k, per_rank, g, exchanges):
    for i, exchange in enumerate(exchanges):  # (compiled: the first exchange only)
        _static_route_matches(rank, seed, tokens, top_k, per_rank, world, g, exchange, i == 0)
    dist.barrier()


def _static_route_matches(rank, seed, tokens, top_k, per_rank, world, g, exchange, compiled):
    """dispatch_static with a topology, dropless: each expert's rows the host-synced node
    route's (in another order), combine and every gradient bit for bit the same; eager and
    compiled (fullgraph); with a small capacity, rows dropped and counted."""
    experts = per_rank * world
    topo = mx.NodeTopology(None, g)
    x, ids, w, grad = node_inputs(rank, seed, tokens[rank], top_k, experts)
    cap = max(tokens) * top_k

    def run(fn, capacity=cap):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        if fn is not None:
            ex, offs, handle = fn(xi, ids, experts, capacity, exchange=exchange, topology=topo)
            combine = mx.combine_static
        else:
            ex, counts, handle = mx.dispatch(xi, ids, experts, exchange=exchange, topology=topo)
            offs, combine = torch.tensor(counts).cumsum(0), mx.combine
        out = combine(ex * FACTOR, wi, handle)
        (out.float() * grad.float()).sum().backward()
        return ex.detach(), offs, out.detach(), xi.grad, wi.grad, handle

    want = run(None)
    want_starts = [0, *want[1].tolist()[:-1]]
    fns = [mx.dispatch_static] + [torch.compile(mx.dispatch_static, fullgraph=True)] * compiled
    for fn in fns:
        got = run(fn)
        assert got[5].nodes is not None and got[5].stats[0].item() == 0
        starts = [0, *got[1].tolist()[:-1]]
        for lid in range(per_rank):
            n = int(want[1][lid]) - want_starts[lid]
            mine, theirs = got[0][starts[lid] :][:n], want[0][want_starts[lid] :][:n]
            assert torch.equal(_by_token(mine), _by_token(theirs)), (exchange, rank, lid)
        for a, b in zip(got[2:5], want[2:5], strict=True):
            assert torch.equal(a, b), (exchange, rank)
    small = run(mx.dispatch_static, capacity=1)  # drops: counted, the rest still sums
    dropped = small[5].stats[0].clone()
    dist.all_reduce(dropped)
    assert dropped.item() > 0 and torch.isfinite(small[2]).all()
