"""FP8 e4m3 copies of jagged MoE tensors with one fp32 scale per (group, column) or
(group, row), for FP8-rowwise grouped GEMMs.

Scales are multipliers: scale = 448 / max(amax, 1e-12), amax in the input dtype, the
division in float64 rounded to float32 (optionally rounded down to a power of two);
data = clamp(x * scale, -448, 448) in fp32, cast to e4m3 (NaN stays NaN). An empty group
gets scale fp32(448 / 1e-12).

Layers: Triton kernels (``_row_block_kernel`` for rowwise, ``_group_item_kernel`` for
colwise) -> launcher -> custom op
-> ``per_group_colwise_scales`` / ``per_group_rowwise_scales``. ``*_reference`` loop over
groups in plain torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _config
from ._common import resolve_backend, sm_count
from ._jit_math import fp32_to_e4m3_bits, to_fp32

EPS = 1e-12
SCALE_AT_EPS = tl.constexpr(
    float(torch.tensor(448.0 / EPS, dtype=torch.float32))
)  # fp32(448 / 1e-12)
_METHODS = ("auto", "direct", "transpose")
INT64_FROM = 2**31  # the rowwise kernel uses 64-bit element offsets from this extent up
MAX_ROW_BLOCK = 1024  # rows per rowwise item at most (each value compiles its own kernel)

# ---------------------------------------------------------------------------- reference


def scales_from_amax(amax: torch.Tensor, round_scales_to_power_of_2: bool) -> torch.Tensor:
    """fp32 scales 448 / max(amax, 1e-12) (float64 division), optionally rounded down to a
    power of two (by the exponent, so exact)."""
    s = (448.0 / amax.double().clamp(min=EPS)).float()
    if round_scales_to_power_of_2:
        _, e = torch.frexp(s)
        s = torch.where(s.isnan() | (s == 0), s, torch.ldexp(torch.ones_like(s), e - 1))
    return s


def _to_e4m3(y: torch.Tensor) -> torch.Tensor:
    y = torch.where(y.isnan(), float("nan"), y.clamp(-448.0, 448.0))  # canonical NaN
    return y.to(torch.float8_e4m3fn)


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends, strict=True))


def per_group_colwise_reference(
    x: torch.Tensor, offs: torch.Tensor, round_scales_to_power_of_2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loop over groups of rows: x (M, K), offs int32 [G] -> (e4m3 (M, K), fp32 (G, K))."""
    data = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = []
    for lo, hi in _bounds(offs):
        part = x[lo:hi]
        amax = part.abs().amax(0) if hi > lo else x.new_zeros(x.shape[1])
        s = scales_from_amax(amax.float(), round_scales_to_power_of_2)
        data[lo:hi] = _to_e4m3(part.float() * s)
        scales.append(s)
    return data, torch.stack(scales) if scales else x.new_zeros(
        (0, x.shape[1]), dtype=torch.float32
    )


