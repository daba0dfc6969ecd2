"""The static dispatch's push transport (exchange/push.py, moe/push.py).

On a GPU, W ranks are emulated in one process: W buffers, each rank's calls on a stream of
its own, all queued before anything is read on the host (a rank's barrier spins until the
others' kernels run beside it). Results are checked bit for bit against the model of the
drop rule that the NCCL path is checked against (static_workers.check_model), and, at one
rank through real symmetric memory, against the NCCL path itself. On the CPU (Triton's
interpreter): the encoders' stores through the address tables land where
all_to_all_single would put the NCCL path's rows, and one rank runs the whole path.
"""

from __future__ import annotations

import random

import pytest
import torch
from dist_utils import run_distributed
from helpers import KERNEL_DEVICES, fresh_generator, random_blocks
from push_workers import ipc_rank, push_bad_argument, push_equals_nccl, push_rule
from static_workers import HIDDEN, check_model, inputs

import mxfp8_a2a as mx
from mxfp8_a2a.exchange.push import PushBuffer
from mxfp8_a2a.moe import row_kernels as sk
from mxfp8_a2a.moe.plan import send_plan

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SPINS = 5_000_000  # a barrier's bound in these tests (iterations: seconds), so nothing hangs


def _seed() -> int:
    return random.SystemRandom().randrange(2**20)


def run_ranks(bufs, fn, rounds=None):
    """[fn(rank, buf) for each emulated rank], all at once: one stream per rank, nothing read
    on the host until every rank is queued. With ``rounds`` (functions like fn), each rank's
    list of their results, issued round by round across the ranks (a stream whose rank waits
    in a barrier drains nothing, and the host blocks once about a thousand launches wait on
    one stream). First a round whose barriers do not wait (so that every kernel is loaded
    before any rank spins: loading a kernel may wait for the device, and a spinning rank
    never lets it go), then the one whose results count."""
    for warm in (True, False):
        for b in bufs:
            b.spin_limit = 0 if warm else SPINS
        outs = _issue(bufs, rounds or [fn])
        if warm:
            for b in bufs:
                b.reset()
    for b in bufs:
        b.check()
    return outs if rounds else [o[0] for o in outs]


def _issue(bufs, rounds):
    """Each rank's results of ``rounds``, issued round by round, each rank on a stream of its
    own; joined and waited for."""
    cur = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in bufs]
    for s in streams:
        s.wait_stream(cur)
    outs = [[] for _ in bufs]
    for f in rounds:
        for r, (b, s) in enumerate(zip(bufs, streams, strict=True)):
            with torch.cuda.stream(s):
                outs[r].append(f(r, b))
    for s in streams:
        cur.wait_stream(s)
    torch.cuda.synchronize()
    return outs


def model_step(data, exchange, align, capacity, experts):
    """fn for run_ranks: dispatch, identity experts, combine, backward of sum(out * grad)."""

    def fn(r, buf):
        x, ids, w, grad = (t.clone() for t in data[r])
        x.requires_grad_(True)
        w.requires_grad_(True)
        out, offs, h = mx.dispatch_static(x, ids, experts, capacity, exchange=exchange,
                                          align=align, transport=buf)  # fmt: skip
        res = mx.combine_static(out, w, h)
        (res.float() * grad.float()).sum().backward()
        return out.detach(), offs, h.stats, res.detach(), x.grad, w.grad

    return fn


# (W, tokens by rank, top_k, experts per rank, routing, capacity, align)
CASES = [
    (2, [7, 7], 2, 2, "normal", 3, 4),  # drops under random routing
    (4, [6, 6, 6, 6], 1, 1, "one_expert", 2, 16),  # everything to one expert: overflow
    (4, [8, 0, 5, 3], 2, 2, "one_rank", 5, 1),  # a rank without tokens; every row to rank 0
    (8, [5] * 8, 4, 1, "normal", 40, 8),  # 8 ranks, dropless
    (2, [5, 5], 1, 2, "normal", 0, 16),  # capacity 0: everything dropped
]


