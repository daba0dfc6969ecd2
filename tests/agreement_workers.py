"""Worker bodies for the tests of ranks that differ in how they run: compiled and eager ranks
with validation on, num_experts that differs, a handle from another dispatch, a weight
changed in place on one rank. Each ends in the same error on every rank, or works."""

from __future__ import annotations

import torch
import torch.distributed as dist
from a2a_workers import split_matrix
from robustness_workers import same_error

import mxfp8_a2a as mx
from mxfp8_a2a import _config
from mxfp8_a2a.exchange import checks


def _compiled_on_rank0(fn, rank):
    return torch.compile(fn, fullgraph=True, backend="aot_eager") if rank == 0 else fn


def _exchange(x, out_splits, in_splits, validate):
    return mx.to_mxfp8_a2a_dequant(x, out_splits, in_splits, validate=validate)


def compiled_and_eager_validate(rank, world, from_env):
    """Validation on every rank (MXFP8_A2A_VALIDATE=1 at start if ``from_env``, else
    validate=True), rank 0 compiled with fullgraph=True, the others eager: the compiled rank
    joins the same all_gather, so good calls exchange exact rows (forward and backward), and
    splits that disagree or a bad argument on the compiled rank raise the same error on
    every rank."""
    assert checks.VALIDATE_FROM_ENV is from_env
    validate = not from_env
    s = split_matrix(world, 5, max_rows=4, zeros=False)
    out_splits = [s[src][rank] for src in range(world)]
    x = torch.randn(sum(s[rank]), 64).requires_grad_()
    run = _compiled_on_rank0(_exchange, rank)
    out = run(x, out_splits, s[rank], validate)
    out.sum().backward()
    back = mx.to_mxfp8_a2a_dequant(out.detach(), s[rank], out_splits)  # eager everywhere
    assert torch.equal(back, mx.quantize_dequantize_reference(x.detach()))
    assert torch.equal(x.grad, torch.ones_like(x))
    bad = [out_splits[0] + (rank == 1), *out_splits[1:]]  # rank 1: one row too many
    same_error(
        lambda: run(x.detach(), bad, s[rank], validate),
        r"to_mxfp8_a2a_dequant: splits disagree: rank 0 sends \d+ rows to rank 1",
    )
    # a local error on the compiled rank (splits as a tensor, refused under compile)
    ins = torch.tensor(s[rank]) if rank == 0 else s[rank]
    same_error(
        lambda: run(x.detach(), out_splits, ins, validate),
        r"bad arguments on rank\(s\) \[0\] .*rank 0: under torch.compile pass the splits",
    )
    assert run(x.detach(), out_splits, s[rank], validate).shape == (sum(out_splits), 64)


def _static_step(x, ids, w, experts, cap):
    out, _, handle = mx.dispatch_static(x, ids, experts, cap)
    return mx.combine_static(out * 2, w, handle)


def static_compiled_and_eager(rank, world, seed):
    """The static dispatch never validates (it has no host sync): with
    MXFP8_A2A_VALIDATE=1 a compiled rank and an eager one run the same collectives, and
    rank 0's compiled step gives what its eager step gives."""
    assert checks.VALIDATE_FROM_ENV
    g = torch.Generator().manual_seed(seed + rank)
    experts, t = 2 * world, 6
    x = torch.randn(t, 64, generator=g)
    ids = torch.rand(t, experts, generator=g).topk(2, dim=1).indices
    w = torch.rand(t, 2, generator=g)
    eager = _static_step(x, ids, w, experts, 2 * t)
    mixed = _compiled_on_rank0(_static_step, rank)(x, ids, w, experts, 2 * t)
    assert torch.equal(eager, mixed)


def num_experts_differ(rank, world):
    """num_experts that differs between ranks (also on either side of the counts message's
    inline width, or a float on one rank) raises the same error on every rank, from a
    message of a fixed size; more local experts than fit inline take a second counts
    all-to-all and match the reference; then the group still works."""
    t = 5
    x = torch.randn(t, 64)
    inline = _config.DISPATCH_INLINE_COUNTS
    many = world * (inline + 3)  # counts past the inline width
    for mine, match in [
        (world * (1 + rank), rf"dispatch: num_experts differs between ranks \(\[{world}, "),
        (world * 2 if rank else many, rf"num_experts differs between ranks \(\[{many}, "),
        (many + world * rank, rf"num_experts differs between ranks \(\[{many}, {many + world}"),
        (4.0 if rank == 1 else 4, r"bad arguments on rank\(s\) \[1\] .*num_experts \(4.0\)"),
    ]:
        ids = torch.randint(0, int(mine), (t, 2))
        same_error(lambda mine=mine, ids=ids: mx.dispatch(x, ids, mine), match)
    ids = torch.randint(0, many, (t, 3))
    for exchange in ("bf16", "mxfp8"):
        ex, counts, handle = mx.dispatch(x, ids, many, exchange=exchange)
        every = [None] * world
        dist.all_gather_object(every, ids)
        local = many // world
        want = [sum(int((i == rank * local + e).sum()) for i in every) for e in range(local)]
        assert counts == want and ex.shape[0] == sum(want)
        assert handle.expert_offsets.tolist() == torch.tensor(want).cumsum(0).tolist()
        out = mx.combine(ex, torch.ones(t, 3), handle)
        rt = x if exchange == "bf16" else mx.quantize_dequantize_reference(x)
        torch.testing.assert_close(out, 3 * rt)