def per_group_rowwise_reference(
    x: torch.Tensor, offs: torch.Tensor, round_scales_to_power_of_2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loop over groups of columns: x (N, M), offs int32 [G] -> (e4m3 (N, M), fp32 (G, N))."""
    data, scales = per_group_colwise_reference(x.t(), offs, round_scales_to_power_of_2)
    return data.t(), scales


# ---------------------------------------------------------------------------- kernels
#
# Both kernels see x as [other, group] through strides: the "group" axis is the one ``offs``
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
    gives NaN). Below the clamp it is that constant; above, the correctly rounded fp32
    division equals the fp64 quotient rounded to fp32 (double rounding through 53 bits is
    exact for a quotient of 24-bit numbers, as 53 >= 2 * 24 + 2)."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    small = amax.to(tl.float64) < 1e-12
    scale = tl.where(
        small, SCALE_AT_EPS, tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax)
    )
    if ROUND_POW2:
        keep = (scale.to(tl.int32, bitcast=True) >> 23) << 23  # sign and exponent only
        scale = tl.where(scale != scale, scale, keep.to(tl.float32, bitcast=True))
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
def _row_block_kernel(
    x_ptr, offs_ptr, scale_ptr, data_ptr, n_other, extent, n_groups, sxo, sxg, sdo, sdg,
    ROUND_POW2: tl.constexpr, SOFT: tl.constexpr, INT64: tl.constexpr, ALIGN: tl.constexpr,
    BLOCK: tl.constexpr, TILE: tl.constexpr, MIN_GROUP: tl.constexpr, N_CLASSES: tl.constexpr,
):  # fmt: skip
    """x: [other, group] through strides (sxo, sxg); data (uint8 e4m3 bits) likewise through
    (sdo, sdg); offs: int32 [n_groups] end offsets along the group axis (length ``extent``);
    scale: fp32 [n_groups, n_other]. Grid: cdiv(n_other, BLOCK) * n_groups programs.

    Program t handles other-axis block t // n_groups of BLOCK indices and group t % n_groups
    (neighbouring programs read neighbouring groups of the same rows). Bounds are clamped to
    [previous end, extent], so bad offsets cannot reach outside x or data. A group's tiles
    start at its start rounded down to ALIGN; groups whose bounds are multiples of ALIGN get
    their own copy of the code, in which the compiler sees that alignment and moves whole
    vectors."""
    t = tl.program_id(0)
    g = t % n_groups
    o_start = t // n_groups * BLOCK
    start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
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


# ---------------------------------------------------------------------------- colwise kernel
#
# Colwise (groups along the rows of a row-major x) with work items (group, tile): a program
# takes one item and keeps a tile of TILE elements in registers, so x is read once: the tile
# spans the whole group along the group axis (the power of two >= the group's extent, at
# least MIN_GROUP: its size class) and TILE / that along the other axis. Groups longer than
# the largest class fall to a loop over the group in [LOOP_OTHER, LOOP_GROUP] tiles: an amax
# pass, then a second read for the data. (The row-block kernel above measured slower for
# this layout at 16 and 64 groups on an H200, BENCHMARKS.md.)


@triton.jit
def _load_tile(x_ptr, o, i, mask, sxo, sxg, SOFT: tl.constexpr):
    ptrs = x_ptr + o[:, None].to(tl.int64) * sxo + i[None, :].to(tl.int64) * sxg
    return to_fp32(tl.load(ptrs, mask=mask, other=0.0), SOFT)


@triton.jit
def _store_tile(data_ptr, o, i, mask, y, sdo, sdg, SOFT: tl.constexpr):
    ptrs = data_ptr + o[:, None].to(tl.int64) * sdo + i[None, :].to(tl.int64) * sdg
    tl.store(ptrs, _e4m3_bits(y, SOFT), mask=mask)


@triton.jit
def _group_tile(
    x_ptr, scale_ptr, data_ptr, g, lo, start, end, o0, n_other, sxo, sxg, sdo, sdg,
    ROUND_POW2: tl.constexpr, SOFT: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """The whole group [start, end) (a tile from lo <= start) for BLOCK_O indices of the
    other axis, one read."""
    o = o0 + tl.arange(0, BLOCK_O)
    i = lo + tl.arange(0, BLOCK_G)
    omask = o < n_other
    mask = omask[:, None] & ((i >= start) & (i < end))[None, :]
    x = _load_tile(x_ptr, o, i, mask, sxo, sxg, SOFT)
    scale = _scales(tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1), ROUND_POW2)
    tl.store(scale_ptr + g * n_other + o, scale, mask=omask)
    _store_tile(data_ptr, o, i, mask, x * scale[:, None], sdo, sdg, SOFT)


@triton.jit
def _group_loop(
    x_ptr, scale_ptr, data_ptr, g, lo, start, end, o0, n_other, sxo, sxg, sdo, sdg,
    ROUND_POW2: tl.constexpr, SOFT: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """Same result for groups too long for one tile: amax pass, then the data pass."""
    o = o0 + tl.arange(0, BLOCK_O)
    omask = o < n_other
    amax = tl.zeros((BLOCK_O,), dtype=tl.int32)
    for s in range(lo, end, BLOCK_G):
        i = s + tl.arange(0, BLOCK_G)
        mask = omask[:, None] & ((i >= start) & (i < end))[None, :]
        x = _load_tile(x_ptr, o, i, mask, sxo, sxg, SOFT)
        amax = tl.maximum(amax, tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1))
    scale = _scales(amax, ROUND_POW2)
    tl.store(scale_ptr + g * n_other + o, scale, mask=omask)
    for s in range(lo, end, BLOCK_G):
        i = s + tl.arange(0, BLOCK_G)
        mask = omask[:, None] & ((i >= start) & (i < end))[None, :]
        x = _load_tile(x_ptr, o, i, mask, sxo, sxg, SOFT)
        _store_tile(data_ptr, o, i, mask, x * scale[:, None], sdo, sdg, SOFT)


@triton.jit
def _group_item_kernel(
    x_ptr, offs_ptr, scale_ptr, data_ptr, n_other, extent, n_groups, sxo, sxg, sdo, sdg,
    ROUND_POW2: tl.constexpr, SOFT: tl.constexpr, ALIGN: tl.constexpr, TILE: tl.constexpr,
    MIN_GROUP: tl.constexpr, N_CLASSES: tl.constexpr, LOOP_OTHER: tl.constexpr,
    LOOP_GROUP: tl.constexpr, BLOCK_GROUPS: tl.constexpr,
):  # fmt: skip
    """x: [other, group] through strides (sxo, sxg); data (uint8 e4m3 bits) likewise through
    (sdo, sdg); offs: int32 [n_groups] end offsets along the group axis (length ``extent``);
    scale: fp32 [n_groups, n_other].

    Work items are (group, tile) pairs ordered by group; programs stride over them. A group's
    tiles start at its start rounded down to ALIGN; its class c is the
    smallest with span <= MIN_GROUP << c, giving cdiv(n_other, TILE // (MIN_GROUP << c))
    tiles, or cdiv(n_other, LOOP_OTHER) for longer groups. Offsets are clamped to
    [previous end, extent], so bad offsets cannot reach outside x or data."""
    gi = tl.arange(0, BLOCK_GROUPS)
    valid = gi < n_groups
    ends = tl.minimum(tl.maximum(tl.load(offs_ptr + gi, mask=valid, other=0), 0), extent)
    starts = tl.load(offs_ptr + gi - 1, mask=valid & (gi > 0), other=0)
    starts = tl.minimum(tl.maximum(starts, 0), extent)
    ends = tl.maximum(ends, starts)
    los = starts // ALIGN * ALIGN
    cls = tl.zeros((BLOCK_GROUPS,), dtype=tl.int32)
    for j in tl.static_range(N_CLASSES):
        cls += (ends - los > (MIN_GROUP << j)).to(tl.int32)
    per_tile = tl.where(cls < N_CLASSES, (TILE // MIN_GROUP) >> cls, LOOP_OTHER)
    tiles = tl.where(valid, (n_other + per_tile - 1) // per_tile, 0)
    before = tl.cumsum(tiles, 0) - tiles
    for item in range(tl.program_id(0), tl.sum(tiles, axis=0), tl.num_programs(0)):
        g = tl.sum((before + tiles <= item).to(tl.int32), axis=0)
        mine = gi == g
        t = item - tl.sum(tl.where(mine, before, 0), axis=0)
        c = tl.sum(tl.where(mine, cls, 0), axis=0)
        lo = tl.sum(tl.where(mine, los, 0), axis=0) // ALIGN * ALIGN  # tells the compiler
        start = tl.sum(tl.where(mine, starts, 0), axis=0)
        end = tl.sum(tl.where(mine, ends, 0), axis=0)
        for k in tl.static_range(N_CLASSES):
            if c == k:
                bo: tl.constexpr = TILE // (MIN_GROUP << k)
                if ALIGN == 1:
                    _group_tile(
                        x_ptr, scale_ptr, data_ptr, g, lo, start, end, t * bo, n_other,
                        sxo, sxg, sdo, sdg, ROUND_POW2, SOFT, bo, MIN_GROUP << k,
                    )  # fmt: skip
                elif (start % ALIGN == 0) & (end % ALIGN == 0):  # whole vectors: loads and
                    a0 = start // ALIGN * ALIGN  # stores vectorize once the compiler
                    a1 = end // ALIGN * ALIGN  # sees the alignment
                    _group_tile(
                        x_ptr, scale_ptr, data_ptr, g, a0, a0, a1, t * bo, n_other,
                        sxo, sxg, sdo, sdg, ROUND_POW2, SOFT, bo, MIN_GROUP << k,
                    )  # fmt: skip
                else:
                    _group_tile(
                        x_ptr, scale_ptr, data_ptr, g, lo, start, end, t * bo, n_other,
                        sxo, sxg, sdo, sdg, ROUND_POW2, SOFT, bo, MIN_GROUP << k,
                    )  # fmt: skip
        if c == N_CLASSES:
            _group_loop(
                x_ptr, scale_ptr, data_ptr, g, lo, start, end, t * LOOP_OTHER, n_other,
                sxo, sxg, sdo, sdg, ROUND_POW2, SOFT, BLOCK_O=LOOP_OTHER, BLOCK_G=LOOP_GROUP,
            )  # fmt: skip


# ---------------------------------------------------------------------------- launchers


def _row_block(tiling: _config.RowBlockTiling, n_other: int, extent: int, n_groups: int) -> int:
    """Other-axis indices per item of the row-block kernel: a power of two near
    tiling.item / (average group width), at most next_power_of_2(n_other) and MAX_ROW_BLOCK."""
    want = tiling.item // max(1, extent // n_groups)
    return min(triton.next_power_of_2(max(1, want)), triton.next_power_of_2(n_other), MAX_ROW_BLOCK)


def _extent(t: torch.Tensor) -> int:
    """One past the largest element offset of t."""
    return sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1


def _per_group_triton(
    x: torch.Tensor, offs: torch.Tensor, pow2: bool, group_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups along ``group_dim``: data e4m3 shaped like x (row-major), scales fp32
    (G, x.shape[1 - group_dim]). No host synchronization."""
    g = offs.numel()
    soft = x.device.type == "cpu"
    other_dim = 1 - group_dim
    n_other = x.shape[other_dim]
    scales = torch.empty((g, n_other), dtype=torch.float32, device=x.device)
    data = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    if not (g and n_other):
        return data.view(torch.float8_e4m3fn), scales
    int64 = max(_extent(x), data.numel(), scales.numel()) >= INT64_FROM
    strides = (
        x.stride(other_dim),
        x.stride(group_dim),
        data.stride(other_dim),
        data.stride(group_dim),
    )
    if group_dim == 1:
        t = _config.per_group_tiling(1, interpreted=soft)
        block = _row_block(t, n_other, x.shape[1], g)
        _row_block_kernel[(triton.cdiv(n_other, block) * g,)](
            x, offs, scales, data, n_other, x.shape[1], g, *strides,
            ROUND_POW2=pow2, SOFT=soft, INT64=int64, ALIGN=16 if x.stride(1) == 1 else 1,
            BLOCK=block, TILE=t.tile, MIN_GROUP=t.min_group, N_CLASSES=t.n_classes,
            num_warps=t.num_warps, **({"maxnreg": t.maxnreg} if t.maxnreg and not soft else {}),
        )  # fmt: skip
    else:
        c = _config.per_group_tiling(0, interpreted=soft)
        programs = 4 if soft else sm_count(x.device) * c.programs_per_sm  # persistent
        _group_item_kernel[(programs,)](
            x, offs, scales, data, n_other, x.shape[0], g, *strides,
            ROUND_POW2=pow2, SOFT=soft, ALIGN=16 if x.stride(0) == 1 else 1,
            TILE=c.tile, MIN_GROUP=c.min_group, N_CLASSES=c.n_classes,
            LOOP_OTHER=c.loop_other, LOOP_GROUP=c.loop_group,
            BLOCK_GROUPS=max(2, triton.next_power_of_2(g)), num_warps=c.num_warps,
        )  # fmt: skip
    return data.view(torch.float8_e4m3fn), scales


@torch.library.custom_op("mxfp8_a2a::per_group_scales", mutates_args=())
def _per_group_op(
    x: torch.Tensor, offs: torch.Tensor, pow2: bool, group_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return _per_group_triton(x, offs, pow2, group_dim)


@_per_group_op.register_fake
def _(x, offs, pow2, group_dim):
    scales = x.new_empty((offs.numel(), x.shape[1 - group_dim]), dtype=torch.float32)
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), scales


# ---------------------------------------------------------------------------- public


def _check(x: torch.Tensor, offs: torch.Tensor, dim: int, backend: str, validate: bool) -> str:
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"x must be bfloat16 or float32, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got shape {tuple(x.shape)}")
    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or offs.dim() != 1:
        raise TypeError("offs must be a 1-D int32 tensor of group end offsets")
    if offs.device != x.device:
        raise ValueError(f"offs ({offs.device}) must be on x's device ({x.device})")
    if validate:
        _check_values(offs, x.shape[dim], dim)
    return resolve_backend(backend, x.device, _row_block_kernel)


def _check_values(offs: torch.Tensor, extent: int, dim: int) -> None:
    """Non-decreasing, >= 0, last == extent. Reads offs on the host (one synchronization)."""
    host = offs.tolist()
    if any(b < a for a, b in zip([0] + host[:-1], host, strict=True)):
        raise ValueError(f"offs must be non-decreasing and >= 0, got {host}")
    if (host[-1] if host else 0) != extent:
        raise ValueError(
            f"offs[-1] must equal x.shape[{dim}] = {extent} (groups cover every index), "
            f"got {host[-1] if host else 'no groups'}"
        )


def per_group_colwise_scales(
    x: torch.Tensor,
    offs: torch.Tensor,
    *,
    round_scales_to_power_of_2: bool = False,
    backend: str = "auto",
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 copy of x (M, K) with one scale per (group of rows, column).

    Args:
        x: bfloat16 or float32 (M, K), any strides.
        offs: int32 [G] group end offsets along dim 0, non-decreasing, offs[-1] == M.
        round_scales_to_power_of_2: round each scale down to a power of two.
        backend: "auto" (Triton on CUDA, torch on CPU), "triton", "torch".
        validate: check the values of offs (non-decreasing, offs[-1] == x.shape[0]) with a
            clear error; reads offs on the host, one synchronization. With False nothing
            synchronizes (for hot loops and CUDA graphs); the kernel then clamps offsets
            into range, so bad ones give wrong groups but no out-of-bounds access.
    Returns:
        data float8_e4m3fn (M, K) row-major; scales float32 (G, K).
    """
    if _check(x, offs, 0, backend, validate) == "torch":
        return per_group_colwise_reference(x, offs, round_scales_to_power_of_2)
    return _per_group_op(x, offs, round_scales_to_power_of_2, 0)


def per_group_rowwise_scales(
    x: torch.Tensor,
    offs: torch.Tensor,
    *,
    round_scales_to_power_of_2: bool = False,
    backend: str = "auto",
    method: str = "auto",
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 copy of x (N, M) with one scale per (group of columns, row).

    Args:
        x: bfloat16 or float32 (N, M); offs: int32 [G] end offsets along dim 1.
        method: "direct" (one kernel over the row-major tensor), "transpose" (colwise
            scales on a column-major copy, data transposed back) or "auto" ("direct",
            the faster on H200, see BENCHMARKS.md).
        validate: check the values of offs (non-decreasing, offs[-1] == x.shape[1]) with a
            clear error; reads offs on the host, one synchronization. With False nothing
            synchronizes (for hot loops and CUDA graphs); the kernel then clamps offsets
            into range, so bad ones give wrong groups but no out-of-bounds access.
    Returns:
        data float8_e4m3fn (N, M) (column-major storage for "transpose"); scales float32 (G, N).
    """
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    if _check(x, offs, 1, backend, validate) == "torch":
        return per_group_rowwise_reference(x, offs, round_scales_to_power_of_2)
    if method == "transpose":
        data, scales = _per_group_op(x.t().contiguous(), offs, round_scales_to_power_of_2, 0)
        return data.t(), scales
    return _per_group_op(x, offs, round_scales_to_power_of_2, 1)
