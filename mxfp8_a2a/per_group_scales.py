"""FP8 e4m3 copies of jagged MoE tensors with one fp32 scale per (group, column) or
(group, row), for FP8-rowwise grouped GEMMs.

Scales are multipliers: scale = 448 / max(amax, 1e-12), amax in the input dtype, the
division in float64 rounded to float32 (optionally rounded down to a power of two);
data = clamp(x * scale, -448, 448) in fp32, cast to e4m3 (NaN stays NaN). An empty group
gets scale fp32(448 / 1e-12).

Layers: Triton kernels (``_colwise_amax_kernel`` + ``_colwise_quantize_kernel``, and
``_rowwise_kernel``) -> launchers -> custom ops -> ``per_group_colwise_scales`` /
``per_group_rowwise_scales``. ``*_reference`` loop over groups in plain torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _config
from ._common import interpreted
from ._jit_math import fp32_to_e4m3_bits, to_fp32

EPS = 1e-12
_BACKENDS = ("auto", "triton", "torch")
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


@triton.jit
def _group_start(offs_ptr, g):
    return tl.load(offs_ptr + g - 1, mask=g > 0, other=0)


@triton.jit
def _first_group(offs_ptr, n_groups, row, BLOCK_GROUPS: tl.constexpr):
    """Index of the group holding ``row``: the number of groups ending at or before it."""
    gi = tl.arange(0, BLOCK_GROUPS)
    ends = tl.load(offs_ptr + gi, mask=gi < n_groups, other=2147483647)
    return tl.sum((ends <= row).to(tl.int32), axis=0)


@triton.jit
def _colwise_amax_kernel(
    x_ptr, offs_ptr, amax_ptr, m, k, n_groups, stride_xm, stride_xk,
    SOFT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_GROUPS: tl.constexpr,
):  # fmt: skip
    """amax_ptr: int32 [G, K] zeros in, |x| bits max per (group, column) out (atomic max)."""
    r0 = tl.program_id(0) * BLOCK_M
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = r0 + tl.arange(0, BLOCK_M)
    cmask = cols < k
    x = tl.load(
        x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :] * stride_xk,
        mask=(rows < m)[:, None] & cmask[None, :],
        other=0.0,
    )
    bits = to_fp32(x, SOFT).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    g = _first_group(offs_ptr, n_groups, r0, BLOCK_GROUPS)
    start = _group_start(offs_ptr, g)
    r1 = tl.minimum(r0 + BLOCK_M, m)
    while (g < n_groups) & (start < r1):
        end = tl.load(offs_ptr + g)
        inside = (rows >= start) & (rows < end)
        col_max = tl.max(tl.where(inside[:, None], bits, 0), axis=0)
        tl.atomic_max(amax_ptr + g * k + cols, col_max, mask=cmask)  # empty groups add 0
        g += 1
        start = end


@triton.jit
def _colwise_quantize_kernel(
    x_ptr, offs_ptr, scale_ptr, data_ptr, m, k, n_groups, stride_xm, stride_xk,
    SOFT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_GROUPS: tl.constexpr,
):  # fmt: skip
    """data (uint8 [M, K] row-major) = e4m3(clamp(x * scale[group(row), col]))."""
    r0 = tl.program_id(0) * BLOCK_M
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = r0 + tl.arange(0, BLOCK_M)
    cmask = cols < k
    mask = (rows < m)[:, None] & cmask[None, :]
    x = to_fp32(
        tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :] * stride_xk, mask=mask
        ),
        SOFT,
    )
    scale = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    g = _first_group(offs_ptr, n_groups, r0, BLOCK_GROUPS)
    start = _group_start(offs_ptr, g)
    r1 = tl.minimum(r0 + BLOCK_M, m)
    while (g < n_groups) & (start < r1):
        end = tl.load(offs_ptr + g)
        s = tl.load(scale_ptr + g * k + cols, mask=cmask, other=0.0)
        inside = (rows >= start) & (rows < end)
        scale = tl.where(inside[:, None], s[None, :], scale)
        g += 1
        start = end
    y = _clamp_nan(x * scale)
    tl.store(
        data_ptr + rows[:, None].to(tl.int64) * k + cols[None, :],
        fp32_to_e4m3_bits(y, SOFT),
        mask=mask,
    )


@triton.jit
def _clamp_nan(y):
    """clamp to +-448 keeping NaN (canonical, positive) where torch.clamp keeps it."""
    y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))
    return tl.where(y != y, float("nan"), y)


@triton.jit
def _rowwise_kernel(
    x_ptr, offs_ptr, scale_ptr, data_ptr, n, m, stride_xn, stride_xm,
    ROUND_POW2: tl.constexpr, SOFT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Program (row block, group): amax of each row over the group's columns, the scale,
    then the e4m3 data of those columns (a second pass over the same bytes, from cache)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1)
    start = _group_start(offs_ptr, g)
    end = tl.load(offs_ptr + g)
    rmask = rows < n
    row_off = rows[:, None].to(tl.int64) * stride_xn
    amax = tl.zeros((BLOCK_N,), dtype=tl.int32)
    for c0 in range(start, end, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = rmask[:, None] & (cols < end)[None, :]
        x = tl.load(x_ptr + row_off + cols[None, :] * stride_xm, mask=mask, other=0.0)
        bits = to_fp32(x, SOFT).to(tl.int32, bitcast=True) & 0x7FFFFFFF
        amax = tl.maximum(amax, tl.max(bits, axis=1))
    a = amax.to(tl.float32, bitcast=True).to(tl.float64)
    eps = tl.full((BLOCK_N,), 1e-12, tl.float64)
    scale = (448.0 / tl.where(a < eps, eps, a)).to(tl.float32)
    if ROUND_POW2:
        keep = (scale.to(tl.int32, bitcast=True) >> 23) << 23  # sign and exponent only
        rounded = keep.to(tl.float32, bitcast=True)
        scale = tl.where(scale != scale, scale, rounded)
    tl.store(scale_ptr + g * n + rows, scale, mask=rmask)
    for c0 in range(start, end, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = rmask[:, None] & (cols < end)[None, :]
        x = to_fp32(tl.load(x_ptr + row_off + cols[None, :] * stride_xm, mask=mask), SOFT)
        y = _clamp_nan(x * scale[:, None])
        dst = data_ptr + rows[:, None].to(tl.int64) * m + cols[None, :]
        tl.store(dst, fp32_to_e4m3_bits(y, SOFT), mask=mask)


# ---------------------------------------------------------------------------- launchers


def _colwise_triton(
    x: torch.Tensor, offs: torch.Tensor, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    g = offs.numel()
    soft = x.device.type == "cpu"
    amax = torch.zeros((g, k), dtype=torch.int32, device=x.device)
    data = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    bm, bk = (
        _config.INTERPRET_COLWISE if soft else (_config.COLWISE_BLOCK_M, _config.COLWISE_BLOCK_K)
    )
    grid = (triton.cdiv(m, bm), triton.cdiv(k, bk))
    common = dict(SOFT=soft, BLOCK_M=bm, BLOCK_K=bk, BLOCK_GROUPS=triton.next_power_of_2(max(g, 1)))
    if m and k and g:
        _colwise_amax_kernel[grid](x, offs, amax, m, k, g, x.stride(0), x.stride(1), **common)
    scales = scales_from_amax(amax.view(torch.float32), pow2)
    if m and k and g:
        _colwise_quantize_kernel[grid](
            x, offs, scales, data, m, k, g, x.stride(0), x.stride(1), **common
        )
    return data.view(torch.float8_e4m3fn), scales


def _rowwise_direct_triton(
    x: torch.Tensor, offs: torch.Tensor, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    n, m = x.shape
    g = offs.numel()
    soft = x.device.type == "cpu"
    scales = torch.empty((g, n), dtype=torch.float32, device=x.device)
    data = torch.empty((n, m), dtype=torch.uint8, device=x.device)
    bn, bc = (
        _config.INTERPRET_ROWWISE if soft else (_config.ROWWISE_BLOCK_N, _config.ROWWISE_BLOCK_C)
    )
    if n and g:
        _rowwise_kernel[(triton.cdiv(n, bn), g)](
            x, offs, scales, data, n, m, x.stride(0), x.stride(1),
            ROUND_POW2=pow2, SOFT=soft, BLOCK_N=bn, BLOCK_C=bc, num_warps=_config.ROWWISE_NUM_WARPS,
        )  # fmt: skip
    return data.view(torch.float8_e4m3fn), scales


@torch.library.custom_op("mxfp8_a2a::per_group_colwise", mutates_args=())
def _colwise_op(
    x: torch.Tensor, offs: torch.Tensor, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _colwise_triton(x, offs, pow2)


@_colwise_op.register_fake
def _(x, offs, pow2):
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty(
        (offs.numel(), x.shape[1]), dtype=torch.float32
    )


@torch.library.custom_op("mxfp8_a2a::per_group_rowwise_direct", mutates_args=())
def _rowwise_op(
    x: torch.Tensor, offs: torch.Tensor, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rowwise_direct_triton(x, offs, pow2)


@_rowwise_op.register_fake
def _(x, offs, pow2):
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty(
        (offs.numel(), x.shape[0]), dtype=torch.float32
    )


# ---------------------------------------------------------------------------- public


def _check(x: torch.Tensor, offs: torch.Tensor, dim: int, backend: str) -> str:
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"x must be bfloat16 or float32, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got shape {tuple(x.shape)}")
    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or offs.dim() != 1:
        raise TypeError("offs must be a 1-D int32 tensor of group end offsets")
    if offs.device != x.device:
        raise ValueError(f"offs ({offs.device}) must be on x's device ({x.device})")
    host = offs.tolist()  # one small host sync; wrong offsets would read out of bounds
    if any(b < a for a, b in zip([0] + host[:-1], host, strict=True)):
        raise ValueError(f"offs must be non-decreasing and >= 0, got {host}")
    if (host[-1] if host else 0) != x.shape[dim]:
        raise ValueError(
            f"offs[-1] must equal x.shape[{dim}] = {x.shape[dim]} (groups cover every index), "
            f"got {host[-1] if host else 'no groups'}"
        )
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if x.device.type == "cuda" else "torch"
    if backend == "triton" and x.device.type == "cpu" and not interpreted(_rowwise_kernel):
        raise RuntimeError(
            "backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before import"
        )
    return backend


def per_group_colwise_scales(
    x: torch.Tensor,
    offs: torch.Tensor,
    *,
    round_scales_to_power_of_2: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 copy of x (M, K) with one scale per (group of rows, column).

    Args:
        x: bfloat16 or float32 (M, K), any strides.
        offs: int32 [G] group end offsets along dim 0, non-decreasing, offs[-1] == M.
        round_scales_to_power_of_2: round each scale down to a power of two.
        backend: "auto" (Triton on CUDA, torch on CPU), "triton", "torch".
    Returns:
        data float8_e4m3fn (M, K) row-major; scales float32 (G, K).
    """
    if _check(x, offs, 0, backend) == "torch":
        return per_group_colwise_reference(x, offs, round_scales_to_power_of_2)
    return _colwise_op(x, offs, round_scales_to_power_of_2)


def per_group_rowwise_scales(
    x: torch.Tensor,
    offs: torch.Tensor,
    *,
    round_scales_to_power_of_2: bool = False,
    backend: str = "auto",
    method: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 copy of x (N, M) with one scale per (group of columns, row).

    Args:
        x: bfloat16 or float32 (N, M); offs: int32 [G] end offsets along dim 1.
        method: "direct" (one kernel over the row-major tensor), "transpose" (colwise
            scales on a column-major copy, data transposed back) or "auto" ("direct",
            the faster on H200, see BENCHMARKS.md).
    Returns:
        data float8_e4m3fn (N, M) (column-major storage for "transpose"); scales float32 (G, N).
    """
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    if _check(x, offs, 1, backend) == "torch":
        return per_group_rowwise_reference(x, offs, round_scales_to_power_of_2)
    if method == "transpose":
        data, scales = _colwise_op(x.t().contiguous(), offs, round_scales_to_power_of_2)
        return data.t(), scales
    return _rowwise_op(x, offs, round_scales_to_power_of_2)
