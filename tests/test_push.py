"""exchange/push.py: W ranks emulated in one process (W receive buffers, their addresses in
a table, one push per source rank), against the plain-torch reference bit for bit."""

from __future__ import annotations

import pytest
import torch
from helpers import KERNEL_DEVICES, fresh_generator, random_blocks, with_specials

from mxfp8_a2a.exchange.push import push_reference, push_rows, receive_plan, unpack_received
from mxfp8_a2a.exchange.rows import wire_row
from mxfp8_a2a.formats.dequantize import dequantize_reference
from mxfp8_a2a.formats.packing import packed_row_bytes, unpack

SENTINEL = 0xA5  # what the buffers hold before the pushes: bytes nothing wrote keep it


def emulate(xs, counts, capacity, mode):
    """Every rank's push into W buffers on xs[0]'s device; returns (buffers, plan)."""
    device, k = xs[0].device, xs[0].shape[1]
    w = counts.shape[0]
    counts = counts.to(device)
    start, received, overflow = receive_plan(counts, capacity)
    bufs = [torch.full((capacity, wire_row(k)), SENTINEL, dtype=torch.uint8, device=device)
            for _ in range(w)]  # fmt: skip
    table = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=device)
    for s, x in enumerate(xs):
        push_rows(x, table, counts[s].to(torch.int64), start[s], capacity, mode)
    return bufs, (start, received, overflow)


def random_counts(w, g, rows_per_rank, zeros=True):
    counts = torch.randint(0, rows_per_rank + 1, (w, w), generator=g)
    if zeros:
        counts[torch.rand((w, w), generator=g) < 0.25] = 0
    return counts


