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
def _next_group(offs_ptr, g, prev_end, extent):
    """Bounds of group g from the end of group g - 1 (the same as group_bounds gives)."""
    return prev_end, tl.maximum(tl.minimum(tl.maximum(tl.load(offs_ptr + g), 0), extent), prev_end)


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
def _amax_rows(
    x_ptr, o, omask, i0, i1, sxo, sxg,
    SOFT: tl.constexpr, INT64: tl.constexpr, BO: tl.constexpr, SUB: tl.constexpr,
):  # fmt: skip
    """amax bits [BO] of rows [i0, i1), SUB rows at a time."""
    amax = tl.zeros((BO,), dtype=tl.int32)
    for r in range(i0 // SUB * SUB, i1, SUB):
        i = r + tl.arange(0, SUB)
        mask = omask[:, None] & ((i >= i0) & (i < i1))[None, :]
        x = tl.load(x_ptr + _offsets(o, i, sxo, sxg, INT64), mask=mask, other=0.0)
        bits = to_fp32(x, SOFT).to(tl.int32, bitcast=True) & 0x7FFFFFFF
        amax = tl.maximum(amax, tl.max(bits, axis=1))
    return amax


@triton.jit
def _cast_rows(
    x_ptr, data_ptr, o, omask, i0, i1, scale, sxo, sxg, sdo, sdg,
    SOFT: tl.constexpr, INT64: tl.constexpr, SUB: tl.constexpr,
):  # fmt: skip
    """e4m3 data x * scale of rows [i0, i1), SUB rows at a time."""
    for r in range(i0 // SUB * SUB, i1, SUB):
        i = r + tl.arange(0, SUB)
        mask = omask[:, None] & ((i >= i0) & (i < i1))[None, :]
        x = to_fp32(tl.load(x_ptr + _offsets(o, i, sxo, sxg, INT64), mask=mask, other=0.0), SOFT)
        y = _e4m3_bits(x * scale[:, None], SOFT)
        tl.store(data_ptr + _offsets(o, i, sdo, sdg, INT64), y, mask=mask)


@triton.jit
def _zero_rows(
    data_ptr, o, omask, i0, i1, sdo, sdg, INT64: tl.constexpr, BO: tl.constexpr, SUB: tl.constexpr
):  # fmt: skip
    """e4m3 zeros in rows [i0, i1), SUB rows at a time."""
    for r in range(i0 // SUB * SUB, i1, SUB):
        i = r + tl.arange(0, SUB)
        mask = omask[:, None] & ((i >= i0) & (i < i1))[None, :]
        zero = tl.zeros((BO, SUB), dtype=tl.uint8)
        tl.store(data_ptr + _offsets(o, i, sdo, sdg, INT64), zero, mask=mask)


@triton.jit
def _merge_amax(amax_ptr, g, o, lim, amax, dep, n_other, INT64: tl.constexpr):
    """Atomic max of a group's amax into the workspace (other-axis indices below ``lim``);
    ``dep`` takes the values returned, so that the count waits for them."""
    row = tl.cast(g, tl.int64) * n_other if INT64 else g * n_other
    m = o < lim
    old = tl.atomic_max(amax_ptr + row + o, amax, mask=m, sem="relaxed")
    return tl.maximum(dep, tl.where(m, old, 0))


@triton.jit
def _group_scale(amax_ptr, scale_ptr, g, o, omask, owner, n_other,
                 ROUND_POW2: tl.constexpr, INT64: tl.constexpr):  # fmt: skip
    """The group's scales from the finished amax (read from L2); its owner chunk stores them."""
    row = tl.cast(g, tl.int64) * n_other if INT64 else g * n_other
    amax = tl.load(amax_ptr + row + o, mask=omask, other=0, cache_modifier=".cg")
    scale = _scales(amax, ROUND_POW2)
    tl.store(scale_ptr + row + o, scale, mask=o < tl.where(owner, n_other, 0))
    return scale


@triton.jit
def _chunk_kernel(
    x_ptr, offs_ptr, scale_ptr, data_ptr, ws_ptr, n_other, extent, n_groups,
    sxo, sxg, sdo, sdg, n_chunks, n_strips, sps, lag,
    ROUND_POW2: tl.constexpr, SOFT: tl.constexpr, INT64: tl.constexpr,
    BO: tl.constexpr, BL: tl.constexpr, BG: tl.constexpr, ALIGN: tl.constexpr,
    UNALIGNED: tl.constexpr,
):  # fmt: skip
    """x: [other, group] through strides (sxo, sxg); data (uint8 e4m3 bits) likewise through
    (sdo, sdg), every group-axis index below ``extent`` written (0 where no group covers it);
    offs: int32 [n_groups] end offsets; scale: fp32 [n_groups, n_other]. ws: int32, zeroed:
    [0] the ticket counter, [1, 1 + n_supers) the super-strips' counters, then the amax bits
    [n_groups, n_other]. Grid: n_chunks * n_strips + lag programs.

    A chunk inside one group takes straight-line code over the whole tile. Other chunks loop
    over their groups, each loading and storing only its rows (nothing tile-sized lives
    across iterations, which keeps registers low); group bounds that are multiples of ALIGN
    get their own copy of that code, in which the compiler sees the alignment and moves whole
    vectors along the group axis (column-major data, or a transposed x); other bounds go
    UNALIGNED rows at a time, element by element along that axis, with few addresses live."""
    ticket = tl.atomic_add(ws_ptr, 1, sem="relaxed")
    n_items = n_chunks * n_strips
    n_supers = (n_strips + sps - 1) // sps
    amax_ptr = ws_ptr + 1 + n_supers
    gi, starts, ends = group_bounds(offs_ptr, n_groups, extent, BG)
    valid = gi < n_groups

    # pass 1 of item ``ticket``: amax of each group's rows in the tile, merged atomically.
    # Groups met by the chunk [lo, hi): s < hi and e > lo (empty ones inside it do no harm).
    do1 = ticket < n_items
    sup1, _, strip1, c1 = _item(tl.minimum(ticket, n_items - 1), n_chunks, n_strips, sps)
    o1 = strip1 * BO + tl.arange(0, BO)
    # (masks compare with a scalar bound: a scalar & a tensor trips the interpreter)
    lim1 = tl.where(do1, n_other, 0)
    omask1 = o1 < lim1
    lo = c1 * BL
    hi = tl.minimum(lo + BL, extent)
    g_first = tl.sum((valid & (ends <= lo)).to(tl.int32), axis=0)
    g_end = tl.sum((valid & (starts < lo + BL)).to(tl.int32), axis=0)
    dep = tl.zeros((BO,), dtype=tl.int32)
    s = _pick(gi, starts, g_first)
    if (g_end - g_first == 1) & (s <= lo) & (_pick(gi, ends, g_first) >= hi):
        amax = _amax_rows(x_ptr, o1, omask1, lo, hi, sxo, sxg, SOFT, INT64, BO, BL)
        dep = _merge_amax(amax_ptr, g_first, o1, lim1, amax, dep, n_other, INT64)
    else:
        e = s
        for g in range(g_first, g_end):
            s, e = _next_group(offs_ptr, g, e, extent)
            if (s % ALIGN == 0) & (e % ALIGN == 0):
                s = s // ALIGN * ALIGN  # the same values, in a form that shows the alignment
                e = e // ALIGN * ALIGN
                i0 = tl.maximum(s, lo)
                i1 = tl.minimum(e, hi)
                amax = _amax_rows(x_ptr, o1, omask1, i0, i1, sxo, sxg, SOFT, INT64, BO, BL)
            else:
                i0 = tl.maximum(s, lo)
                i1 = tl.minimum(e, hi)
                amax = _amax_rows(x_ptr, o1, omask1, i0, i1, sxo, sxg, SOFT, INT64, BO, UNALIGNED)
            dep = _merge_amax(amax_ptr, g, o1, tl.where(e > s, lim1, 0), amax, dep, n_other, INT64)

    # pass 2 of item ``ticket - lag``, once every item of its super-strip has counted
    v = ticket - lag
    do2 = (v >= 0) & (v < n_items)
    sup2, width2, strip2, c2 = _item(tl.maximum(v, 0), n_chunks, n_strips, sps)
    if do2:
        need = n_chunks * width2
        ready = tl.atomic_add(ws_ptr + 1 + sup2, 0, sem="acquire")
        spins = 0
        while (ready < need) & (spins < MAX_SPINS):
            ready = tl.atomic_add(ws_ptr + 1 + sup2, 0, sem="acquire")
            spins += 1
        o2 = strip2 * BO + tl.arange(0, BO)
        omask2 = o2 < n_other
        # groups met by the chunk, and those whose scales it writes (start in [lo, hi), the
        # last chunk also those starting at the end): s < hi' and not (e <= lo and s < lo)
        lo = c2 * BL
        hi = tl.minimum(lo + BL, extent)
        g_first = tl.minimum(
            tl.sum((valid & (ends <= lo)).to(tl.int32), axis=0),
            tl.sum((valid & (starts < lo)).to(tl.int32), axis=0),
        )
        last = tl.where(c2 == n_chunks - 1, extent + 1, lo + BL)
        g_end = tl.sum((valid & (starts < last)).to(tl.int32), axis=0)
        s = _pick(gi, starts, g_first)
        if (g_end - g_first == 1) & (s <= lo) & (_pick(gi, ends, g_first) >= hi):
            scale = _group_scale(
                amax_ptr, scale_ptr, g_first, o2, omask2, s >= lo, n_other, ROUND_POW2, INT64
            )
            _cast_rows(
                x_ptr, data_ptr, o2, omask2, lo, hi, scale, sxo, sxg, sdo, sdg, SOFT, INT64, BL
            )
        else:
            e = s
            for g in range(g_first, g_end):
                s, e = _next_group(offs_ptr, g, e, extent)
                scale = _group_scale(
                    amax_ptr, scale_ptr, g, o2, omask2, s >= lo, n_other, ROUND_POW2, INT64
                )
                if (s % ALIGN == 0) & (e % ALIGN == 0):
                    s = s // ALIGN * ALIGN
                    e = e // ALIGN * ALIGN
                    i0 = tl.maximum(s, lo)
                    i1 = tl.minimum(e, hi)
                    _cast_rows(
                        x_ptr, data_ptr, o2, omask2, i0, i1, scale,
                        sxo, sxg, sdo, sdg, SOFT, INT64, BL,
                    )  # fmt: skip
                else:
                    i0 = tl.maximum(s, lo)
                    i1 = tl.minimum(e, hi)
                    _cast_rows(
                        x_ptr, data_ptr, o2, omask2, i0, i1, scale,
                        sxo, sxg, sdo, sdg, SOFT, INT64, UNALIGNED,
                    )  # fmt: skip
            covered = tl.max(tl.where(valid, ends, 0), axis=0)  # no group past this index
            if covered < hi:
                _zero_rows(
                    data_ptr,
                    o2,
                    omask2,
                    tl.maximum(covered, lo),
                    hi,
                    sdo,
                    sdg,
                    INT64,
                    BO,
                    UNALIGNED,
                )

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
