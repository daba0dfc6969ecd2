"""Triton kernels of the dispatch plan: plan.py holds the plain-torch references they equal,
exactly, and the custom ops over these launchers. No atomics: the same result in every run.

The send plan in four launches (per-chunk bucket counts, their running sums in torch, each
row's rank in its bucket and destination, the kept counts and rows), the receive plan in two
(the tables of its W * L segments, then every row). A launcher's capacity -1 asks for the
packed layout (plan.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import _config
from .._common import cdiv, next_pow2
from ..formats.launch import launch

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