@GPU
@pytest.mark.parametrize("exchange", ["mxfp8", "bf16"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_emulated_ranks_match_model(case, exchange):
    world, tokens, top_k, per_rank, routing, cap, align = CASES[case]
    seed, experts = _seed(), per_rank * world
    data = [inputs(r, seed, tokens[r], top_k, experts, routing, "cuda") for r in range(world)]
    bufs = PushBuffer.emulated(world, HIDDEN, experts, capacity=cap, exchange=exchange)
    outs = run_ranks(bufs, model_step(data, exchange, align, cap, experts))
    for r in range(world):
        check_model(r, world, seed, tokens, top_k, per_rank, routing, cap, exchange, align,
                    outs[r])  # fmt: skip


@GPU
def test_fifty_calls_back_to_back():
    """50 dispatch/combine/backward rounds with new routing each, queued with no host sync
    in between (the first barrier keeps a buffer from being overwritten before it is read)."""
    world, tokens, top_k, per_rank, cap, align = 4, [9, 6, 9, 3], 2, 2, 6, 4
    seeds, experts = [_seed() + i for i in range(50)], per_rank * world
    data = [[inputs(r, s, tokens[r], top_k, experts, "normal", "cuda") for r in range(world)]
            for s in seeds]  # fmt: skip
    bufs = PushBuffer.emulated(world, HIDDEN, experts, capacity=cap)
    steps = [model_step(d, "mxfp8", align, cap, experts) for d in data]
    outs = run_ranks(bufs, None, rounds=steps)
    for i, s in enumerate(seeds):
        for r in range(world):
            check_model(r, world, s, tokens, top_k, per_rank, "normal", cap, "mxfp8", align,
                        outs[r][i])  # fmt: skip


@GPU
def test_graph_replay():
    """Each rank's dispatch, combine and backward captured in a CUDA graph, replayed by all
    ranks at once on new routing: the model's results."""
    world, tokens, top_k, per_rank, cap, align = 4, [8] * 4, 2, 2, 8, 4
    experts = per_rank * world
    seed = _seed()
    data = [inputs(r, seed, tokens[r], top_k, experts, "normal", "cuda") for r in range(world)]
    bufs = PushBuffer.emulated(world, HIDDEN, experts, capacity=cap)
    static = [[t.clone() for t in d] for d in data]
    run_ranks(bufs, model_step(static, "mxfp8", align, cap, experts))  # (warm-up)
    graphs, outs = [], []
    for r, b in enumerate(bufs):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs.append(model_step(static, "mxfp8", align, cap, experts)(r, b))
        graphs.append(g)
    seed = _seed()
    for r in range(world):  # new inputs, in place
        for t, new in zip(
            static[r], inputs(r, seed, tokens[r], top_k, experts, "normal", "cuda"), strict=True
        ):
            t.copy_(new)
    torch.cuda.synchronize()
    run_ranks_replay(bufs, graphs)
    for r in range(world):
        check_model(r, world, seed, tokens, top_k, per_rank, "normal", cap, "mxfp8", align,
                    outs[r])  # fmt: skip


def run_ranks_replay(bufs, graphs):
    _issue(bufs, [lambda r, b: graphs[r].replay()])
    for b in bufs:
        b.check()


@GPU
def test_compiled_fullgraph():
    world, tokens, top_k, per_rank, cap, align = 2, [7, 5], 2, 2, 6, 4
    experts, seed = per_rank * world, _seed()
    data = [inputs(r, seed, tokens[r], top_k, experts, "normal", "cuda") for r in range(world)]
    bufs = PushBuffer.emulated(world, HIDDEN, experts, capacity=cap)

    @torch.compile(fullgraph=True)
    def forward(x, ids, w, buf):
        out, offs, h = mx.dispatch_static(x, ids, experts, cap, align=align, transport=buf)
        return out, offs, h.stats, mx.combine_static(out, w, h)

    def step(r, buf):  # (the backward outside: .backward() ends a graph)
        x, ids, w, grad = (t.clone() for t in data[r])
        x.requires_grad_(True)
        w.requires_grad_(True)
        out, offs, stats, res = forward(x, ids, w, buf)
        (res.float() * grad.float()).sum().backward()
        return out.detach(), offs, stats, res.detach(), x.grad, w.grad

    outs = run_ranks(bufs, step)
    for r in range(world):
        check_model(r, world, seed, tokens, top_k, per_rank, "normal", cap, "mxfp8", align,
                    outs[r])  # fmt: skip


@pytest.mark.parametrize("exchange", ["mxfp8", "bf16", "mxfp8_to_experts"])
def test_one_rank_equals_nccl_path(exchange):
    """One rank: the push path (real symmetric memory on a GPU, an emulated buffer on the
    CPU) against the NCCL (gloo) path, bit for bit, forward and backward."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    run_distributed(push_equals_nccl, 1, backend, _seed(), exchange, timeout=300)


def test_the_rule_picks_nccl_across_hosts_or_off_cuda():
    reasons = run_distributed(push_rule, 2, "gloo", fresh=True)
    assert reasons[0] == reasons[1]


def test_buffer_arguments_checked_on_every_rank():
    """One rank's bad argument: the same error on every rank, before any allocation."""
    errors = run_distributed(push_bad_argument, 2, "gloo")
    assert errors[0] == errors[1] and "rank 1: capacity must be" in errors[0]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("wire", ["mxfp8", "bf16"])
def test_encoders_store_where_all_to_all_puts_rows(device, wire):
    """Three ranks' encoders (scatter for dispatch, gather for combine, the combine backward's
    with its compact rows) through the tables, one after another: each receiver's rows are
    the NCCL path's buffers after all_to_all_single with splits cap, for every row sent."""
    g = fresh_generator()
    w, t, k, h, per_rank, cap = 3, 6, 2, 64, 2, 4
    experts = w * per_rank
    bufs = PushBuffer.emulated(w, h, experts, capacity=cap, exchange=wire, device=device)
    xs = [random_blocks((t, h), torch.float32, "cpu", g).bfloat16().to(device) for _ in range(w)]
    ids = [torch.randint(0, experts, (t, k), generator=g).to(device) for _ in range(w)]
    plans = [send_plan(i, experts, w, cap)[0] for i in ids]
    shape, dt = sk.wire_shape(w * cap, h, torch.bfloat16, wire)
    row_bytes = shape[1] * dt.itemsize
    index = [torch.randint(-1, t, (w * cap,), generator=g).to(device) for _ in range(w)]
    wts = [torch.rand(t, k, generator=g).to(device) for _ in range(w)]
    from mxfp8_a2a.moe import row_kernels_backward as skb

    for case in ("scatter", "gather", "backward"):
        sent = []
        for s, b in enumerate(bufs):
            table = b.table("rows", cap, row_bytes)
            if case == "scatter":
                sk.scatter_encode_into(xs[s], plans[s], table, shape[1], cap, wire, "rceil", True)
                sent.append((sk.scatter_encode(xs[s], plans[s], w * cap, wire, "rceil"), plans[s]))
            elif case == "gather":
                sk.gather_encode_into(xs[s], index[s], table, shape[1], cap, wire, "floor", True)
                rows = torch.where(index[s] >= 0, torch.arange(w * cap, device=device), -1)
                sent.append((sk.gather_encode(xs[s], index[s], wire, "floor"), rows))
            else:
                kept = sk.scatter_encode(xs[s], torch.arange(t * k, device=device).view(t, k),
                                         t * k, wire, "rceil")  # fmt: skip
                skb.slot_sum_decode_backward_into(xs[s], kept, plans[s], wts[s], table, shape[1],
                                                  cap, wire, "rceil", True, True, wire)  # fmt: skip
                full = sk.scatter_encode(xs[s], plans[s], w * cap, wire, "rceil")
                want, _ = skb.slot_sum_decode_backward(xs[s], full, plans[s], wts[s], w * cap,
                                                       wire, "rceil", wire)  # fmt: skip
                sent.append((want, plans[s]))
        for d, b in enumerate(bufs):
            got = b.received("rows", w * cap, shape[1], dt)
            for s, (buf, rows) in enumerate(sent):
                for r in rows.reshape(-1).tolist():
                    if r >= 0 and r // cap == d:
                        i = s * cap + r % cap
                        assert torch.equal(got[i], buf[r]), (case, s, d, r)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_buffer_sizes_and_errors(device):
    b = PushBuffer.emulated(4, 64, 8, tokens=10, top_k=3, device=device)[0]
    assert b.capacity == 10 * 2  # dropless: tokens * min(top_k, local experts)
    assert b.count_columns == 33 and b.row_bytes == 80
    assert b.nbytes >= 4 * b.capacity * b.row_bytes + 4 * 33 * 8
    with pytest.raises(ValueError, match="tokens"):
        PushBuffer.emulated(2, 64, 4, device="cpu")
    with pytest.raises(ValueError, match="multiple of the group size"):
        PushBuffer.emulated(3, 64, 4, capacity=1, device="cpu")
    x = torch.zeros(4, 64, dtype=torch.bfloat16, device=device)
    ids = torch.zeros(4, 2, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="PushBuffer holds"):
        mx.dispatch_static(x, ids, 8, b.capacity + 1, transport=b)
    with pytest.raises(ValueError, match="PushBuffer holds"):
        mx.dispatch_static(x, ids, 8, b.capacity, exchange="bf16", transport=b)
    with pytest.raises(ValueError, match="count columns"):
        mx.dispatch_static(x, ids, 4 * 40, 1, transport=b)
    with pytest.raises(ValueError, match="transport must be"):
        mx.dispatch_static(x, ids, 8, 1, transport="push")
    with pytest.raises(ValueError, match="bf16 or fp32 rows"):
        mx.dispatch_static(x.half(), ids, 8, 1, exchange="bf16", transport=b)
    with pytest.raises(TypeError, match="capcity"):
        PushBuffer.emulated(2, 64, 4, capcity=3, device="cpu")
    with pytest.raises(ValueError, match="spin_limit"):
        PushBuffer.emulated(2, 64, 4, capacity=3, device="cpu", spin_limit=2**31)
    b.free()
    with pytest.raises(RuntimeError, match="freed"):
        mx.dispatch_static(x, ids, 8, 1, transport=b)


@GPU
def test_two_processes_through_cuda_ipc():
    """The protocol across processes: two processes on one GPU, each one's buffer mapped into
    the other through CUDA IPC; each runs the static path over both and matches the model."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queues, results = [ctx.Queue(), ctx.Queue()], ctx.Queue()
    case, seed = (2, [7, 5], 2, 2, 6, 4), _seed()
    procs = [ctx.Process(target=ipc_rank, args=(r, seed, case, queues, results))
             for r in range(2)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert got == {0: None, 1: None}, got


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_barrier_gives_up_after_spin_limit_and_reset_clears(device):
    bufs = PushBuffer.emulated(2, 64, 2, capacity=1, device=device, spin_limit=3)
    bufs[0].barrier()  # rank 1 never comes: rank 0 gives up, and tells rank 1
    bufs[1].barrier()  # rank 0's signal is there: no wait
    for b in bufs:
        with pytest.raises(RuntimeError, match="gave up after 3 spins"):
            b.check()
    for b in bufs:
        b.reset()
    for b in bufs:
        b.check()
    assert not any(b._epochs.any() for b in bufs)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_one_rank_compiled_equals_eager(device):
    """torch.compile(fullgraph=True) traces the push path (its ops opaque, shapes from their
    fakes) and gives the eager bits; one emulated rank, so it runs anywhere."""
    seed, experts, cap = _seed(), 4, 6
    x, ids, w, _ = inputs(0, seed, 9, 2, experts, "normal", device)
    buf = PushBuffer.emulated(1, HIDDEN, experts, capacity=cap, device=device)[0]

    def forward(x, ids, w):
        out, offs, h = mx.dispatch_static(x, ids, experts, cap, align=4, transport=buf)
        return out, offs, mx.combine_static(out * 2, w, h)

    eager = forward(x, ids, w)
    compiled = torch.compile(forward, fullgraph=True)(x, ids, w)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)
