"""Worker bodies for the static dispatch/combine tests: every rank rebuilds every rank's
tokens, ids and weights from the seed, so each can check its own rows against a
plain-torch model of the drop rule."""

from __future__ import annotations

import torch
import torch.distributed as dist
from a2a_workers import device_for
from helpers import sqnr_db

import mxfp8_a2a as mx
from mxfp8_a2a.moe.dispatch_static import static_rows
from mxfp8_a2a.moe.rows import decode, encode

HIDDEN = 64


def inputs(src, seed, tokens, top_k, experts, routing, dev, hidden=HIDDEN):
    """x bf16 [T, H] (rank-encoded: row t of rank s has s + 1 in column 0 and t in column 1,
    random magnitudes elsewhere), ids [T, k], weights fp32 [T, k], grad [T, H] of rank src;
    H = ``hidden``."""
    g = torch.Generator().manual_seed(seed * 100 + src)
    scale = torch.exp2(torch.randint(-8, 9, (tokens, 1), generator=g).float())
    x = torch.randn(tokens, hidden, generator=g) * scale
    x[:, 0], x[:, 1] = src + 1, torch.arange(tokens).float()
    if routing == "one_expert":
        ids = (torch.arange(top_k)[None, :] + torch.zeros(tokens, 1, dtype=torch.long)) % experts
    elif routing == "one_rank":  # every token's experts on rank 0 as far as there are enough
        ids = torch.arange(top_k).expand(tokens, top_k).clone()
    else:
        ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices
    w = torch.rand(tokens, top_k, generator=g) + 0.1
    grad = torch.randn(tokens, hidden, generator=g)
    return x.bfloat16().to(dev), ids.to(dev), w.to(dev), grad.bfloat16().to(dev)


