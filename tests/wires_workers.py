"""Workers of test_wires.py: each leg of dispatch/combine on its own wire, against a plain-torch
model of the legs. Experts that scale each row by 1.3 (in the rows' dtype) keep the legs apart:
a row quantized on a leg where the model does not quantize it (or the reverse) changes bits."""

from __future__ import annotations

import torch
import torch.distributed as dist
from a2a_workers import device_for
from robustness_workers import Renamed
from static_workers import HIDDEN, inputs

import mxfp8_a2a as mx
from mxfp8_a2a.moe.rows import decode, encode

FACTOR = 1.3  # the experts: y = x * FACTOR in x's dtype


def leg(v: torch.Tensor, wire: str) -> torch.Tensor:
    """A row through one leg: MXFP8's round trip, or the row itself."""
    return decode(encode(v, wire), v.shape[1], v.dtype, wire) if wire == "mxfp8" else v


def model(rank, world, seed, tokens_by_rank, top_k, per_rank, wires: mx.Wires, hidden=HIDDEN):
    """Rank ``rank``'s expected results, dropless: (dispatch's rows by local expert, each as
    [rows, H]; the expert outputs' gradients in the same order; combine's output [T, H]; x's
    gradient [T, H]; the weights' gradient fp32 [T, k]; the sums of its terms' magnitudes fp32
    [T, k], which bound its rounding) for the loss sum(out * grad)."""
    experts = per_rank * world
    rows = [[] for _ in range(per_rank)]
    grads = [[] for _ in range(per_rank)]
    for s in range(world):  # what rank ``rank``'s experts receive, by source rank
        x, ids, w, g = inputs(s, seed, tokens_by_rank[s], top_k, experts, "normal", "cpu", hidden)
        for lid in range(per_rank):
            t_idx, j_idx = torch.nonzero(ids == rank * per_rank + lid, as_tuple=True)
            rows[lid].append(leg(x[t_idx], wires.dispatch_fwd))
            gz = (w.bfloat16().float()[t_idx, j_idx, None] * g[t_idx].float()).bfloat16()
            grads[lid].append(leg(gz, wires.combine_bwd))
    x, ids, w, g = inputs(rank, seed, tokens_by_rank[rank], top_k, experts, "normal", "cpu", hidden)
    out, gx = torch.zeros(x.shape), torch.zeros(x.shape)
    gw, gw_abs = torch.zeros(w.shape), torch.zeros(w.shape)
    wb = w.bfloat16().float()
    for j in range(top_k):
        z = leg(leg(x, wires.dispatch_fwd) * FACTOR, wires.combine_fwd).float()
        out = out + wb[:, j : j + 1] * z
        gw[:, j] = (g.float() * z).sum(1)
        gw_abs[:, j] = (g.float() * z).abs().sum(1)
        gy = leg((wb[:, j : j + 1] * g.float()).bfloat16(), wires.combine_bwd) * FACTOR
        gx = gx + leg(gy, wires.dispatch_bwd).float()
    rows, grads = [torch.cat(r) for r in rows], [torch.cat(r) for r in grads]
    return rows, grads, out.bfloat16(), gx.bfloat16(), gw, gw_abs


def legs_match_model(
    rank, world, backend, seed, tokens_by_rank, top_k, per_rank, exchange, hidden=HIDDEN
):
    """Synced and static dispatch/combine with ``exchange`` (a preset or Wires) against
    :func:`model`, bit for bit (the weights' gradient within fp32 summation order); the
    synced one also with a Transport object (the engine then hands it unquantized rows)."""
    dev = device_for(backend)
    wires = mx.Wires(*exchange) if isinstance(exchange, tuple) else mx.WIRE_PRESETS[exchange]
    experts = per_rank * world
    want_rows, want_grads, want_out, want_gx, want_gw, gw_abs = model(
        rank, world, seed, tokens_by_rank, top_k, per_rank, wires, hidden
    )
    x, ids, w, grad = inputs(
        rank, seed, tokens_by_rank[rank], top_k, experts, "normal", dev, hidden
    )
    for path in ("synced", "synced-transport", "static"):
        static = path == "static"
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        if static:
            cap = max(tokens_by_rank) * min(top_k, per_rank)
            ex, offs, handle = mx.dispatch_static(xi, ids, experts, cap, exchange=exchange)
            starts = [0, *offs.tolist()[:-1]]
        else:
            transport = Renamed() if path == "synced-transport" else "nccl"
            ex, counts, handle = mx.dispatch(
                xi, ids, experts, exchange=exchange, transport=transport
            )
            starts = [0, *torch.tensor(counts).cumsum(0).tolist()[:-1]]
        y = ex * FACTOR
        y.retain_grad()
        out = (mx.combine_static if static else mx.combine)(y, wi, handle)
        (out.float() * grad.float()).sum().backward()
        what = f"{path} {exchange} rank {rank}"
        for lid, a in enumerate(starts):
            n = want_rows[lid].shape[0]
            assert torch.equal(ex[a : a + n].detach().cpu(), want_rows[lid]), (what, lid)
            assert torch.equal(y.grad[a : a + n].cpu(), want_grads[lid]), (what, lid)
        assert torch.equal(out.detach().cpu(), want_out), what
        assert torch.equal(xi.grad.cpu(), want_gx), what
        # fp32 sums of H terms in another order: each within H * 2^-24 * sum|terms| of exact
        bound = 2 * hidden * 2.0**-24 * gw_abs + 1e-6
        assert ((wi.grad.cpu() - want_gw).abs() <= bound).all(), what
    dist.barrier()
