"""Worker bodies for the MoE robustness tests: ranks with no tokens, top_k = 0, bad
topk_ids or arguments on one rank, ranks that disagree, combine with the wrong rows."""

from __future__ import annotations

import re
import time

import torch
import torch.distributed as dist
from moe_reference import moe_reference
from moe_workers import FFN, HIDDEN, _inputs, _layer, assert_matches_reference
from robustness_workers import Renamed, WithSetting, same_error

import mxfp8_a2a as mx
from mxfp8_a2a.moe.layer import init_moe_weights


def _splits_agree(handle, world) -> None:
    """What dispatch derived: rank a sends to b as many rows as b expects from a."""
    every = [None] * world
    dist.all_gather_object(every, (handle.input_splits, handle.output_splits))
    for a in range(world):
        for b in range(world):
            assert every[a][0][b] == every[b][1][a], every


def uneven_tokens(rank, world, seed, cases):
    """Each case (tokens, top_k): tokens[r] tokens on rank r (some 0), top_k experts per
    token (maybe 0). The plain ("bf16") layer matches the single-process reference, forward
    and every gradient; the MXFP8 layer runs forward and backward (zeros for top_k = 0);
    the splits dispatch derives agree across ranks."""
    for tokens, top_k in cases:
        _uneven_tokens(rank, world, seed, tokens, top_k)


def _uneven_tokens(rank, world, seed, tokens, top_k):
    experts, dev = 2 * world, torch.device("cpu")
    layer = _layer(world, dev, seed, top_k, "bf16", "normal", experts)
    x, g = _inputs(rank, seed, dev, "normal", tokens[rank])
    x.requires_grad_(True)
    out = layer(x)
    (out * g).sum().backward()
    router_grad = layer.router.grad.clone()
    dist.all_reduce(router_grad)

    ref_w = {
        k: v.requires_grad_(True) for k, v in init_moe_weights(HIDDEN, FFN, experts, seed).items()
    }
    xs, gs = zip(*(_inputs(r, seed, dev, "normal", tokens[r]) for r in range(world)), strict=True)
    x_all = torch.cat(xs).requires_grad_(True)
    ref = moe_reference(x_all, ref_w, top_k)
    if ref.requires_grad:
        (ref * torch.cat(gs)).sum().backward()
    else:  # top_k = 0 or no tokens anywhere: the reference's output is a constant
        x_all.grad = torch.zeros_like(x_all)
        for v in ref_w.values():
            v.grad = torch.zeros_like(v)
    rows = slice(sum(tokens[:rank]), sum(tokens[: rank + 1]))
    assert_matches_reference(out, x, router_grad, layer, ref, x_all, ref_w, rows, rank, world)

    layer = _layer(world, dev, seed, top_k, "mxfp8", "normal", experts)
    x.grad = None
    out = layer(x)
    (out * g).sum().backward()
    assert out.shape == x.shape and x.grad.shape == x.shape and out.isfinite().all()
    if top_k == 0:
        assert not out.any() and not x.grad.any()
    ids = torch.randint(0, experts, (tokens[rank], top_k))
    _, _, handle = mx.dispatch(x.detach(), ids, experts)
    _splits_agree(handle, world)


