"""MXFP8 dequantize: reference, Triton kernel, custom ops and the public functions.

Layers: ``_dequantize_kernel`` (Triton) -> ``_launch`` -> custom ops
``mxfp8_a2a::dequantize`` / ``mxfp8_a2a::dequantize_packed`` -> ``dequantize`` /
``dequantize_packed``. ``dequantize_reference`` is the plain-torch definition.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _config
from .._common import (
    BLOCK,
    as_rows,
    block_count,
    check_e4m3_gpu,
    check_out_dtype,
    resolve_backend,
)
from .bits import block_tile, mx_dequantize_blocks, skip_gap, store_float
from .launch import launch_tiles
from .packing import k_from_packed_row_bytes, unpack

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}

# ---------------------------------------------------------------------------- reference


def dequantize_reference(
    data: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Plain-torch MXFP8 dequantize: e4m3 * 2^(b - 127) in fp32, then ``out_dtype``.

    Args:
        data: float8_e4m3fn [..., K]; scales: float8_e8m0fnu [..., K // 32].
        out_dtype: torch.bfloat16 or torch.float32.
    Returns:
        out_dtype [..., K]; blocks with scale byte 0xFF are NaN.
    """
    _check_data_scales(data, scales)
    check_out_dtype(out_dtype)
    k = data.shape[-1]
    b = scales.view(torch.uint8).to(torch.int32)
    mult = torch.exp2((b - 127).to(torch.float64)).to(torch.float32)
    y = data.float().reshape(*data.shape[:-1], k // BLOCK, BLOCK) * mult.unsqueeze(-1)
    y = torch.where((b == 255).unsqueeze(-1), float("nan"), y).reshape(data.shape)
    # no .to() to the dtype y already has: under torch.compile (torch 2.11) an
    # autograd.Function whose forward returned such a .to() (it returns its input) got zero
    # gradients, and its backward's collectives ran in the forward (the exchange's float32
    # leg on CPU: ranks then paired different collectives)
    return y if out_dtype == y.dtype else y.to(out_dtype)


def _check_data_scales(data: torch.Tensor, scales: torch.Tensor) -> None:
    if data.dtype != torch.float8_e4m3fn:
        raise TypeError(f"data must be float8_e4m3fn, got {data.dtype}")
    if scales.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise TypeError(f"scales must be float8_e8m0fnu (or its uint8 bytes), got {scales.dtype}")
    if data.dim() == 0 or data.shape[-1] % BLOCK != 0:
        raise ValueError(
            f"data must have shape [..., K] with K a multiple of {BLOCK}, got {tuple(data.shape)}"
        )
    want = (*data.shape[:-1], data.shape[-1] // BLOCK)
    if tuple(scales.shape) != want:
        raise ValueError(
            f"scales must have shape {want} for data of shape {tuple(data.shape)}, "
            f"got {tuple(scales.shape)}"
        )
    if data.device != scales.device:
        raise ValueError(f"data ({data.device}) and scales ({scales.device}) must share a device")


# ---------------------------------------------------------------------------- kernel


@triton.jit
def _dequantize_kernel(
    data_ptr,  # uint8, element (m, k) at m * stride_dm + k
    scale_ptr,  # uint8, block (m, g) at m * stride_sm + g
    out_ptr,  # bf16/fp32, element (m, k) at m * stride_om + k
    n_groups,  # input rows * K // 32
    groups_per_row,  # K // 32
    gap_at,  # input row m lands in row skip_gap(m, gap_at, gap_len) of out
    gap_len,
    stride_dm,
    stride_sm,
    stride_om,
    BLOCK_G: tl.constexpr,
    SOFT: tl.constexpr,
    INT64: tl.constexpr,
):
    n_tiles = tl.cdiv(n_groups, BLOCK_G)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        gmask, row, cg = block_tile(tile, BLOCK_G, n_groups, groups_per_row)
        out_row = skip_gap(row, gap_at, gap_len)
        if INT64:
            row = row.to(tl.int64)
            out_row = out_row.to(tl.int64)
        col = cg[:, None] * 32 + tl.arange(0, 32)[None, :]
        u = tl.load(data_ptr + row[:, None] * stride_dm + col, mask=gmask[:, None])
        b = tl.load(scale_ptr + row * stride_sm + cg, mask=gmask).to(tl.int32)
        y = mx_dequantize_blocks(u, b, SOFT)
        store_float(out_ptr + out_row[:, None] * stride_om + col, y, gmask[:, None], SOFT)


def _launch(
    data: torch.Tensor,
    scales: torch.Tensor,
    stride_dm: int,
    stride_sm: int,
    out: torch.Tensor,
    gap: tuple[int, int] = (0, 0),
    max_programs: int | None = None,
    block_g: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Dequantize uint8 data/scales into out [M, K].

    gap: (at, n) leaves rows [at, at + n) of out untouched: M - n input rows, input row m
    landing in out row m (m < at) or m + n. max_programs caps the grid (programs loop over
    tiles); block_g (blocks of 32 per program) and num_warps override the config's values.
    """
    m, k = out.shape
    rows = m - gap[1]
    n_groups = block_count(rows, k, "data")
    if n_groups <= 0:
        return
    check_e4m3_gpu(out.device)
    soft = out.device.type == "cpu"
    block_g = _config.INTERPRET_BLOCK_G if soft else block_g or _config.DEQUANTIZE_BLOCK_G
    int64 = max((rows - 1) * stride_dm + k + k // BLOCK, m * out.stride(0)) >= 2**31
    args = (data, scales, out, n_groups, k // BLOCK, gap[0], gap[1])
    args += (stride_dm, stride_sm, out.stride(0))
    consts = {"BLOCK_G": block_g, "SOFT": soft, "INT64": int64}
    warps = num_warps or _config.DEQUANTIZE_NUM_WARPS
    launch_tiles(_dequantize_kernel, n_groups, args, consts, warps, max_programs)


# ---------------------------------------------------------------------------- custom ops


def _dequantize_impl(data: torch.Tensor, scales: torch.Tensor, out_dtype: str) -> torch.Tensor:
    k = data.shape[-1]
    out = torch.empty(data.shape, dtype=_DTYPES[out_dtype], device=data.device)
    d = as_rows(data).contiguous().view(torch.uint8)
    s = as_rows(scales).contiguous().view(torch.uint8)
    _launch(d, s, k, k // BLOCK, as_rows(out))
    return out


_dequantize_op = torch.library.custom_op("mxfp8_a2a::dequantize", _dequantize_impl, mutates_args=())


@_dequantize_op.register_fake
def _(data: torch.Tensor, scales: torch.Tensor, out_dtype: str) -> torch.Tensor:
    return data.new_empty(data.shape, dtype=_DTYPES[out_dtype])


def _dequantize_packed_impl(packed: torch.Tensor, out_dtype: str) -> torch.Tensor:
    row = packed.shape[-1]
    k = k_from_packed_row_bytes(row)
    out = torch.empty((*packed.shape[:-1], k), dtype=_DTYPES[out_dtype], device=packed.device)
    p = as_rows(packed).contiguous()
    _launch(p, p[:, k:], row, row, as_rows(out))
    return out


_dequantize_packed_op = torch.library.custom_op(
    "mxfp8_a2a::dequantize_packed", _dequantize_packed_impl, mutates_args=()
)


@_dequantize_packed_op.register_fake
def _(packed: torch.Tensor, out_dtype: str) -> torch.Tensor:
    k = k_from_packed_row_bytes(packed.shape[-1])
    return packed.new_empty((*packed.shape[:-1], k), dtype=_DTYPES[out_dtype])


# ---------------------------------------------------------------------------- public


def dequantize(
    data: torch.Tensor,
    scales: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
) -> torch.Tensor:
    """Dequantize MXFP8 ``data`` with its ``scales``.

    Args:
        data: float8_e4m3fn [..., K], K % 32 == 0.
        scales: float8_e8m0fnu (or uint8 bytes) [..., K // 32].
        out_dtype: torch.bfloat16 (default) or torch.float32.
        backend: "auto" (Triton for CUDA tensors, the torch reference for CPU tensors),
            "triton" (CPU tensors need TRITON_INTERPRET=1) or "torch".
    Returns:
        out_dtype [..., K] = e4m3 * 2^(b - 127); blocks whose scale byte is 0xFF are NaN.
    """
    _check_data_scales(data, scales)
    check_out_dtype(out_dtype)
    if resolve_backend(backend, data.device, _dequantize_kernel) == "torch":
        return dequantize_reference(data, scales, out_dtype)
    return _dequantize_op(data, scales.view(torch.float8_e8m0fnu), _DTYPE_NAMES[out_dtype])


def dequantize_packed(
    packed: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16, backend: str = "auto"
) -> torch.Tensor:
    """Dequantize packed rows (uint8 [..., K + K // 32], see :mod:`mxfp8_a2a.formats.packing`).

    Returns:
        out_dtype [..., K].
    """
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise TypeError(f"packed must be a uint8 tensor, got {getattr(packed, 'dtype', packed)}")
    if packed.dim() == 0:
        raise ValueError("packed must have shape [..., K + K // 32], got a scalar")
    k_from_packed_row_bytes(packed.shape[-1])
    check_out_dtype(out_dtype)
    if resolve_backend(backend, packed.device, _dequantize_kernel) == "torch":
        return dequantize_reference(*unpack(packed), out_dtype)
    return _dequantize_packed_op(packed, _DTYPE_NAMES[out_dtype])


__all__ = ["dequantize", "dequantize_packed", "dequantize_reference"]
