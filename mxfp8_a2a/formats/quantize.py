"""MXFP8 quantize: reference, Triton kernel, custom ops and the public functions.

Layers: ``_quantize_kernel`` (Triton) -> ``_launch`` (checks, grid) -> custom ops
``mxfp8_a2a::quantize`` / ``mxfp8_a2a::quantize_packed`` -> ``quantize`` / ``quantize_packed``.
``quantize_reference`` is the plain-torch definition the kernel is tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _config
from .._common import (
    BLOCK,
    E4M3_MAX,
    as_rows,
    block_count,
    check_e4m3_gpu,
    check_float_input,
    check_scaling_mode,
    hw_e8m0,
    resolve_backend,
)
from .bits import block_tile, mx_quantize_blocks, skip_gap, to_fp32
from .launch import launch_tiles
from .packing import pack, packed_row_bytes

# ---------------------------------------------------------------------------- reference


def quantize_reference(
    x: torch.Tensor, scaling_mode: str = "rceil"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch MXFP8 quantize, the definition the kernels must match bit for bit.

    Args:
        x: bfloat16 or float32, shape [..., K], K % 32 == 0.
        scaling_mode: "rceil" or "floor".
    Returns:
        data: float8_e4m3fn [..., K]; scales: float8_e8m0fnu [..., K // 32].
    """
    k = check_float_input(x)
    check_scaling_mode(scaling_mode)
    xb = x.float().reshape(*x.shape[:-1], k // BLOCK, BLOCK)
    amax = xb.abs().amax(dim=-1)
    if scaling_mode == "rceil":
        # smallest power of two >= the fp32 quotient: its exponent field, plus one if any
        # mantissa bit is set; a subnormal quotient rounds up to 2^-127 (byte 0) or 2^-126
        q = (amax / E4M3_MAX).view(torch.int32)
        b = (q >> 23) + ((q & 0x7FFFFF) != 0).to(torch.int32)
        b = torch.where(q >> 23 == 0, (q > 0x400000).to(torch.int32), b)
    else:
        b = (amax.view(torch.int32) >> 23) - 8
    b = torch.where(amax.isinf(), 254, b.clamp(0, 254))  # inf -> the largest finite scale
    nan_block = amax.isnan()
    b = torch.where(nan_block, 255, b)
    mult = torch.exp2((127 - b).to(torch.float64)).to(torch.float32)
    y = (xb * mult.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    y = torch.where(nan_block.unsqueeze(-1), float("nan"), y)
    data = y.reshape(x.shape).to(torch.float8_e4m3fn)
    return data, b.to(torch.uint8).view(torch.float8_e8m0fnu)


# ---------------------------------------------------------------------------- kernel


@triton.jit
def _quantize_kernel(
    x_ptr,  # bf16/fp32 [M, K], strides (stride_xm, stride_xk)
    data_ptr,  # uint8, element (m, k) at m * stride_dm + k
    scale_ptr,  # uint8, block (m, g) at m * stride_sm + g
    n_groups,  # output rows * K // 32
    groups_per_row,  # K // 32
    gap_at,  # output row m reads row skip_gap(m, gap_at, gap_len) of x
    gap_len,
    stride_xm,
    stride_xk,
    stride_dm,
    stride_sm,
    RCEIL: tl.constexpr,
    BLOCK_G: tl.constexpr,
    SOFT: tl.constexpr,  # software float casts (interpreter)
    HW_E8M0: tl.constexpr,  # sm_100+: hardware e8m0 conversion
    INT64: tl.constexpr,  # offsets may pass 2**31
):
    n_tiles = tl.cdiv(n_groups, BLOCK_G)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        gmask, row, cg = block_tile(tile, BLOCK_G, n_groups, groups_per_row)
        in_row = skip_gap(row, gap_at, gap_len)
        col = cg[:, None] * 32 + tl.arange(0, 32)[None, :]
        if INT64:  # col too: col * stride_xk passes 2**31 for a column-strided x
            row = row.to(tl.int64)
            in_row = in_row.to(tl.int64)
            col = col.to(tl.int64)
        x = tl.load(x_ptr + in_row[:, None] * stride_xm + col * stride_xk, mask=gmask[:, None])
        q, b = mx_quantize_blocks(to_fp32(x, SOFT), RCEIL, HW_E8M0, SOFT)
        tl.store(data_ptr + row[:, None] * stride_dm + col, q, mask=gmask[:, None])
        tl.store(scale_ptr + row * stride_sm + cg, b.to(tl.uint8), mask=gmask)


def _needs_int64(*extents: int) -> bool:
    return max(extents, default=0) >= 2**31


def _launch(
    x2d: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    stride_dm: int,
    stride_sm: int,
    scaling_mode: str,
    gap: tuple[int, int] = (0, 0),
    max_programs: int | None = None,
    block_g: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Quantize the rows of x2d [M, K] into data/scales (uint8 views of the outputs).

    gap: (at, n) leaves rows [at, at + n) of x2d out: M - n output rows, output row m reading
    x2d row m (m < at) or m + n. max_programs caps the grid (programs loop over tiles),
    leaving SMs free for communication kernels; block_g (blocks of 32 per program) and
    num_warps override the config's values.
    """
    m, k = x2d.shape
    rows = m - gap[1]
    n_groups = block_count(rows, k, "x")
    if n_groups <= 0:
        return
    check_e4m3_gpu(x2d.device)
    soft = x2d.device.type == "cpu"
    block_g = _config.INTERPRET_BLOCK_G if soft else block_g or _config.QUANTIZE_BLOCK_G
    in_extent = (m - 1) * x2d.stride(0) + (k - 1) * x2d.stride(1) + 1
    int64 = _needs_int64(in_extent, (rows - 1) * stride_dm + k + k // 32)
    args = (x2d, data, scales, n_groups, k // BLOCK, gap[0], gap[1])
    args += (x2d.stride(0), x2d.stride(1), stride_dm, stride_sm)
    consts = {
        "RCEIL": scaling_mode == "rceil",
        "BLOCK_G": block_g,
        "SOFT": soft,
        "HW_E8M0": hw_e8m0(x2d.device),
        "INT64": int64,
    }
    warps = num_warps or _config.QUANTIZE_NUM_WARPS
    launch_tiles(_quantize_kernel, n_groups, args, consts, warps, max_programs)


# ---------------------------------------------------------------------------- custom ops


def _quantize_impl(x: torch.Tensor, scaling_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    k = x.shape[-1]
    x2d = as_rows(x)
    data = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((*x.shape[:-1], k // BLOCK), dtype=torch.float8_e8m0fnu, device=x.device)
    _launch(x2d, data.view(torch.uint8), scales.view(torch.uint8), k, k // BLOCK, scaling_mode)
    return data, scales


_quantize_op = torch.library.custom_op("mxfp8_a2a::quantize", _quantize_impl, mutates_args=())


@_quantize_op.register_fake
def _(x: torch.Tensor, scaling_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    k = x.shape[-1]
    data = x.new_empty(x.shape, dtype=torch.float8_e4m3fn)
    return data, x.new_empty((*x.shape[:-1], k // BLOCK), dtype=torch.float8_e8m0fnu)


def _quantize_packed_impl(x: torch.Tensor, scaling_mode: str) -> torch.Tensor:
    k = x.shape[-1]
    row = packed_row_bytes(k)
    out = torch.empty((*x.shape[:-1], row), dtype=torch.uint8, device=x.device)
    _launch(as_rows(x), out, out[..., k:], row, row, scaling_mode)
    return out


_quantize_packed_op = torch.library.custom_op(
    "mxfp8_a2a::quantize_packed", _quantize_packed_impl, mutates_args=()
)


@_quantize_packed_op.register_fake
def _(x: torch.Tensor, scaling_mode: str) -> torch.Tensor:
    k = x.shape[-1]
    return x.new_empty((*x.shape[:-1], packed_row_bytes(k)), dtype=torch.uint8)


# ---------------------------------------------------------------------------- public


def quantize(
    x: torch.Tensor, *, scaling_mode: str = "rceil", backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to MXFP8: e4m3 elements, one e8m0 scale per 32 values of the last dim.

    Args:
        x: bfloat16 or float32, shape [..., K], K % 32 == 0; any strides.
        scaling_mode: "rceil" (scale = smallest power of two >= amax / 448) or "floor"
            (OCP: 2^(floor(log2(amax)) - 8), elements saturate to +-448).
        backend: "auto" (Triton for CUDA tensors, the torch reference for CPU tensors),
            "triton" (CPU tensors need TRITON_INTERPRET=1) or "torch".
    Returns:
        data: float8_e4m3fn [..., K]; scales: float8_e8m0fnu [..., K // 32]. A block with a
        NaN gets scale 0xFF and NaN elements; a block with inf gets scale 0xFE.
    """
    check_float_input(x)
    check_scaling_mode(scaling_mode)
    if resolve_backend(backend, x.device, _quantize_kernel) == "torch":
        return quantize_reference(x, scaling_mode)
    return _quantize_op(x, scaling_mode)


def quantize_packed(
    x: torch.Tensor, *, scaling_mode: str = "rceil", backend: str = "auto"
) -> torch.Tensor:
    """Quantize ``x`` straight into the packed wire layout (one kernel, one buffer).

    Args: as :func:`quantize`.
    Returns:
        uint8 [..., K + K // 32]: each row holds its K e4m3 bytes, then its K/32 scale bytes.
    """
    check_float_input(x)
    check_scaling_mode(scaling_mode)
    if resolve_backend(backend, x.device, _quantize_kernel) == "torch":
        return pack(*quantize_reference(x, scaling_mode))
    return _quantize_packed_op(x, scaling_mode)


__all__ = ["quantize", "quantize_packed", "quantize_reference"]
