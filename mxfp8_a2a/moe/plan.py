"""The static dispatch's plan: where every (token, slot) row goes, computed on the device.

- :func:`send_plan`: from topk_ids [T, k], each row's send-buffer slot (-1: dropped), the
  rows kept per (destination rank, local expert), and the drop counts.
- :func:`receive_plan`: from the counts received [W, L], each receive-buffer row's output
  row, each output row's receive-buffer row, and the experts' aligned end offsets.

Two layouts of the wire buffers. Fixed slots (``capacity`` an int, the sync-free
dispatch_static): destination d's rows at [d * capacity, ...) of the send buffer, source s's
at [s * capacity, ...) of the receive buffer, rows past a pair's ``capacity`` dropped.
Packed (``capacity=None``, the host-synced dispatch, which has read the counts): no drops,
the pairs' rows back to back in rank order (what all_to_all_single with splits sends and
receives), so the buffers hold exactly the rows that travel.

The ``*_reference`` functions are the plain-torch definitions (stable sorts and binary
searches, about 40 small ops); on CUDA (and on CPU under TRITON_INTERPRET=1) the public
functions run Triton kernels instead, the same values exactly: the send plan in four
launches (per-chunk bucket counts, their running sums in torch, each row's rank in its
bucket and destination, the kept counts and rows), the receive plan in two (the tables of
its W * L segments, then every row). No atomics: the same result in every run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import _config
from .._common import cdiv, kernels_run_on, next_pow2
from ..formats.launch import launch


def static_rows(capacity: int, world: int, num_local: int, align: int) -> int:
    """Rows of static dispatch's output: the most that W * capacity received rows take once
    each of the L experts' blocks is rounded up to ``align``."""
    return (world * capacity + num_local * (align - 1)) // align * align


# ---------------------------------------------------------------------------- references


