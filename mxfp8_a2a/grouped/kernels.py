"""Triton kernels of the per-group FP8 scaling, rowwise: the row-block kernel (groups along
the contiguous axis of x and of the data), and the helpers it shares with the colwise
kernels (kernels_colwise.py). See per_group_scales.py for the launchers and reference.py for the
definition they match."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.bits import fp32_to_e4m3_bits, to_fp32
from .reference import EPS

SCALE_AT_EPS = tl.constexpr(
    float(torch.tensor(448.0 / EPS, dtype=torch.float32))
)  # fp32(448 / 1e-12)
_EPS32 = torch.tensor(EPS, dtype=torch.float32)  # the fp32 nearest 1e-12 (below it)
if _EPS32.double() < EPS:
    _EPS32 = torch.nextafter(_EPS32, torch.tensor(1.0))
EPS_BITS = tl.constexpr(int(_EPS32.view(torch.int32)))  # amax < 1e-12 <=> bits below this


# ---------------------------------------------------------------------------- kernels
#
# The kernels see x as [other, group] through strides: the "group" axis is the one ``offs``
# cuts (columns for rowwise, rows for colwise), the "other" axis has one scale per index.
#
# Rowwise (``_row_block_kernel``, groups along the contiguous axis): one program per work item
# (block of BLOCK indices of the other axis, group); the launcher sizes BLOCK so that an item
# holds about ``item`` elements for a group of average width, so there are many small programs
# and the GPU keeps many tiles in flight. An item's tiles span the whole group along the group
# axis: the power of two >= the group's extent, at least MIN_GROUP (its "size class"), times
# TILE / that (at most BLOCK) along the other axis; each is loaded once, reduced and written.
# Groups wider than the largest class (MAX_CLASS) loop over tiles of TILE elements and at most
# TILE // MAX_CLASS rows: an amax pass, then a second pass over the same bytes, which an item
# keeps small enough to find in L2.


@triton.jit
def _scales(amax_bits, ROUND_POW2: tl.constexpr):
    """fp32 448 / max(amax, 1e-12) as the fp64 division rounded to fp32 gives it (NaN amax
    gives NaN), from the int32 bits of amax (>= 0). Below the clamp it is that constant;
    above, the correctly rounded fp32 division equals the fp64 quotient rounded to fp32
    (double rounding through 53 bits is exact for a quotient of 24-bit numbers, as
    53 >= 2 * 24 + 2)."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    small = amax_bits < EPS_BITS  # amax bits are never negative; NaN's are above inf's
    scale = tl.where(
        small, SCALE_AT_EPS, tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax)
    )
    if ROUND_POW2:
        keep = (scale.to(tl.int32, bitcast=True) >> 23) << 23  # sign and exponent only
        scale = tl.where(scale != scale, scale, keep.to(tl.float32, bitcast=True))
    return scale


@triton.jit
def _stored_scale(scale, INVERSE: tl.constexpr):
    """scale, or with INVERSE its reciprocal 1 / scale, correctly rounded (torch.reciprocal's
    value): the dequantization multiplier an FP8 GEMM takes, without a launch of its own."""
    if INVERSE:
        return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    return scale


@triton.jit
def _clamp_nan(y):
    """clamp to +-448 keeping NaN (canonical, positive) where torch.clamp keeps it."""
    y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))
    return tl.where(y != y, float("nan"), y)


@triton.jit
def _offsets(o, i, so, sg, INT64: tl.constexpr):
    """Element offsets [len(o), len(i)] of indices o (other axis) and i (group axis)."""
    if INT64:
        offsets = o[:, None].to(tl.int64) * so + i[None, :].to(tl.int64) * sg
    else:
        offsets = o[:, None] * so + i[None, :] * sg
    return offsets


@triton.jit
def _tile(o0, s, start, end, o_end, BLOCK_O: tl.constexpr, BLOCK_G: tl.constexpr):
    """Indices and mask of the tile [o0, o0 + BLOCK_O) x [s, s + BLOCK_G) of group [start, end),
    other-axis indices below o_end."""
    o = o0 + tl.arange(0, BLOCK_O)
    i = s + tl.arange(0, BLOCK_G)
    return o, i, (o < o_end)[:, None] & ((i >= start) & (i < end))[None, :]


@triton.jit
def _load(x_ptr, o, i, mask, sxo, sxg, INT64: tl.constexpr):
    """The tile in x's dtype (widened to fp32 where it is used)."""
    return tl.load(x_ptr + _offsets(o, i, sxo, sxg, INT64), mask=mask, other=0.0)