def kept_model(ids: torch.Tensor, experts: int, world: int, capacity: int) -> torch.Tensor:
    """The drop rule, as a loop: bool [T, k], True where (t, j) is sent."""
    local = experts // world
    taken = [0] * world
    kept = torch.zeros(ids.shape, dtype=torch.bool)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if 0 <= e < experts and taken[e // local] < capacity:
                taken[e // local] += 1
                kept[t, j] = True
    return kept


def expected_blocks(rank, world, seed, tokens_by_rank, top_k, experts, routing, capacity, ex):
    """For each local expert of ``rank``: its rows (decode(encode(x)) of every kept row, by
    source rank, token-major), and each source's kept mask."""
    local = experts // world
    blocks: list[list[torch.Tensor]] = [[] for _ in range(local)]
    for s in range(world):
        x, ids, _, _ = inputs(s, seed, tokens_by_rank[s], top_k, experts, routing, "cpu")
        kept = kept_model(ids, experts, world, capacity)
        rt = decode(encode(x, ex), HIDDEN, x.dtype, ex)
        for lid in range(local):
            e = rank * local + lid
            t_idx, _ = torch.nonzero(kept & (ids == e), as_tuple=True)
            blocks[lid].append(rt[t_idx])
    return [torch.cat(b) for b in blocks]


def static_matches_model(rank, world, backend, seed, tokens_by_rank, top_k, per_rank, routing,
                         capacity, exchange, align):  # fmt: skip
    """dispatch_static/combine_static against the model of the drop rule: every output row,
    padding zero, offsets, stats, combine's output, and the gradients of x, the weights and
    the expert outputs (identity experts times a per-row factor)."""
    dev = device_for(backend)
    experts = per_rank * world
    x, ids, w, grad = inputs(rank, seed, tokens_by_rank[rank], top_k, experts, routing, dev)
    x.requires_grad_(True)
    w.requires_grad_(True)
    out, offs, handle = mx.dispatch_static(x, ids, experts, capacity, exchange=exchange,
                                           align=align)  # fmt: skip
    res = mx.combine_static(out, w, handle)
    (res.float() * grad.float()).sum().backward()
    want_stats = check_model(rank, world, seed, tokens_by_rank, top_k, per_rank, routing,
                             capacity, exchange, align,
                             (out, offs, handle.stats, res, x.grad, w.grad))  # fmt: skip
    dist.barrier()
    return want_stats


def check_model(rank, world, seed, tokens_by_rank, top_k, per_rank, routing, capacity,
                exchange, align, got):  # fmt: skip
    """Rank ``rank``'s results got = (dispatch's out, offs, stats, combine's out of identity
    experts, x.grad, w.grad for the loss sum(out * grad)) against the model; returns the
    stats it expects."""
    out, offs, stats, res, x_grad, w_grad = got
    experts = per_rank * world
    x, ids, w, grad = inputs(rank, seed, tokens_by_rank[rank], top_k, experts, routing, "cpu")
    assert out.shape == (static_rows(capacity, world, per_rank, align), HIDDEN)
    blocks = expected_blocks(rank, world, seed, tokens_by_rank, top_k, experts, routing,
                             capacity, exchange)  # fmt: skip
    ends = offs.tolist()
    start = 0
    for lid, want in enumerate(blocks):
        n = want.shape[0]
        assert ends[lid] - start == -(-n // align) * align, (lid, ends, n)
        assert torch.equal(out[start : start + n].detach().cpu(), want), lid
        assert not out[start + n : ends[lid]].any()
        start = ends[lid]
    assert not out[start:].any()
    kept = kept_model(ids.cpu(), experts, world, capacity)
    local_ids = ids.cpu()
    per_dest = [int(((local_ids // per_rank) == d).sum()) for d in range(world)]
    want_stats = [int((~kept).sum()), max(per_dest, default=0), 0, 0]
    assert stats.tolist() == want_stats, (stats.tolist(), want_stats)
    # identity experts: combine gives sum over kept j of bf16(w) * rt(x[t]), fp32 in order
    xc, wc, gc, kc = x, w, grad, kept
    rt = decode(encode(xc, exchange), HIDDEN, xc.dtype, exchange).float()
    wb = wc.bfloat16().float()
    want = torch.zeros(xc.shape)
    want_gx = torch.zeros(xc.shape)
    want_gw = torch.zeros(wc.shape)
    for j in range(top_k):
        m = kc[:, j : j + 1]
        want = torch.where(m, want + wb[:, j : j + 1] * rt, want)
        gj = (wb[:, j : j + 1] * gc.float()).bfloat16()
        gj = decode(encode(gj, exchange), HIDDEN, gj.dtype, exchange).float()
        want_gx = torch.where(m, want_gx + gj, want_gx)
        want_gw[:, j] = torch.where(m[:, 0], (gc.float() * rt).sum(1), 0.0)
    assert torch.equal(res.detach().cpu(), want.bfloat16())
    assert torch.equal(x_grad.cpu(), want_gx.bfloat16())
    # a dot of HIDDEN fp32 products, summed in another order on the GPU (3e-5 seen at ~1.3)
    torch.testing.assert_close(w_grad.cpu(), want_gw, rtol=1e-4, atol=1e-4)
    assert not w_grad.cpu()[~kc].any()
    return want_stats


def static_vs_dispatch(rank, world, backend, seed, tokens, top_k, per_rank, exchange):
    """With enough capacity: the static path's rows, combine output and gradients equal the
    host-synced dispatch/combine's bit for bit."""
    dev = device_for(backend)
    experts = per_rank * world
    x, ids, w, grad = inputs(rank, seed, tokens, top_k, experts, "normal", dev)
    results = []
    for static in (False, True):
        xi = x.clone().requires_grad_(True)
        wi = w.clone().requires_grad_(True)
        if static:
            cap = tokens * min(top_k, per_rank)
            ex, offs, handle = mx.dispatch_static(xi, ids, experts, cap, exchange=exchange)
            ends = offs.tolist()
            starts = [0, *ends[:-1]]
            # rank-encoded rows are never all zero: a block's rows are its non-zero ones
            nonzero = (ex.detach() != 0).any(1)
            counts = [int(nonzero[a:b].sum()) for a, b in zip(starts, ends, strict=True)]
        else:
            ex, counts, handle = mx.dispatch(xi, ids, experts, exchange=exchange)
            ends = torch.tensor(counts).cumsum(0).tolist()
            starts = [0, *ends[:-1]]
        y = ex * ex[:, :1]  # experts that act on each row alone, whatever its place
        y.retain_grad()
        out = (mx.combine_static if static else mx.combine)(y, wi, handle)
        (out.float() * grad.float()).sum().backward()
        rows = [ex[a : a + n].detach() for a, n in zip(starts, counts, strict=True)]
        grads = [y.grad[a : a + n] for a, n in zip(starts, counts, strict=True)]
        results.append((rows, out.detach(), xi.grad, wi.grad, grads, handle))
    (r0, o0, gx0, gw0, gy0, _), (r1, o1, gx1, gw1, gy1, h1) = results
    for a, b in zip(r0, r1, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(o0, o1), (o0 - o1).abs().max()
    assert torch.equal(gx0, gx1), (gx0 - gx1).abs().max()
    torch.testing.assert_close(gw0, gw1, rtol=1e-5, atol=1e-5)
    for a, b in zip(gy0, gy1, strict=True):
        assert torch.equal(a, b)
    assert h1.stats.tolist()[0] == 0
    dist.barrier()


def static_layer_matches_synced(rank, world, backend, seed, exchange, compiled):
    """ExpertParallelMoE with a dropless capacity (eager, or compiled with fullgraph=True)
    against the host-synced layer: output and every gradient; no drops counted."""
    from mxfp8_a2a.moe.layer import ExpertParallelMoE

    dev = device_for(backend)
    experts, top_k, tokens = 2 * world, 2, 10
    results = []
    for capacity in (None, tokens * top_k):
        layer = ExpertParallelMoE(HIDDEN, 32, experts, top_k, exchange=exchange, seed=seed,
                                  capacity=capacity).to(dev)  # fmt: skip
        x, _, _, grad = inputs(rank, seed, tokens, top_k, experts, "normal", dev)
        x = x.float().requires_grad_(True)
        run = torch.compile(layer, fullgraph=True) if compiled and capacity else layer
        out = run(x)
        (out * grad.float()).sum().backward()
        results.append((out.detach(), x.grad, layer.router.grad, layer.w1.grad, layer.w2.grad))
        if capacity:
            assert layer.dispatch_stats.tolist() == [0, layer.dispatch_stats[1].item(), 0, 0]
            mx.check_no_drops(layer.dispatch_stats)
    for a, b in zip(*results, strict=True):
        if compiled:  # the compiled router's last-bit differences can flip an MXFP8
            assert sqnr_db(a, b) > 40  # rounding, or meet a cancellation in a weight gradient
        else:
            # fp32 sums in another order (GEMM blocking, the weights' gradient's partial
            # dots): errors scale with the summands, so near-cancelled entries of a large
            # gradient need an absolute tolerance relative to its largest entry
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * max(1.0, b.abs().max().item()))


def static_layer_reports_drops(rank, world, backend):
    """A capacity too small for the routing: the stats count the drops on the device and
    check_no_drops raises the same error on every rank."""
    from mxfp8_a2a.moe.layer import ExpertParallelMoE

    dev = device_for(backend)
    layer = ExpertParallelMoE(HIDDEN, 32, 2 * world, 2, capacity=1, seed=0).to(dev)
    x, _, _, _ = inputs(rank, 0, 8, 2, 2 * world, "normal", dev)
    layer(x.float())
    dropped, needed, bad, _ = layer.dispatch_stats.tolist()
    assert 16 - world <= dropped < 16 and needed >= 2 and bad == 0, layer.dispatch_stats
    try:
        mx.check_no_drops(layer.dispatch_stats)
    except ValueError as e:
        assert "dropped rows" in str(e) and "capacity of" in str(e), e
        return str(e)
    raise AssertionError("check_no_drops did not raise")


def layer_arguments_and_shapes(rank, world):
    """The layer refuses a top_k above num_experts and an unknown exchange at construction,
    and takes [batch, seq, hidden] input (flattened into tokens), synced and static alike."""
    import pytest

    from mxfp8_a2a.moe.layer import ExpertParallelMoE

    with pytest.raises(ValueError, match="top_k must be an int in"):
        ExpertParallelMoE(HIDDEN, 32, 2 * world, 2 * world + 1)
    with pytest.raises(ValueError, match="exchange must be a preset"):
        ExpertParallelMoE(HIDDEN, 32, 2 * world, 2, exchange="mxfp9")
    x = torch.randn(2, 3, HIDDEN)
    for capacity in (None, 12):
        layer = ExpertParallelMoE(HIDDEN, 32, 2 * world, 2, capacity=capacity, seed=0)
        out = layer(x)
        assert out.shape == x.shape
        assert torch.equal(out, layer(x.reshape(6, HIDDEN)).view(x.shape))