def _rank_in_bucket(key: torch.Tensor, buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(position of each element among the elements of its bucket, in index order; count of
    each bucket) for key int64 [N] in [0, buckets). A stable sort of int32 keys (half the
    radix passes of int64) and bucket bounds by binary search."""
    sorted_keys, order = torch.sort(key.to(torch.int32), stable=True)
    edges = torch.arange(buckets + 1, dtype=torch.int32, device=key.device)
    bounds = torch.searchsorted(sorted_keys, edges)  # first element of each bucket
    rank_sorted = torch.arange(key.numel(), device=key.device) - bounds[sorted_keys]
    return torch.empty_like(key).scatter_(0, order, rank_sorted), bounds.diff()


def send_plan_reference(
    topk_ids: Tensor, num_experts: int, world: int, capacity: int | None
) -> tuple[Tensor, Tensor, Tensor]:
    """From topk_ids [T, k]: rows_of int64 [T, k] (send-buffer row, -1 if dropped), sent
    int64 [W, L] (rows kept per destination rank and local expert), stats int64 [3]
    (StaticHandle.stats). The send buffer holds destination d's rows at [d * capacity,
    d * capacity + sum(sent[d])) (capacity None: at sum(sent[:d]), none dropped but invalid
    ids), grouped by local expert, token-major within."""
    t, k = topk_ids.shape
    local = num_experts // world
    flat = topk_ids.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < num_experts)
    dest = torch.where(valid, flat // local, world)  # bucket W: invalid ids
    pos, per_dest = _rank_in_bucket(dest, world + 1)
    kept = valid & (pos < capacity) if capacity is not None else valid
    key = torch.where(kept, flat, num_experts)  # bucket E: not sent
    rank_in_expert, per_expert = _rank_in_bucket(key, num_experts + 1)
    start = per_expert.cumsum(0) - per_expert  # kept rows of experts before e, this rank
    first = torch.arange(num_experts, device=flat.device) // local * local
    in_block = start[:num_experts] - start[first]  # expert e's offset in its rank's block
    e = flat.clamp(0, num_experts - 1)
    if capacity is None:  # destinations back to back
        row = start[e] + rank_in_expert
    else:
        row = dest.clamp(max=world - 1) * capacity + in_block[e] + rank_in_expert
    rows_of = torch.where(kept, row, -1).view(t, k)
    n_kept = per_expert[:num_experts].sum()
    invalid = per_dest[world]
    needed = per_dest[:world].max() if world else per_dest.new_zeros(())
    stats = torch.stack([t * k - invalid - n_kept, needed, invalid])
    return rows_of, per_expert[:num_experts].view(world, local), stats


def _sizes(recv: Tensor, capacity: int | None, align: int, rows) -> tuple[int, int]:
    """(receive-buffer rows, output rows) of a receive plan; packed (capacity None): the
    ``rows`` the caller counted on the host."""
    if capacity is not None:
        return recv.shape[0] * capacity, static_rows(capacity, *recv.shape, align)
    if rows is None:
        raise ValueError("a packed receive plan (capacity=None) needs rows=(n_recv, n_out)")
    return rows


def receive_plan_reference(
    recv: Tensor, capacity: int | None, align: int, rows: tuple[int, int] | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """From recv int64 [W, L] (rows from source s for local expert l): src_row int64 [N] (the
    receive-buffer row of each output row, -1 for padding), out_row int64 [R] (the output
    row of each receive-buffer row, -1 if unused) and the int32 [L] aligned end offsets.
    Fixed slots: R = W * capacity, N = static_rows(capacity, W, L, align); packed (capacity
    None): (R, N) = ``rows``, sum(recv) and the sum over l of round_up(sum_s recv[s, l],
    align), source s's rows at sum(recv[:s]) of the receive buffer."""
    world, local = recv.shape
    n_recv, n_out = _sizes(recv, capacity, align, rows)
    per_expert = recv.sum(0)
    padded = (per_expert + align - 1) // align * align
    ends = padded.cumsum(0)
    block = ends - padded  # where expert l's block starts
    from_src = recv.cumsum(0) - recv  # rows of l from sources before s
    in_src = recv.cumsum(1)  # inclusive: end of expert l's rows in source s's rows
    per_src = in_src[:, -1] if local else recv.new_zeros(world)
    if capacity is None:
        src_start = per_src.cumsum(0) - per_src
    else:
        src_start = torch.arange(world, device=recv.device) * capacity
    i = torch.arange(n_recv, device=recv.device)
    # the (s, l) segment of each receive row: segments' ends, flat, rise along the buffer
    seg = torch.searchsorted((src_start[:, None] + in_src).reshape(-1), i, right=True)
    s = seg // max(local, 1) if capacity is None else i // max(capacity, 1)
    q = i - src_start[s]
    used = q < per_src[s]
    lc = (seg % max(local, 1)).clamp(max=max(local - 1, 0))
    out = block[lc] + from_src[s, lc] + q - (in_src[s, lc] - recv[s, lc])
    out_row = torch.where(used, out, -1)
    # unused receive rows land in slots of their own past n_out (stores to one shared slot
    # would pile up on one address)
    src = torch.full((n_out + n_recv,), -1, dtype=torch.int64, device=recv.device)
    src.scatter_(0, torch.where(out_row < 0, n_out + i, out_row), i)
    return src[:n_out], out_row, ends.to(torch.int32)


# ---------------------------------------------------------------------------- kernels
# Send plan over the flat ids (token-major), in chunks of C: bucket b = id for valid ids,
# E for invalid ones, B (no bucket) past the end; B is a power of two > E.


@triton.jit
def _bucket(ids_ptr, i, n, num_experts, B: tl.constexpr):
    e = tl.load(ids_ptr + i, mask=i < n, other=0).to(tl.int64)
    b = tl.where((e >= 0) & (e < num_experts), e, num_experts)
    return tl.where(i < n, b, B)


