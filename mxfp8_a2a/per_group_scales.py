"""FP8 e4m3 copies of jagged MoE tensors with one fp32 scale per (group, column) or
(group, row), for FP8-rowwise grouped GEMMs.

Scales are multipliers: scale = 448 / max(amax, 1e-12), amax in the input dtype, the
division in float64 rounded to float32 (optionally rounded down to a power of two);
data = clamp(x * scale, -448, 448) in fp32, cast to e4m3 (NaN stays NaN). An empty group
gets scale fp32(448 / 1e-12).

Layers: one Triton kernel (``_per_group_kernel``, both layouts) -> launcher -> custom op
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
_METHODS = ("auto", "direct", "transpose")

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
# One kernel serves both layouts. Axes: the "group" axis (the one ``offs`` cuts: columns for
# rowwise, rows for colwise) and the "other" axis (one scale per index of it). A program
# takes one (group, tile) work item and keeps a tile of TILE elements in registers, so x is
# read from memory once: the tile spans the whole group along the group axis (the power of
# two >= the group's extent, at least MIN_GROUP: its "size class") and TILE / that along
# the other axis. Groups longer than the largest class fall to a loop over the group in
# [LOOP_OTHER, LOOP_GROUP] tiles: an amax pass, then a second read for the data.


@triton.jit
def _scales(amax_bits, ROUND_POW2: tl.constexpr):
    """fp32 448 / max(amax, 1e-12) with the division in fp64 (NaN amax gives NaN)."""
    a = amax_bits.to(tl.float32, bitcast=True).to(tl.float64)
    eps = tl.full(a.shape, 1e-12, tl.float64)
    scale = (448.0 / tl.where(a < eps, eps, a)).to(tl.float32)
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
def _load_tile(x_ptr, o, i, mask, sxo, sxg, SOFT: tl.constexpr):
    ptrs = x_ptr + o[:, None].to(tl.int64) * sxo + i[None, :].to(tl.int64) * sxg
    return to_fp32(tl.load(ptrs, mask=mask, other=0.0), SOFT)


@triton.jit
def _store_tile(data_ptr, o, i, mask, y, sdo, sdg, SOFT: tl.constexpr):
    ptrs = data_ptr + o[:, None].to(tl.int64) * sdo + i[None, :].to(tl.int64) * sdg
    tl.store(ptrs, fp32_to_e4m3_bits(_clamp_nan(y), SOFT), mask=mask)


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
def _per_group_kernel(
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


def _n_programs(device: torch.device, tiling: _config.GroupTiling) -> int:
    if device.type != "cuda":
        return 4  # the interpreter runs programs one after another
    return sm_count(device) * tiling.programs_per_sm


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
    if g and n_other:
        tiling = _config.per_group_tiling(group_dim, interpreted=soft)
        _per_group_kernel[(_n_programs(x.device, tiling),)](
            x, offs, scales, data, n_other, x.shape[group_dim], g,
            x.stride(other_dim), x.stride(group_dim),
            data.stride(other_dim), data.stride(group_dim),
            ROUND_POW2=pow2, SOFT=soft, ALIGN=16 if x.stride(group_dim) == 1 else 1,
            TILE=tiling.tile, MIN_GROUP=tiling.min_group, N_CLASSES=tiling.n_classes,
            LOOP_OTHER=tiling.loop_other, LOOP_GROUP=tiling.loop_group,
            BLOCK_GROUPS=max(2, triton.next_power_of_2(g)), num_warps=tiling.num_warps,
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
    return resolve_backend(backend, x.device, _per_group_kernel)


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
