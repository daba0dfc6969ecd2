"""The colwise kernels of the per-group FP8 scaling: groups along a strided axis of x (colwise
scales of a row-major tensor, the grad_w operands of a grouped GEMM, the forward's weights),
any strides in and out. See per_group_scales.py for the launcher, kernels.py for the shared
helpers and reference.py for the definition they match.

x is seen as [batch, other, group] through strides (the batch runs independent problems with
the same offs: the experts of a weight, one group each). A group's amax needs all its rows
before any of its data can be written, so there are two launches, each over tiles of BO
other-axis indices (a strip) times BL group-axis indices (a chunk), whatever the groups:

- ``_amax_kernel``: per-group amax of each tile (one segment per group it meets), merged into
  a workspace by atomic max (int32 bits of |x|: non-negative floats order as integers, NaN
  above inf). x is read once.
- ``_cast_kernel``: tiles of the data's group axis (the destination); each reads its rows of x
  again, scales them and writes e4m3. The destination is x's own group axis (PAD=0), or a
  padded one (PAD=1): group g starts at a multiple of 16 and spans at least 16 indices, zeros
  after its rows, the last group runs to the data's end (what a 2-D x 2-D FP8 grouped GEMM
  needs: torch._scaled_grouped_mm's TMA loads want 16-byte group starts); the padded end
  offsets go to ``pad_ptr``. The program whose tile holds a group's first destination index
  writes that group's scales.

Bytes: x read twice and the data written once (5 per bf16 element), against 3 for one pass:
the price of not holding a group's rows on chip between its amax and its cast. Spans whose
bounds are multiples of ALIGN (16 where the group axis is contiguous: x's in the amax pass,
the data's in the cast) get their own copy of the loop, in which the compiler sees that
alignment and moves whole vectors along that axis (masked stores vectorize only over a mask
it can prove constant). With ``STAGES`` set (the GPU tilings), both loops ask for software
pipelining, that many loads in flight (Triton pipelines only loads that feed a dot unless a
loop asks).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..formats.bits import to_fp32
from .kernels import _e4m3_bits, _offsets, _scales, _stored_scale


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def group_bounds(offs_ptr, n_groups, extent, BG: tl.constexpr):
    """Lanes, validity, starts and ends [BG] of the groups (lanes from n_groups on: extent):
    offsets clamped into [0, extent] and made non-decreasing (running maximum); group g is
    [s[g], e[g])."""
    gi = tl.arange(0, BG)
    valid = gi < n_groups
    e = tl.load(offs_ptr + gi, mask=valid, other=extent)
    e = tl.associative_scan(tl.minimum(tl.maximum(e, 0), extent), 0, _max_combine)
    s = tl.load(offs_ptr + gi - 1, mask=valid & (gi > 0), other=0)
    s = tl.associative_scan(tl.minimum(tl.maximum(s, 0), extent), 0, _max_combine)
    return gi, valid, tl.where(valid, s, extent), e


@triton.jit
def _destinations(gi, valid, s, e, n_groups, dest_extent, PAD: tl.constexpr):
    """Where each group's rows go on the data's group axis: first index p [BG] and end of its
    region r [BG] (rows at [p, p + size), zeros in [p + size, r)). Unpadded: the group's own
    indices, the last region running to the end (indices no group covers get zeros)."""
    if PAD:
        padded = tl.where(valid, tl.maximum((e - s + 15) // 16 * 16, 16), 0)
        r = tl.cumsum(padded, 0)
        p = r - padded
    else:
        p = s
        r = e
    r = tl.where(gi == n_groups - 1, dest_extent, r)
    return tl.where(valid, p, dest_extent), tl.where(valid, r, dest_extent)


@triton.jit
def _pick(gi, v, g):
    return tl.sum(tl.where(gi == g, v, 0), axis=0)


@triton.jit
def _batch(ptr, b, stride, INT64: tl.constexpr):
    if INT64:
        return ptr + tl.cast(b, tl.int64) * stride
    return ptr + b * stride


@triton.jit
def _batch_table(ptr, b, n_groups, n_other, INT64: tl.constexpr):
    """Batch b's [n_groups, n_other] table (the workspace, the scales)."""
    if INT64:
        return ptr + tl.cast(b, tl.int64) * n_groups * n_other
    return ptr + b * n_groups * n_other


