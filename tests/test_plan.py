"""The dispatch plan's kernels (mxfp8_a2a.moe.plan) against its plain-torch references,
exactly: random, skewed and out-of-range routing, overflow and drops, capacity 0, top_k =
num_experts, ranks without tokens, int32 and int64 ids; the receive plan from counts of
every source up to the capacity. Both layouts: fixed slots (an int capacity) and packed
(capacity None), whose rows the tests also check against their definition."""

from __future__ import annotations

import pytest
import torch
from helpers import KERNEL_DEVICES, fresh_generator

from mxfp8_a2a import _config
from mxfp8_a2a.moe import plan as sp

# (tokens, top_k, experts, world): tiny, several ranks, top_k = E, E not a power of two,
# more buckets than one program's chunk holds
CASES = [(7, 2, 4, 2), (0, 3, 4, 1), (5, 4, 4, 1), (33, 3, 6, 3), (100, 8, 16, 1),
         (300, 2, 8, 4), (50, 3, 40, 5)]  # fmt: skip
ROUTING = ["random", "one_expert", "one_rank", "out_of_range"]


def ids_for(t, k, experts, world, routing, g):
    if routing == "random":  # distinct ids per token
        return torch.rand(t, experts, generator=g).topk(k, dim=1).indices
    if routing == "one_expert":  # repeated ids: every slot of every token to expert 0
        return torch.zeros(t, k, dtype=torch.int64)
    if routing == "one_rank":  # the last rank's experts only
        local = experts // world
        return experts - local + torch.randint(0, local, (t, k), generator=g)
    return torch.randint(-3, experts + 3, (t, k), generator=g)  # some ids out of range