@triton.jit
def _count_kernel(ids_ptr, hist_ptr, n, n_chunks, num_experts, C: tl.constexpr, B: tl.constexpr):
    """hist int32 [B, chunks]: the elements of each bucket in each chunk (bucket-major, so
    that the running sums over chunks scan the last dimension)."""
    c = tl.program_id(0)
    b = _bucket(ids_ptr, c.to(tl.int64) * C + tl.arange(0, C), n, num_experts, B)
    cols = tl.arange(0, B)
    tl.store(hist_ptr + cols * n_chunks + c, tl.sum((b[:, None] == cols[None, :]).to(tl.int32), 0))


@triton.jit
def _rank_kernel(ids_ptr, hist_ptr, cum_ptr, rows_ptr, cut_ptr, n, n_chunks, num_experts, local,
                 capacity, C: tl.constexpr, B: tl.constexpr):  # fmt: skip
    """rows int64 [n]: each kept element's rank among the elements of its expert (-1 if not
    kept); cut int32 [B]: for each destination that overflows, its experts' kept counts,
    written by its first dropped element (the one at position ``capacity``)."""
    c = tl.program_id(0)
    i = c.to(tl.int64) * C + tl.arange(0, C)
    b = _bucket(ids_ptr, i, n, num_experts, B)
    cols = tl.arange(0, B)
    at = cols * n_chunks + c
    prefix = tl.load(cum_ptr + at) - tl.load(hist_ptr + at)  # earlier chunks' elements
    onehot = (b[:, None] == cols[None, :]).to(tl.int32)
    before = prefix[None, :] + tl.cumsum(onehot, 0) - onehot  # [C, B]: earlier elements of e
    same_dest = ((cols // local)[None, :] == (b // local)[:, None]) & (cols < num_experts)[None, :]
    pos = tl.sum(tl.where(same_dest, before, 0), 1)  # position among its destination's
    rank = tl.sum(tl.where(onehot != 0, before, 0), 1)
    valid = (i < n) & (b < num_experts)
    tl.store(rows_ptr + i, tl.where(valid & (pos < capacity), rank, -1).to(tl.int64), mask=i < n)
    cut = valid & (pos == capacity)
    at = cut_ptr + cols[None, :] + tl.zeros([C, 1], dtype=tl.int32)
    tl.store(at, before, mask=cut[:, None] & same_dest)


@triton.jit
def _finish_kernel(cum_ptr, cut_ptr, sent_ptr, base_ptr, stats_ptr, n, n_chunks, num_experts,
                   world, local, capacity, WP: tl.constexpr, LP: tl.constexpr,
                   PACKED: tl.constexpr):  # fmt: skip
    """One program: sent int64 [W, L], base int64 [E] (d * capacity, PACKED: the kept rows
    of the destinations before d, plus the kept rows of d's experts before e: expert e's
    first send-buffer row), stats int64 [3]. cum's last column holds the bucket totals."""
    w = tl.arange(0, WP)[:, None]
    e = w * local + tl.arange(0, LP)[None, :]
    ok = (w < world) & (tl.arange(0, LP)[None, :] < local)
    total = tl.load(cum_ptr + e * n_chunks + n_chunks - 1, mask=ok, other=0)
    n_d = tl.sum(total, 1)
    over = n_d > capacity
    kept = tl.where(over[:, None], tl.load(cut_ptr + e, mask=ok & over[:, None], other=0), total)
    if PACKED:
        n_kept = tl.sum(kept, 1)
        first = (tl.cumsum(n_kept, 0) - n_kept).to(tl.int64)[:, None]
    else:
        first = w.to(tl.int64) * capacity
    base = first + tl.cumsum(kept, 1) - kept
    tl.store(sent_ptr + e, kept.to(tl.int64), mask=ok)
    tl.store(base_ptr + e, base, mask=ok)
    invalid = tl.load(cum_ptr + num_experts * n_chunks + n_chunks - 1).to(tl.int64)
    tl.store(stats_ptr, n - invalid - tl.sum(tl.sum(kept, 1), 0).to(tl.int64))
    tl.store(stats_ptr + 1, tl.max(n_d, 0).to(tl.int64))
    tl.store(stats_ptr + 2, invalid)


@triton.jit
def _rows_kernel(ids_ptr, rows_ptr, base_ptr, n, num_experts, BLOCK: tl.constexpr):
    """rows int64 [n] in place: rank -> base[e] + rank (the send-buffer row), -1 stays."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    r = tl.load(rows_ptr + i, mask=i < n, other=-1)
    e = tl.load(ids_ptr + i, mask=r >= 0, other=0).to(tl.int64)
    base = tl.load(base_ptr + tl.minimum(tl.maximum(e, 0), num_experts - 1), mask=r >= 0, other=0)
    tl.store(rows_ptr + i, tl.where(r >= 0, base + r, -1), mask=i < n)


# Receive plan: W * L segments (s, l), each contiguous in the receive buffer (source s's
# rows of expert l) and in the output (within expert l's block).


@triton.jit
def _segments_kernel(recv_ptr, tab_ptr, ends_ptr, world, local, capacity, align,
                     WP: tl.constexpr, LP: tl.constexpr, PACKED: tl.constexpr):  # fmt: skip
    """One program: tab int64 [6 * W * L + 2 * W] = (end of (s, l) within source s's rows;
    output row minus receive row; end of (s, l) within expert l's rows; receive row minus
    output row; block start; rows (the last two per l, in the first L entries); then per
    source the end and the start of its rows in the receive buffer), ends int32 [L]."""
    s = tl.arange(0, WP)[:, None]
    li = tl.arange(0, LP)
    at = s * local + li[None, :]
    ok = (s < world) & (li[None, :] < local)
    recv = tl.load(recv_ptr + at, mask=ok, other=0).to(tl.int64)
    per_expert = tl.sum(recv, 0)
    padded = (per_expert + align - 1) // align * align
    ends = tl.cumsum(padded, 0)
    block = ends - padded
    in_src = tl.cumsum(recv, 1)  # inclusive
    from_src = tl.cumsum(recv, 0)  # inclusive
    per_src = tl.sum(recv, 1)
    src_end = tl.cumsum(per_src, 0)
    if PACKED:
        src_start = src_end - per_src
    else:
        src_start = tl.arange(0, WP).to(tl.int64) * capacity
    n = world * local
    tl.store(tab_ptr + at, in_src, mask=ok)
    tl.store(tab_ptr + n + at, block[None, :] + from_src - in_src, mask=ok)
    tl.store(tab_ptr + 2 * n + at, from_src, mask=ok)
    three = src_start[:, None] + in_src - from_src - block[None, :]
    tl.store(tab_ptr + 3 * n + at, three, mask=ok)
    tl.store(tab_ptr + 4 * n + li, block, mask=li < local)
    tl.store(tab_ptr + 5 * n + li, per_expert, mask=li < local)
    w = tl.arange(0, WP)
    tl.store(tab_ptr + 6 * n + w, src_end, mask=w < world)
    tl.store(tab_ptr + 6 * n + world + w, src_start, mask=w < world)
    tl.store(ends_ptr + li, ends.to(tl.int32), mask=li < local)


@triton.jit
def _receive_rows_kernel(tab_ptr, ends_ptr, out_row_ptr, src_row_ptr, n_recv, n_out, world,
                         local, capacity, BLOCK: tl.constexpr, WP: tl.constexpr,
                         LP: tl.constexpr, PACKED: tl.constexpr):  # fmt: skip
    """out_row int64 [n_recv] and src_row int64 [n_out] (receive_plan_reference's), rows
    [pid * BLOCK, ...) of each; capacity >= 1 here unless PACKED (n_recv = 0 otherwise)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    n = world * local
    li = tl.arange(0, LP)[None, :]
    si = tl.arange(0, WP)[None, :]
    # out_row: receive row i = start(s) + q belongs to (s, l), l = #ends <= q in source s
    m = i < n_recv
    if PACKED:  # s = #sources whose rows end at or before i
        src_end = tl.load(tab_ptr + 6 * n + si, mask=si < world, other=2**62)
        s = tl.sum((src_end <= i[:, None]).to(tl.int64), 1)
        q = i - tl.load(tab_ptr + 6 * n + world + s, mask=m, other=0)
    else:
        s = i // capacity
        q = i - s * capacity
    in_src = tl.load(tab_ptr + s[:, None] * local + li, mask=m[:, None] & (li < local), other=2**62)
    lid = tl.sum((in_src <= q[:, None]).to(tl.int32), 1)
    used = m & (lid < local)
    o = tl.load(tab_ptr + n + s * local + lid, mask=used, other=0) + q
    tl.store(out_row_ptr + i, tl.where(used, o, -1), mask=m)
    # src_row: output row i is in block l = #ends <= i, from source s = #(s, l) ends <= r
    m = i < n_out
    ends = tl.load(ends_ptr + li, mask=li < local, other=2**31 - 1)
    lid = tl.sum((ends <= i[:, None]).to(tl.int32), 1)
    r = i - tl.load(tab_ptr + 4 * n + lid, mask=m & (lid < local), other=0)
    has = m & (lid < local) & (r < tl.load(tab_ptr + 5 * n + lid, mask=m & (lid < local), other=0))
    seg = tl.load(tab_ptr + 2 * n + si * local + lid[:, None], mask=has[:, None] & (si < world),
                  other=2**62)  # fmt: skip
    src = tl.sum((seg <= r[:, None]).to(tl.int32), 1)
    o = tl.load(tab_ptr + 3 * n + src * local + lid, mask=has, other=0) + i
    tl.store(src_row_ptr + i, tl.where(has, o, -1), mask=m)


# ---------------------------------------------------------------------------- launchers


def _send_tiles(num_experts: int) -> tuple[int, int]:
    """(C, B): chunk of C elements, B = the next power of two past E buckets."""
    b = next_pow2(num_experts + 1)
    return max(_config.STATIC_PLAN_TILE // b, 16), b


def send_plan_kernels(
    topk_ids: Tensor, num_experts: int, world: int, capacity: int
) -> tuple[Tensor, Tensor, Tensor]:
    """send_plan_reference's results by the kernels (integer topk_ids on a kernel device;
    capacity -1: packed)."""
    t, k = topk_ids.shape
    local, n, dev = num_experts // world, t * k, topk_ids.device
    packed = capacity < 0
    capacity = n if packed else capacity  # (no row is past position n: none dropped)
    ids = topk_ids.reshape(-1).contiguous()
    c, b = _send_tiles(num_experts)
    rows = torch.empty(n, dtype=torch.int64, device=dev)
    cut = torch.empty(b, dtype=torch.int32, device=dev)
    chunks = max(cdiv(n, c), 1)
    if n:
        hist = torch.empty((b, chunks), dtype=torch.int32, device=dev)
        launch(_count_kernel, chunks, (ids, hist, n, chunks, num_experts), dict(C=c, B=b),
               _config.STATIC_PLAN_NUM_WARPS)  # fmt: skip
        # (along the last dimension: torch's scan over the first one runs one thread per
        # column through every row, 90 us here on one H200)
        cum = torch.cumsum(hist, 1, dtype=torch.int32)
        args = (ids, hist, cum, rows, cut, n, chunks, num_experts, local, capacity)
        launch(_rank_kernel, chunks, args, dict(C=c, B=b), _config.STATIC_PLAN_NUM_WARPS)
    else:
        cum = torch.zeros((b, 1), dtype=torch.int32, device=dev)
    sent = torch.empty((world, local), dtype=torch.int64, device=dev)
    base = torch.empty(num_experts, dtype=torch.int64, device=dev)
    stats = torch.empty(3, dtype=torch.int64, device=dev)
    args = (cum, cut, sent, base, stats, n, chunks, num_experts, world, local, capacity)
    consts = dict(WP=next_pow2(world), LP=next_pow2(local), PACKED=packed)
    launch(_finish_kernel, 1, args, consts, _config.STATIC_PLAN_NUM_WARPS)
    if n:
        blk = _config.STATIC_PLAN_BLOCK
        launch(_rows_kernel, cdiv(n, blk), (ids, rows, base, n, num_experts), dict(BLOCK=blk),
               _config.STATIC_PLAN_NUM_WARPS)  # fmt: skip
    return rows.view(t, k), sent, stats


def receive_plan_kernels(
    recv: Tensor, capacity: int, align: int, n_recv: int, n_out: int
) -> tuple[Tensor, Tensor, Tensor]:
    """receive_plan_reference's results by the kernels (recv int64 on a kernel device;
    capacity -1: packed; n_recv, n_out: _sizes')."""
    world, local = recv.shape
    dev, packed = recv.device, capacity < 0
    wp, lp = next_pow2(world), next_pow2(local)
    tab = torch.empty(6 * world * local + 2 * world, dtype=torch.int64, device=dev)
    ends = torch.empty(local, dtype=torch.int32, device=dev)
    out_row = torch.empty(n_recv, dtype=torch.int64, device=dev)
    src_row = torch.empty(n_out, dtype=torch.int64, device=dev)
    args = (recv.contiguous(), tab, ends, world, local, max(capacity, 0), align)
    launch(_segments_kernel, 1, args, dict(WP=wp, LP=lp, PACKED=packed),
           _config.STATIC_PLAN_NUM_WARPS)  # fmt: skip
    if max(n_recv, n_out):
        blk = max(min(_config.STATIC_PLAN_TILE // max(wp, lp), _config.STATIC_PLAN_BLOCK), 16)
        args = (tab, ends, out_row, src_row, n_recv, n_out, world, local, max(capacity, 1))
        consts = dict(BLOCK=blk, WP=wp, LP=lp, PACKED=packed)
        grid = cdiv(max(n_recv, n_out), blk)
        launch(_receive_rows_kernel, grid, args, consts, _config.STATIC_PLAN_NUM_WARPS)
    return src_row, out_row, ends


# ---------------------------------------------------------------------------- ops, public

send_plan_op = torch.library.custom_op(
    "mxfp8_a2a::static_send_plan", send_plan_kernels, mutates_args=()
)
receive_plan_op = torch.library.custom_op(
    "mxfp8_a2a::static_receive_plan", receive_plan_kernels, mutates_args=()
)


@send_plan_op.register_fake
def _(topk_ids, num_experts, world, capacity):
    new = topk_ids.new_empty
    i64 = torch.int64
    return (
        new(topk_ids.shape, dtype=i64),
        new((world, num_experts // world), dtype=i64),
        new((3,), dtype=i64),
    )


@receive_plan_op.register_fake
def _(recv, capacity, align, n_recv, n_out):
    new = recv.new_empty
    return new((n_out,)), new((n_recv,)), new((recv.shape[1],), dtype=torch.int32)


def send_plan(
    topk_ids: Tensor, num_experts: int, world: int, capacity: int | None
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`send_plan_reference`'s (rows_of int64 [T, k], sent int64 [W, L], stats int64
    [3]), by the kernels where they run. capacity None: the packed layout."""
    if kernels_run_on(topk_ids.device, _rank_kernel) and not topk_ids.dtype.is_floating_point:
        return send_plan_op(topk_ids, num_experts, world, -1 if capacity is None else capacity)
    return send_plan_reference(topk_ids, num_experts, world, capacity)


def receive_plan(
    recv: Tensor, capacity: int | None, align: int, rows: tuple[int, int] | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`receive_plan_reference`'s (src_row int64 [N], out_row int64 [R], ends int32
    [L]) for recv int64 [W, L], by the kernels where they run. capacity None: the packed
    layout, of ``rows`` = (R, N) rows, counted by the caller."""
    n_recv, n_out = _sizes(recv, capacity, align, rows)
    if kernels_run_on(recv.device, _segments_kernel) and recv.dtype == torch.int64:
        cap = -1 if capacity is None else capacity
        return receive_plan_op(recv, cap, align, n_recv, n_out)
    return receive_plan_reference(recv, capacity, align, rows)