@triton.jit
def _amax_bits(x):
    return tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)


@triton.jit
def _e4m3_bits(y, SOFT: tl.constexpr):
    """e4m3 bits of clamp(y, -448, 448) (NaN stays NaN). On the GPU the conversion saturates
    (cvt.rn.satfinite), so the clamp is the instruction's own; the interpreter's integer
    rounding needs it spelled out."""
    if SOFT:
        y = _clamp_nan(y)
    return fp32_to_e4m3_bits(y, SOFT)


@triton.jit
def _store(data_ptr, o, i, mask, y, sdo, sdg, SOFT: tl.constexpr, INT64: tl.constexpr):
    tl.store(data_ptr + _offsets(o, i, sdo, sdg, INT64), _e4m3_bits(y, SOFT), mask=mask)


@triton.jit
def _store_scales(scale_ptr, g, o, o_end, n_other, scale, INT64: tl.constexpr):
    row = g.to(tl.int64) * n_other if INT64 else g * n_other
    tl.store(scale_ptr + row + o, scale, mask=o < o_end)


@triton.jit
def _group_block(
    x_ptr, scale_ptr, data_ptr, g, o_start, lo, start, end, n_other, sxo, sxg, sdo, sdg,
    ROUND_POW2: tl.constexpr, SOFT: tl.constexpr, INT64: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_O: tl.constexpr, BLOCK_G: tl.constexpr, LOOP: tl.constexpr,
):  # fmt: skip
    """Group [start, end) (tiles from lo <= start) for the BLOCK other-axis indices from
    o_start, in [BLOCK_O, BLOCK_G] tiles: one read each, or (LOOP) an amax pass along the
    group and then a second for the data."""
    o_end = tl.minimum(o_start + BLOCK, n_other)
    for o0 in range(o_start, o_end, BLOCK_O):
        if LOOP:
            amax = tl.zeros((BLOCK_O,), dtype=tl.int32)
            for s in range(lo, end, BLOCK_G):
                o, i, mask = _tile(o0, s, start, end, o_end, BLOCK_O, BLOCK_G)
                x = to_fp32(_load(x_ptr, o, i, mask, sxo, sxg, INT64), SOFT)
                amax = tl.maximum(amax, _amax_bits(x))
            scale = _scales(amax, ROUND_POW2)
            for s in range(lo, end, BLOCK_G):
                o, i, mask = _tile(o0, s, start, end, o_end, BLOCK_O, BLOCK_G)
                x = to_fp32(_load(x_ptr, o, i, mask, sxo, sxg, INT64), SOFT)
                _store(data_ptr, o, i, mask, x * scale[:, None], sdo, sdg, SOFT, INT64)
            _store_scales(scale_ptr, g, o0 + tl.arange(0, BLOCK_O), o_end, n_other, scale, INT64)
        else:
            o, i, mask = _tile(o0, lo, start, end, o_end, BLOCK_O, BLOCK_G)
            x = to_fp32(_load(x_ptr, o, i, mask, sxo, sxg, INT64), SOFT)
            scale = _scales(_amax_bits(x), ROUND_POW2)
            _store(data_ptr, o, i, mask, x * scale[:, None], sdo, sdg, SOFT, INT64)
            _store_scales(scale_ptr, g, o, o_end, n_other, scale, INT64)


@triton.jit
def _group_classes(
    x_ptr, scale_ptr, data_ptr, g, o_start, lo, start, end, n_other, sxo, sxg, sdo, sdg,
    ROUND_POW2: tl.constexpr, SOFT: tl.constexpr, INT64: tl.constexpr, BLOCK: tl.constexpr,
    TILE: tl.constexpr, MIN_GROUP: tl.constexpr, N_CLASSES: tl.constexpr,
):  # fmt: skip
    """The group's size class picks its tile (see the comment above the kernels); groups
    wider than the largest class loop over tiles of TILE elements, at most TILE // that
    class's width rows."""
    c = 0
    for j in tl.static_range(N_CLASSES):
        c += (end - lo > (MIN_GROUP << j)).to(tl.int32)
    for k in tl.static_range(N_CLASSES + 1):
        if c == k:
            rows: tl.constexpr = TILE // (MIN_GROUP << (k if k < N_CLASSES else N_CLASSES - 1))
            bo: tl.constexpr = BLOCK if rows > BLOCK else rows
            bg: tl.constexpr = TILE // bo if k == N_CLASSES else MIN_GROUP << k
            _group_block(
                x_ptr, scale_ptr, data_ptr, g, o_start, lo, start, end, n_other,
                sxo, sxg, sdo, sdg, ROUND_POW2, SOFT, INT64, BLOCK, bo, bg,
                LOOP=k == N_CLASSES,
            )  # fmt: skip