def same(got, want, what):
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, i, a, b)
        assert torch.equal(a.cpu(), b.cpu()), (what, i, a, b)


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    """Chunks of 16-32 elements: several programs, each chunk boundary met by the scans."""
    monkeypatch.setattr(_config, "STATIC_PLAN_TILE", 512)
    monkeypatch.setattr(_config, "STATIC_PLAN_BLOCK", 64)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("routing", ROUTING)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_send_plan_matches_reference(device, routing, case):
    t, k, experts, world = case
    g = fresh_generator()
    ids = ids_for(t, k, experts, world, routing, g).to(device)
    for i, capacity in enumerate([*sorted({0, 1, 3, t * k // world + 1, t * k}), None]):
        dt = (torch.int64, torch.int32)[i % 2]
        what = (case, routing, capacity, dt)
        want = sp.send_plan_reference(ids.to(dt), experts, world, capacity)
        same(sp.send_plan(ids.to(dt), experts, world, capacity), want, what)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("align", [1, 3, 16])
@pytest.mark.parametrize("shape", [(1, 1), (2, 3), (3, 5), (4, 2), (1, 40)], ids=str)
def test_receive_plan_matches_reference(device, align, shape):
    world, local = shape
    g = fresh_generator()
    for capacity in (0, 1, 5, 37):
        for fill in ("random", "full", "empty", "one"):
            if fill == "random":  # each source sends at most capacity rows in all
                share = torch.rand(world, local, generator=g)
                share *= torch.rand(world, 1, generator=g) / share.sum(1, keepdim=True)
                recv = (share * capacity).floor().long()
            elif fill == "full":  # every source fills its capacity, on one expert
                recv = torch.zeros(world, local, dtype=torch.int64)
                recv[:, -1] = capacity
            elif fill == "empty":
                recv = torch.zeros(world, local, dtype=torch.int64)
            else:
                recv = torch.zeros(world, local, dtype=torch.int64)
                recv[world // 2, local // 2] = min(capacity, 1)
            recv = recv.to(device)
            what = (shape, align, capacity, fill, recv.tolist())
            want = sp.receive_plan_reference(recv, capacity, align)
            same(sp.receive_plan(recv, capacity, align), want, what)
            rows = packed_rows(recv, align)
            want = sp.receive_plan_reference(recv, None, align, rows)
            same(sp.receive_plan(recv, None, align, rows), want, (*what, "packed"))


def packed_rows(recv, align):
    per_expert = recv.sum(0)
    return int(recv.sum()), int(((per_expert + align - 1) // align * align).sum())


@pytest.mark.parametrize("routing", ROUTING)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_packed_plans_by_definition(routing, case):
    """Packed: destination d's rows right after those of d - 1, by local expert, token-major
    within; received rows from source s right after source s - 1's, each placed at its
    expert's block in source order."""
    t, k, experts, world = case
    local = experts // world
    ids = ids_for(t, k, experts, world, routing, fresh_generator()).reshape(-1)
    rows_of, sent, stats = sp.send_plan_reference(ids.view(t, k), experts, world, None)
    valid = (ids >= 0) & (ids < experts)
    order = sorted((int(e), i) for i, e in enumerate(ids.tolist()) if valid[i])
    want = torch.full((t * k,), -1, dtype=torch.int64)
    for row, (_, i) in enumerate(order):
        want[i] = row
    assert torch.equal(rows_of.reshape(-1), want)
    assert stats[0] == 0 and stats[2] == (~valid).sum()
    # the receive side of the same rows on one rank: sources are W ranks sending ``sent``
    recv = sent.view(world, local) if world == 1 else torch.randint(0, 4, (3, local))
    for align in (1, 4):
        src_row, out_row, ends = sp.receive_plan_reference(
            recv, None, align, packed_rows(recv, align)
        )
        starts = (recv.sum(1).cumsum(0) - recv.sum(1)).tolist()
        n_out, at = src_row.numel(), 0
        want_src = torch.full((n_out,), -1, dtype=torch.int64)
        for lid in range(local):
            for src in range(recv.shape[0]):
                first = starts[src] + int(recv[src, :lid].sum())
                for q in range(int(recv[src, lid])):
                    want_src[at] = first + q
                    at += 1
            at = int(ends[lid])
        assert torch.equal(src_row, want_src), (recv, align)
        assert torch.equal(out_row[src_row[src_row >= 0]], torch.nonzero(src_row >= 0)[:, 0])


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_plan_ops_pass_opcheck_and_compile(device):
    """Fake shapes and dtypes of the two ops; torch.compile(fullgraph=True) traces both."""
    g = fresh_generator()
    ids = ids_for(9, 2, 6, 3, "random", g).to(device)
    recv = torch.tensor([[1, 0], [2, 1], [0, 3]], device=device)
    torch.library.opcheck(sp.send_plan_op, (ids, 6, 3, 4))
    torch.library.opcheck(sp.receive_plan_op, (recv, 4, 4, 12, 16))
    torch.library.opcheck(sp.send_plan_op, (ids, 6, 3, -1))
    torch.library.opcheck(sp.receive_plan_op, (recv, -1, 4, 7, 8))

    def plan(ids, recv):
        packed = sp.receive_plan(recv, None, 4, (7, 8))
        return (*sp.send_plan(ids, 6, 3, 4), *sp.receive_plan(recv, 4, 4), *packed)

    torch._dynamo.reset()
    backend = "inductor" if device == "cuda" else "aot_eager"
    got = torch.compile(plan, fullgraph=True, backend=backend)(ids, recv)
    same(got, plan(ids, recv), "compiled")


def test_which_path(monkeypatch):
    """Float ids and int32 counts take the references (kernels: integer ids, int64 counts)."""
    taken = []
    for name in ("send_plan_reference", "receive_plan_reference"):
        fn = getattr(sp, name)
        monkeypatch.setattr(sp, name, lambda *a, _f=fn, _n=name: taken.append(_n) or _f(*a))
    sp.send_plan(torch.tensor([[0.0, 1.0]]), 2, 1, 2)
    sp.receive_plan(torch.tensor([[1, 1]], dtype=torch.int32), 2, 1)
    assert taken == ["send_plan_reference", "receive_plan_reference"], taken