def moe_errors(rank, world):
    """Bad arguments on one rank, or ranks that disagree: dispatch raises the same error on
    every rank (naming the rank and the argument); combine with bad arguments on every rank
    raises on each before any collective; then the group still works."""
    experts, t = 2 * world, 6
    x = torch.randn(t, 64)
    ids = torch.randint(0, experts, (t, 2))
    ids[:world, 0] = torch.arange(world) * (experts // world)  # every rank receives rows

    def on(r, bad, good):
        return bad if rank == r else good

    neg, past = ids.clone(), ids.clone()
    neg[3, 1], past[0, 0] = -1, experts
    same_error(
        lambda: mx.dispatch(x, on(1, neg, ids), experts),
        rf"dispatch: bad arguments on rank\(s\) \[1\] of the group: rank 1: topk_ids holds 1 "
        rf"ids outside \[0, num_experts={experts}\) \(from -1 to -1\); route to existing",
    )
    same_error(lambda: mx.dispatch(x, past, experts), rf"rank {world - 1}: topk_ids holds 1")
    cases = [
        (dict(topk_ids=on(2, ids.float(), ids)), "rank 2: topk_ids must be an integer tensor"),
        (dict(topk_ids=on(0, ids[:, :1].T, ids)), r"rank 0: topk_ids must be \[tokens, k\]"),
        (dict(x=on(1, x.half(), x)), "rank 1: x must be bfloat16 or float32 for an MXFP8 wire"),
        (dict(x=on(0, x[:, :48], x)), r"rank 0: x.shape\[1\] \(hidden=48\) must be a multiple"),
        (dict(exchange=on(2, "fp4", "mxfp8")), "rank 2: exchange must be a preset"),
        (dict(transport=on(1, "ib", "nccl")), "rank 1: transport must be 'nccl'"),
        (dict(num_experts=experts + 1), r"num_experts \(\d+\) must be a positive multiple"),
        # ranks that disagree on what the exchanges depend on
        (dict(x=on(0, torch.randn(t, 96), x)), r"x.shape\[1\] differs .*\(\[96, 64, 64\] by"),
        (dict(x=on(1, x.bfloat16(), x)), r"x.dtype differs between ranks \(\[torch.float32, "),
        (dict(exchange=on(0, "bf16", "mxfp8")), r"exchange differs .*\(\[bf16/bf16/bf16/bf16, mx"),
        (
            dict(x=on(2, x.clone().requires_grad_(), x)),
            r"x.requires_grad differs between ranks \(\[False, False, True",
        ),
        (dict(transport=on(0, Renamed(), "nccl")), r"transport differs .*\[robustness_workers.Ren"),
        (dict(transport=WithSetting(on(1, 3, 2))), r"transport setting differs .*\[2, 3, 2\]"),
    ]
    for bad, match in cases:
        args = dict(x=x, topk_ids=ids, num_experts=experts) | bad
        same_error(lambda args=args: mx.dispatch(**args), match)
    # combine with bad arguments (on every rank, so that none is left waiting)
    ex, _, handle = mx.dispatch(x, ids, experts)
    n, w = ex.shape[0], torch.rand(t, 2)
    for y, weights, match in [
        (torch.cat([ex, ex[:1]]), w, rf"expert_y must be \[{n}, 64\] \(one row per row"),
        (ex[1:], w, rf"expert_y must be \[{n}, 64\]"),
        (torch.randn(n, 96), w, rf"got \({n}, 96\)"),
        (ex, w[:, :1], rf"topk_weights must be a \[{t}, 2\] tensor"),
        (ex, torch.ones(t, 2, dtype=torch.long), "topk_weights must be a floating tensor"),
    ]:
        try:
            mx.combine(y, weights, handle)
        except ValueError as e:
            assert re.search(match, str(e)), (match, str(e))
        else:
            raise AssertionError(f"no ValueError for {match}")
    # the group still works
    assert mx.combine(ex, w, handle).shape == (t, 64)
    # the layer: a bad x on one rank raises on every rank (before its router), then it works
    layer = mx.ExpertParallelMoE(64, 32, experts, 2, seed=0)
    for bad, match in [
        (
            torch.randn(t, 96),
            r"rank 1: x must be a \[\.\.\., 64\] tensor \(hidden size last\), "
            r"got torch.Size\(\[6, 96",
        ),
        (
            torch.ones(t, 64, dtype=torch.long),
            "rank 1: x must be a floating tensor, got torch.int64",
        ),
        (torch.randn(64), r"rank 1: x must be a \[\.\.\., 64\] tensor"),
    ]:
        same_error(
            lambda bad=bad: layer(on(1, bad, x)),
            r"(dispatch|ExpertParallelMoE): bad arguments on rank\(s\) \[1\] .*" + match,
        )
    assert layer(x).shape == (t, 64)


def combine_bad_rows_on_one_rank(rank, world):
    """combine with one more row than dispatch produced on rank 0 only: a ValueError naming
    expert_y there before any collective; the other ranks fail (gloo: connection closed)
    once rank 0's process ends, instead of waiting for it."""
    ids = torch.randint(0, 2 * world, (6, 2))
    ex, _, handle = mx.dispatch(torch.randn(6, 64), ids, 2 * world)
    if rank == 0:
        ex = torch.cat([ex, ex[:1]])
    start = time.monotonic()
    try:
        mx.combine(ex, torch.ones(6, 2), handle)
        return "ok", "", time.monotonic() - start
    except Exception as e:
        return type(e).__name__, str(e)[:200], time.monotonic() - start