@triton.jit
def _zero_fill(data_ptr, o_start, o_end, i0, i1, sdo, sdg, INT64: tl.constexpr,
               BLOCK_O: tl.constexpr, BLOCK_G: tl.constexpr):  # fmt: skip
    """e4m3 zeros in [o_start, o_end) x [i0, i1) (indices no group covers)."""
    for o0 in range(o_start, o_end, BLOCK_O):
        for s in range(i0, i1, BLOCK_G):
            o, i, mask = _tile(o0, s, i0, i1, o_end, BLOCK_O, BLOCK_G)
            zero = tl.zeros((BLOCK_O, BLOCK_G), dtype=tl.uint8)
            tl.store(data_ptr + _offsets(o, i, sdo, sdg, INT64), zero, mask=mask)


@triton.jit
def _row_block_kernel(
    x_ptr, offs_ptr, scale_ptr, data_ptr, n_other, extent, n_groups, sxo, sxg, sdo, sdg,
    ROUND_POW2: tl.constexpr, SOFT: tl.constexpr, INT64: tl.constexpr, ALIGN: tl.constexpr,
    BLOCK: tl.constexpr, TILE: tl.constexpr, MIN_GROUP: tl.constexpr, N_CLASSES: tl.constexpr,
):  # fmt: skip
    """x: [other, group] through strides (sxo, sxg); data (uint8 e4m3 bits) likewise through
    (sdo, sdg); offs: int32 [n_groups] end offsets along the group axis (length ``extent``);
    scale: fp32 [n_groups, n_other]. Grid: cdiv(n_other, BLOCK) * n_groups programs.

    Program t handles other-axis block t // n_groups of BLOCK indices and group t % n_groups
    (neighbouring programs read neighbouring groups of the same rows). Offsets are clamped
    into [0, extent] and made non-decreasing (running maximum), as in reference.py, so bad
    ones cannot reach outside x or data; the last group's programs also write zeros past its
    end (indices no group covers). A group's tiles start at its start rounded down to ALIGN;
    groups whose bounds are multiples of ALIGN get their own copy of the code, in which the
    compiler sees that alignment and moves whole vectors."""
    t = tl.program_id(0)
    g = t % n_groups
    o_start = t // n_groups * BLOCK
    start = 0
    for j0 in range(0, g, 128):  # start: the running maximum of the offsets before g
        j = j0 + tl.arange(0, 128)
        start = tl.maximum(start, tl.max(tl.load(offs_ptr + j, mask=j < g, other=0), axis=0))
    start = tl.minimum(tl.maximum(start, 0), extent)
    end = tl.maximum(tl.minimum(tl.load(offs_ptr + g), extent), start)
    if ALIGN == 1:
        _group_classes(
            x_ptr, scale_ptr, data_ptr, g, o_start, start, start, end, n_other,
            sxo, sxg, sdo, sdg, ROUND_POW2, SOFT, INT64, BLOCK, TILE, MIN_GROUP, N_CLASSES,
        )  # fmt: skip
    elif (start % ALIGN == 0) & (end % ALIGN == 0):
        a0 = start // ALIGN * ALIGN  # the same values, in a form that shows the alignment
        a1 = end // ALIGN * ALIGN
        _group_classes(
            x_ptr, scale_ptr, data_ptr, g, o_start, a0, a0, a1, n_other,
            sxo, sxg, sdo, sdg, ROUND_POW2, SOFT, INT64, BLOCK, TILE, MIN_GROUP, N_CLASSES,
        )  # fmt: skip
    else:
        _group_classes(
            x_ptr, scale_ptr, data_ptr, g, o_start, start // ALIGN * ALIGN, start, end,
            n_other, sxo, sxg, sdo, sdg, ROUND_POW2, SOFT, INT64, BLOCK, TILE,
            MIN_GROUP, N_CLASSES,
        )  # fmt: skip
    zo: tl.constexpr = BLOCK if BLOCK < 16 else 16
    if (g == n_groups - 1) & (end < extent):
        _zero_fill(
            data_ptr, o_start, tl.minimum(o_start + BLOCK, n_other), end, extent, sdo, sdg,
            INT64, zo, TILE // zo,
        )  # fmt: skip