def handle_of_another_dispatch(rank, world, static):
    """combine given the rows of one dispatch and the handle of another of the same shape
    (the same experts, other tokens) raises the same ValueError on every rank, before any
    collective; the right pairs combine as usual."""
    experts, t = 2 * world, 6
    x = torch.randn(t, 64)
    ids = torch.randint(0, experts, (t, 2))
    w = torch.rand(t, 2)
    if static:
        dispatch, combine, what = mx.dispatch_static, mx.combine_static, "dispatch_static"
        args = (experts, 2 * t)
    else:
        dispatch, combine, what = mx.dispatch, mx.combine, "dispatch"
        args = (experts,)
    ex1, _, h1 = dispatch(x, ids, *args)
    ex2, _, h2 = dispatch(x, ids.roll(1, 0), *args)
    assert ex1.shape == ex2.shape
    for y, h in ((ex1, h2), (ex2, h1)):
        same_error(lambda y=y, h=h: combine(y, w, h), rf"expert_y is the output of another {what} ")
    for y, h in ((ex1, h1), (ex2, h2), (ex2 * 1, h2)):  # rows computed from it: no mark
        assert combine(y, w, h).shape == (t, 64)


def static_num_experts_differ(rank, world):
    """The static dispatch with num_experts that differs between ranks: the counts message
    has one size, the rows between ranks that differ are dropped both ways (each rank keeps
    its rows to itself, exact), and check_no_drops raises the same error on every rank."""
    t, k = 6, 2
    experts = world if rank == 0 else 2 * world  # rank 0 differs from every other rank
    x = torch.randn(t, 64)
    ids = torch.randint(0, experts, (t, k))
    w = torch.rand(t, k)
    ex, _, handle = mx.dispatch_static(x, ids, experts, t * k, exchange="bf16")
    out = mx.combine_static(ex, w, handle)
    mine = (ids // (experts // world) == 0) == (rank == 0)  # kept: rows to agreeing ranks
    want = (w * mine).sum(1, keepdim=True) * x
    torch.testing.assert_close(out, want)
    assert handle.stats[0] == (~mine).sum() and handle.stats[3] == experts
    same_error(
        lambda: mx.check_no_drops(handle.stats),
        rf"static dispatch: num_experts differs between ranks \(\[{world}, {2 * world}, ",
    )
    ex, _, handle = mx.dispatch_static(x, ids % world, world, t * k)
    mx.check_no_drops(handle.stats)


def weight_changed_on_one_rank(rank, world, static):
    """fp8_weight_reuse with a weight changed in place on rank 1 only (the CUDA FP8 path,
    its GEMM emulated): the next call raises before its dispatch, on every rank for the
    synced dispatch; for the static one on rank 1, whose peers then fail as its process
    ends (returned: the outcome and its seconds)."""
    import time

    from emulated_gemm import _emulated_op
    from grouped_mm_data import fr, gm

    fr._scaled_gmm = _emulated_op  # (this process only)
    gm.gemm_path = lambda x, precision: "scaled" if precision == "fp8_rowwise" else "loop"
    kw = {"capacity": 48} if static else {}
    layer = mx.ExpertParallelMoE(64, 32, 2 * world, 2, precision="fp8_rowwise", seed=0, **kw)
    x = torch.randn(24, 64)
    with layer.fp8_weight_reuse():
        layer(x).sum().backward()
        if rank == 1:
            with torch.no_grad():
                layer.w1.mul_(0.5)  # an optimizer step inside the block, on one rank
        match = r"w1 changed \(in place, or its storage\) inside fp8_weight_reuse\(\)"
        if not static:
            same_error(lambda: layer(x), r"dispatch: bad arguments on rank\(s\) \[1\] .*" + match)
            return None
        start = time.monotonic()
        try:
            layer(x).sum().backward()
            return "ok", "", time.monotonic() - start
        except Exception as e:
            return type(e).__name__, str(e)[:300], time.monotonic() - start