def check(xs, counts, capacity, mode, bufs, plan):
    k = xs[0].shape[1]
    start, received, overflow = plan
    want = push_reference([x.cpu() for x in xs], counts, capacity, mode)
    assert torch.equal(received.cpu(), counts.sum(0))
    assert torch.equal(overflow.cpu(), counts.sum(0) > capacity)
    for d, buf in enumerate(bufs):
        n = want[d].shape[0]
        buf = buf.cpu()
        assert torch.equal(buf[:n, : packed_row_bytes(k)], want[d]), f"rank {d}"
        assert bool((buf[:n, packed_row_bytes(k) :] == SENTINEL).all()), "wire row padding"
        assert bool((buf[n:] == SENTINEL).all()), f"rank {d}: rows past the received ones"


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("w", [1, 3, 4])
def test_push_matches_reference(device, dtype, mode, w):
    g = fresh_generator()
    k = 96
    counts = random_counts(w, g, 9)
    xs = []
    for s in range(w):
        n = int(counts[s].sum())
        x = with_specials(random_blocks((max(8, n), k), torch.float32, "cpu", g), g)
        xs.append(x[:n].to(device, dtype))
    capacity = int(counts.sum(0).max()) + 3
    bufs, plan = emulate(xs, counts, capacity, mode)
    check(xs, counts, capacity, mode, bufs, plan)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_one_destination_receives_everything_and_zero_splits(device):
    g = fresh_generator()
    w, k = 3, 64
    counts = torch.zeros(w, w, dtype=torch.int64)
    counts[:, 1] = torch.tensor([5, 0, 7])
    xs = [random_blocks((int(counts[s].sum()), k), torch.bfloat16, "cpu", g).to(device)
          for s in range(w)]  # fmt: skip
    bufs, plan = emulate(xs, counts, 12, "rceil")
    check(xs, counts, 12, "rceil", bufs, plan)
    assert not bool(plan[2].any())


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_capacity_overflow_is_flagged_and_writes_nothing_past_it(device):
    g = fresh_generator()
    w, k = 3, 32
    counts = torch.tensor([[4, 6, 0], [3, 2, 1], [5, 0, 2]])
    capacity = 8  # rank 0 receives 12, rank 1 8, rank 2 3
    xs = [random_blocks((int(counts[s].sum()), k), torch.float32, "cpu", g).to(device)
          for s in range(w)]  # fmt: skip
    bufs, plan = emulate(xs, counts, capacity, "rceil")
    assert plan[2].cpu().tolist() == [True, False, False]
    check(xs, counts, capacity, "rceil", bufs, plan)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_rows_past_the_counts_are_not_sent(device):
    """x may hold more rows than its counts say (e.g. a capacity-sized send buffer)."""
    g = fresh_generator()
    k = 32
    counts = torch.tensor([[2, 1], [0, 3]])
    xs = [random_blocks((6, k), torch.float32, "cpu", g).to(device) for _ in range(2)]
    bufs, plan = emulate(xs, counts, 5, "floor")
    check([x[: int(counts[s].sum())] for s, x in enumerate(xs)], counts, 5, "floor", bufs, plan)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_bad_counts_write_nothing_outside_the_buffers(device):
    """Negative counts (a caller's bug; never read on the host, so never rejected there):
    whatever lands, nothing is written outside a receive buffer (guard rows around each)."""
    g = fresh_generator()
    k, capacity, guard = 32, 6, 4
    counts = torch.tensor([[3, -2, 4], [-5, 2, 2], [1, 1, -1]])
    row = wire_row(k)
    arena = torch.full((3, guard + capacity + guard, row), SENTINEL, dtype=torch.uint8)
    arena = arena.to(device)
    table = torch.tensor(
        [arena[d, guard].data_ptr() for d in range(3)], dtype=torch.int64, device=device
    )
    start, _, _ = receive_plan(counts.to(device), capacity)
    for s in range(3):
        x = random_blocks((8, k), torch.float32, "cpu", g).to(device)
        push_rows(x, table, counts[s].to(device), start[s], capacity)
    arena = arena.cpu()
    assert bool((arena[:, :guard] == SENTINEL).all()), "written before a buffer"
    assert bool((arena[:, -guard:] == SENTINEL).all()), "written after a buffer"


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_unpack_received_rank_encoded_rows(device):
    """Row j of rank s holds s + 1 in its first block and j + 1 in its second (exact in
    e4m3): each receiver gets its sources' rows in source-major order, dequantized, and
    zeros (never the buffer's bytes) past the received count."""
    w, k = 3, 64
    counts = torch.tensor([[1, 2, 0], [2, 0, 1], [1, 1, 1]])
    xs = []
    for s in range(w):
        n = int(counts[s].sum())
        x = torch.empty(n, k)
        x[:, :32] = s + 1
        x[:, 32:] = torch.arange(1, n + 1, dtype=torch.float32)[:, None]
        xs.append(x.to(device, torch.bfloat16))
    capacity = 5
    bufs, (start, received, overflow) = emulate(xs, counts, capacity, "rceil")
    want = push_reference([x.cpu() for x in xs], counts, capacity, "rceil")
    for d in range(w):
        out, n = unpack_received(bufs[d], received[d], k, torch.bfloat16)
        assert int(n) == min(int(received[d]), capacity)
        ref = dequantize_reference(*unpack(want[d]), torch.bfloat16)
        assert torch.equal(out[: int(n)].cpu(), ref)
        assert bool((out[int(n) :] == 0).all())
        expect = [
            (s + 1, int(counts[s, :d].sum()) + j + 1)
            for s in range(w)
            for j in range(int(counts[s, d]))
        ]
        got = [(int(r[0]), int(r[32])) for r in out[: int(n)].float().cpu()]
        assert got == expect, (d, got, expect)


def test_bad_arguments():
    x = torch.zeros(4, 32)
    table = torch.zeros(2, dtype=torch.int64)
    good = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="square"):
        receive_plan(torch.zeros(2, 3, dtype=torch.int64), 4)
    with pytest.raises(TypeError, match="int32 or int64"):
        receive_plan(torch.zeros(2, 2), 4)
    with pytest.raises(ValueError, match="capacity"):
        receive_plan(torch.zeros(2, 2, dtype=torch.int64), -1)
    with pytest.raises(ValueError, match="multiple of 32"):
        push_rows(torch.zeros(4, 33), table, good, good, 4)
    with pytest.raises(ValueError, match="count must be an int64"):
        push_rows(x, table, good.int(), good, 4)
    with pytest.raises(ValueError, match="scaling_mode"):
        push_rows(x, table, good, good, 4, "nearest")
