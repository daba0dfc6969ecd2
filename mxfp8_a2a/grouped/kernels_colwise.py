"""The chunk kernel of the per-group FP8 scaling: groups along a strided axis of x (colwise
scales of a row-major tensor, the grad_w operands of a grouped GEMM), any strides in and out.
See per_group_scales.py for the launcher, kernels.py for the shared helpers and reference.py
for the definition it matches.

x is seen as [other, group] through strides, as in kernels.py. The work is cut into items:
tiles of BO other-axis indices (a strip) times BL group-axis indices (a chunk), whatever the
groups, so every load is a whole tile. A group's amax needs all its chunks before any of its
data can be written, so each item is read twice, in two passes done by different programs:

- pass 1 of item t: per-group amax of the tile (one segment per group it meets), merged into a
  workspace by atomic max (int32 bits of |x|: non-negative floats order as integers, NaN above
  inf), then one count on its super-strip's counter (SPS neighbouring strips; the items of a
  super-strip run chunk by chunk, so programs running together read neighbouring columns of
  the same rows, whole DRAM pages);
- pass 2 of item t - LAG: waits (spin, normally already satisfied) until every item of its
  super-strip has counted, reads the tile again, now from L2, writes scales and e4m3 data.

Programs take their item from a ticket (an atomic counter), not from program_id: a program
only ever waits on lower tickets, all of which belong to programs already running, so nothing
can deadlock whatever the hardware schedules first or whatever runs beside it. LAG >= the
items of one super-strip makes that hold (the launcher picks it); LAG also sets how much of x
is live between the two reads, which the launcher keeps to a fraction of L2.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..formats.bits import to_fp32
from .kernels import _e4m3_bits, _offsets, _scales

MAX_SPINS = tl.constexpr(1 << 22)  # bound of a wait: a bug shows as wrong data, not a hang


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def group_bounds(offs_ptr, n_groups, extent, BG: tl.constexpr):
    """Starts and ends [BG] of the groups (lanes from n_groups on: extent): offsets clamped
    into [0, extent] and made non-decreasing (running maximum); group g is [s[g], e[g])."""
    gi = tl.arange(0, BG)
    valid = gi < n_groups
    e = tl.load(offs_ptr + gi, mask=valid, other=extent)
    e = tl.associative_scan(tl.minimum(tl.maximum(e, 0), extent), 0, _max_combine)
    s = tl.load(offs_ptr + gi - 1, mask=valid & (gi > 0), other=0)
    s = tl.associative_scan(tl.minimum(tl.maximum(s, 0), extent), 0, _max_combine)
    return gi, tl.where(valid, s, extent), e


@triton.jit
def _pick(gi, v, g):
    return tl.sum(tl.where(gi == g, v, 0), axis=0)


@triton.jit
def _item(item, n_chunks, n_strips, sps):
    """(super-strip, its strips, strip, chunk) of ``item``: super-strips of ``sps`` strips
    (the last one may have fewer), inside one chunk-major."""
    per_super = n_chunks * sps
    sup = item // per_super
    width = tl.minimum(n_strips - sup * sps, sps)
    r = item - sup * per_super
    c = r // width
    return sup, width, sup * sps + r - c * width, c


@triton.jit
def _chunk_kernel(
    x_ptr, offs_ptr, scale_ptr, data_ptr, ws_ptr, n_other, extent, n_groups,
    sxo, sxg, sdo, sdg, n_chunks, n_strips, sps, lag,
    ROUND_POW2: tl.constexpr, SOFT: tl.constexpr, INT64: tl.constexpr,
    BO: tl.constexpr, BL: tl.constexpr, BG: tl.constexpr,
):  # fmt: skip
    """x: [other, group] through strides (sxo, sxg); data (uint8 e4m3 bits) likewise through
    (sdo, sdg), every group-axis index below ``extent`` written (0 where no group covers it);
    offs: int32 [n_groups] end offsets; scale: fp32 [n_groups, n_other]. ws: int32, zeroed:
    [0] the ticket counter, [1, 1 + n_supers) the super-strips' counters, then the amax bits
    [n_groups, n_other]. Grid: n_chunks * n_strips + lag programs."""
    ticket = tl.atomic_add(ws_ptr, 1, sem="relaxed")
    n_items = n_chunks * n_strips
    n_supers = (n_strips + sps - 1) // sps
    amax_ptr = ws_ptr + 1 + n_supers
    gi, starts, ends = group_bounds(offs_ptr, n_groups, extent, BG)
    valid = gi < n_groups
    arange_o = tl.arange(0, BO)
    arange_l = tl.arange(0, BL)

    # pass 1 of item ``ticket``: its tile, from DRAM
    do1 = ticket < n_items
    sup1, _, strip1, c1 = _item(tl.minimum(ticket, n_items - 1), n_chunks, n_strips, sps)
    o1 = strip1 * BO + arange_o
    i1 = c1 * BL + arange_l
    # (masks built by comparing with a scalar bound: scalar & tensor trips the interpreter)
    lim1 = tl.where(do1, n_other, 0)
    omask1 = o1 < lim1
    tmask1 = omask1[:, None] & (i1 < extent)[None, :]
    bits1 = to_fp32(
        tl.load(x_ptr + _offsets(o1, i1, sxo, sxg, INT64), mask=tmask1, other=0.0), SOFT
    )
    bits1 = bits1.to(tl.int32, bitcast=True) & 0x7FFFFFFF

    # pass 2 of item ``ticket - lag``: is its super-strip done?
    v = ticket - lag
    do2 = (v >= 0) & (v < n_items)
    sup2, width2, strip2, c2 = _item(tl.maximum(v, 0), n_chunks, n_strips, sps)
    need = tl.where(do2, n_chunks * width2, 0)
    ready = tl.atomic_add(ws_ptr + 1 + sup2, 0, sem="acquire")

    # pass 1: amax of each group's segment of the tile, merged atomically. Groups met by
    # the chunk [lo, hi): s < hi and e > lo (empty groups inside it do no harm).
    lo = c1 * BL
    g_first = tl.sum((valid & (ends <= lo)).to(tl.int32), axis=0)
    g_end = tl.sum((valid & (starts < lo + BL)).to(tl.int32), axis=0)
    dep = tl.zeros((BO,), dtype=tl.int32)
    if do1:
        for g in range(g_first, g_end):
            s = _pick(gi, starts, g)
            e = _pick(gi, ends, g)
            inside = ((i1 >= s) & (i1 < e))[None, :]
            amax = tl.max(tl.where(inside, bits1, 0), axis=1)
            row = g.to(tl.int64) * n_other if INT64 else g * n_other
            m = o1 < tl.where(e > s, lim1, 0)
            old = tl.atomic_max(amax_ptr + row + o1, amax, mask=m, sem="relaxed")
            dep = tl.maximum(dep, tl.where(m, old, 0))

    # pass 2
    if do2:
        spins = 0
        while (ready < need) & (spins < MAX_SPINS):
            ready = tl.atomic_add(ws_ptr + 1 + sup2, 0, sem="acquire")
            spins += 1
        o2 = strip2 * BO + arange_o
        i2 = c2 * BL + arange_l
        omask2 = o2 < n_other
        tmask2 = omask2[:, None] & (i2 < extent)[None, :]
        x2 = to_fp32(
            tl.load(x_ptr + _offsets(o2, i2, sxo, sxg, INT64), mask=tmask2, other=0.0), SOFT
        )
        # groups met by the chunk, and those whose scales it writes (start in [lo, hi), the
        # last chunk also those starting at the end): s < hi' and not (e <= lo and s < lo)
        lo = c2 * BL
        hi = tl.where(c2 == n_chunks - 1, extent + 1, lo + BL)
        g_first = tl.minimum(
            tl.sum((valid & (ends <= lo)).to(tl.int32), axis=0),
            tl.sum((valid & (starts < lo)).to(tl.int32), axis=0),
        )
        g_end = tl.sum((valid & (starts < hi)).to(tl.int32), axis=0)
        y = tl.zeros((BO, BL), dtype=tl.float32)
        for g in range(g_first, g_end):
            s = _pick(gi, starts, g)
            e = _pick(gi, ends, g)
            row = g.to(tl.int64) * n_other if INT64 else g * n_other
            amax = tl.load(amax_ptr + row + o2, mask=omask2, other=0, cache_modifier=".cg")
            scale = _scales(amax, ROUND_POW2)
            tl.store(scale_ptr + row + o2, scale, mask=o2 < tl.where(s >= lo, n_other, 0))
            inside = ((i2 >= s) & (i2 < e))[None, :]
            y = tl.where(inside, x2 * scale[:, None], y)
        tl.store(data_ptr + _offsets(o2, i2, sdo, sdg, INT64), _e4m3_bits(y, SOFT), mask=tmask2)

    # count pass 1 as done, once its atomics have returned (``dep`` depends on them all)
    if do1:
        inc = 1 + tl.minimum(tl.max(dep, axis=0), 0)  # 1: amax bits are never negative
        tl.atomic_add(ws_ptr + 1 + sup1, inc, sem="release")


def lag_and_supers(
    n_chunks: int, n_strips: int, tile_bytes: int, l2_bytes: int, max_sps: int, margin: int
) -> tuple[int, int]:
    """(strips per super-strip, lag) for the chunk kernel: as many strips per super-strip as
    keep one super-strip's tiles within ``l2_bytes`` (at least 1, at most ``max_sps``), and a
    lag of one super-strip plus ``margin`` items (at most the item count)."""
    sps = max(1, min(max_sps, n_strips, l2_bytes // max(1, n_chunks * tile_bytes)))
    n_items = n_chunks * n_strips
    return sps, min(n_chunks * sps + margin, n_items)