@triton.jit
def _amax_span(
    x_ptr, o, omask, i0, i1, sxo, sxg,
    SOFT: tl.constexpr, INT64: tl.constexpr, BO: tl.constexpr, SUB: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """amax bits [BO] of group-axis indices [i0, i1), SUB at a time: an elementwise max over
    the [BO, SUB] tiles, reduced across SUB once at the end (a reduction per tile crossed
    warps through shared memory every iteration and bounded the kernel, ncu: L1 94% busy,
    DRAM 33%). STAGES: loads in flight (software pipelining; None: one at a time)."""
    amax = tl.zeros((BO, SUB), dtype=tl.int32)
    for r in tl.range(i0 // SUB * SUB, i1, SUB, num_stages=STAGES):
        i = r + tl.arange(0, SUB)
        mask = omask[:, None] & ((i >= i0) & (i < i1))[None, :]
        x = tl.load(x_ptr + _offsets(o, i, sxo, sxg, INT64), mask=mask, other=0.0)
        amax = tl.maximum(amax, to_fp32(x, SOFT).to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    return tl.max(amax, axis=1)


@triton.jit
def _cast_span(x_ptr, data_ptr, o, omask, j0, j1, held_end, src, scale, sxo, sxg, sdo, sdg,
               SOFT: tl.constexpr, INT64: tl.constexpr, SUB: tl.constexpr,
               STAGES: tl.constexpr):  # fmt: skip
    """Destination indices [j0, j1), SUB at a time: e4m3 of x[j + src] * scale below
    held_end, zeros from there. STAGES as in _amax_span."""
    for jr in tl.range(j0 // SUB * SUB, j1, SUB, num_stages=STAGES):
        j = jr + tl.arange(0, SUB)
        inside = (j >= j0) & (j < j1)
        held = inside & (j < held_end)
        x = tl.load(
            x_ptr + _offsets(o, j + src, sxo, sxg, INT64),
            mask=omask[:, None] & held[None, :],
            other=0.0,
        )
        y = _e4m3_bits(to_fp32(x, SOFT) * scale[:, None], SOFT)
        y = tl.where(held[None, :], y, tl.zeros_like(y))  # 0 also where the scale is NaN
        tl.store(
            data_ptr + _offsets(o, j, sdo, sdg, INT64), y, mask=omask[:, None] & inside[None, :]
        )


@triton.jit
def _amax_kernel(
    x_ptr, offs_ptr, ws_ptr, n_other, extent, n_groups, sxb, sxo, sxg, n_strips,
    SOFT: tl.constexpr, INT64: tl.constexpr, BO: tl.constexpr, BL: tl.constexpr,
    SUB: tl.constexpr, BG: tl.constexpr, ALIGN: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """ws: int32 [batch, n_groups, n_other], zeroed: max of the amax bits of every tile.
    Grid: (cdiv(extent, BL) * n_strips, batch); neighbouring programs read neighbouring
    strips of the same rows."""
    t = tl.program_id(0)
    b = tl.program_id(1)
    x_ptr = _batch(x_ptr, b, sxb, INT64)
    ws_ptr = _batch_table(ws_ptr, b, n_groups, n_other, INT64)
    gi, valid, starts, ends = group_bounds(offs_ptr, n_groups, extent, BG)
    o = t % n_strips * BO + tl.arange(0, BO)
    omask = o < n_other
    lo = t // n_strips * BL
    hi = tl.minimum(lo + BL, extent)
    g_first = tl.sum((valid & (ends <= lo)).to(tl.int32), axis=0)
    g_end = tl.sum((valid & (starts < hi)).to(tl.int32), axis=0)
    for g in range(g_first, g_end):
        i0 = tl.maximum(_pick(gi, starts, g), lo)
        i1 = tl.minimum(_pick(gi, ends, g), hi)
        if (i0 % ALIGN == 0) & (i1 % ALIGN == 0):  # the same bounds, their alignment visible
            amax = _amax_span(x_ptr, o, omask, i0 // ALIGN * ALIGN, i1 // ALIGN * ALIGN,
                              sxo, sxg, SOFT, INT64, BO, SUB, STAGES)  # fmt: skip
        else:
            amax = _amax_span(x_ptr, o, omask, i0, i1, sxo, sxg, SOFT, INT64, BO, SUB, STAGES)
        row = tl.cast(g, tl.int64) * n_other if INT64 else g * n_other
        # (masks compare with a scalar bound: a scalar & a tensor trips the interpreter)
        tl.atomic_max(ws_ptr + row + o, amax, mask=o < tl.where(i1 > i0, n_other, 0), sem="relaxed")


@triton.jit
def _cast_kernel(
    x_ptr, offs_ptr, ws_ptr, scale_ptr, data_ptr, pad_ptr, n_other, extent, n_groups,
    dest_extent, sxb, sxo, sxg, sdb, sdo, sdg, n_strips, n_chunks,
    ROUND_POW2: tl.constexpr, SOFT: tl.constexpr, INT64: tl.constexpr, PAD: tl.constexpr,
    BO: tl.constexpr, BL: tl.constexpr, SUB: tl.constexpr, BG: tl.constexpr,
    ALIGN: tl.constexpr, STAGES: tl.constexpr, INVERSE: tl.constexpr,
):  # fmt: skip
    """data: uint8 e4m3 bits [batch, other, dest_extent] through strides (sdb, sdo, sdg), every
    index written; scale: fp32 [batch, n_groups, n_other] (INVERSE: their reciprocals); ws:
    the amax kernel's workspace; pad_ptr: int32 [n_groups] padded end offsets (PAD). Grid:
    (n_chunks * n_strips, batch), n_chunks = cdiv(dest_extent, BL). Tiles run last first:
    the rows the amax launch read last are the likeliest still in L2 (H200, kernel time with
    L2 flushed before each call, 4 rounds: the weights [16, 2048, 768] per column 44.7 ->
    42.1 us; (16640, 8192) at 1 / 16 / 64 groups and the large weights within 1%)."""
    t = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.num_programs(1) - 1 - tl.program_id(1)
    x_ptr = _batch(x_ptr, b, sxb, INT64)
    data_ptr = _batch(data_ptr, b, sdb, INT64)
    ws_ptr = _batch_table(ws_ptr, b, n_groups, n_other, INT64)
    scale_ptr = _batch_table(scale_ptr, b, n_groups, n_other, INT64)
    gi, valid, starts, ends = group_bounds(offs_ptr, n_groups, extent, BG)
    p, r = _destinations(gi, valid, starts, ends, n_groups, dest_extent, PAD)
    if PAD:
        tl.store(pad_ptr + gi, r, mask=gi < tl.where((t == 0) & (b == 0), n_groups, 0))
    o = t % n_strips * BO + tl.arange(0, BO)
    omask = o < n_other
    chunk = t // n_strips
    lo = chunk * BL
    hi = tl.minimum(lo + BL, dest_extent)
    # groups whose region meets [lo, hi), and those whose scales this tile writes (p in
    # [lo, hi), the last tile also those at the very end): p < hi' and not (r <= lo, p < lo)
    last = tl.where(chunk == n_chunks - 1, dest_extent + 1, lo + BL)
    g_first = tl.minimum(
        tl.sum((valid & (r <= lo)).to(tl.int32), axis=0),
        tl.sum((valid & (p < lo)).to(tl.int32), axis=0),
    )
    g_end = tl.sum((valid & (p < last)).to(tl.int32), axis=0)
    for g in range(g_first, g_end):
        pg = _pick(gi, p, g)
        sg = _pick(gi, starts, g)
        src = sg - pg  # source index = destination index + src
        rows = _pick(gi, ends, g) - sg  # destination indices [pg, pg + rows) hold rows
        row = tl.cast(g, tl.int64) * n_other if INT64 else g * n_other
        amax = tl.load(ws_ptr + row + o, mask=omask, other=0, cache_modifier=".cg")
        scale = _scales(amax, ROUND_POW2)
        tl.store(
            scale_ptr + row + o,
            _stored_scale(scale, INVERSE),
            mask=o < tl.where(pg >= lo, n_other, 0),
        )
        j0 = tl.maximum(pg, lo)
        j1 = tl.minimum(_pick(gi, r, g), hi)
        if (j0 % ALIGN == 0) & (j1 % ALIGN == 0):  # the same bounds, their alignment visible
            _cast_span(x_ptr, data_ptr, o, omask, j0 // ALIGN * ALIGN, j1 // ALIGN * ALIGN,
                       pg + rows, src, scale, sxo, sxg, sdo, sdg, SOFT, INT64, SUB,
                       STAGES)  # fmt: skip
        else:
            _cast_span(x_ptr, data_ptr, o, omask, j0, j1, pg + rows, src, scale,
                       sxo, sxg, sdo, sdg, SOFT, INT64, SUB, STAGES)  # fmt: skip
