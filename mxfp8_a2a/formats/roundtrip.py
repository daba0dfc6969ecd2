"""MXFP8 round trip (quantize, then dequantize, in registers): reference, kernel, op, function.

What a row sent through the exchange becomes, computed where it is: the exchange uses it
for the rows a rank keeps, which never need the wire. Layers: ``_roundtrip_kernel``
(Triton) -> ``_launch`` -> custom op ``mxfp8_a2a::quantize_dequantize`` ->
``quantize_dequantize``. ``quantize_dequantize_reference`` is the plain-torch definition.
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
    check_float_input,
    check_scaling_mode,
    hw_e8m0,
    resolve_backend,
)
from .bits import block_tile, mx_dequantize_blocks, mx_quantize_blocks, store_float, to_fp32
from .dequantize import dequantize_reference
from .launch import launch_tiles
from .quantize import _needs_int64, quantize_reference


def quantize_dequantize_reference(x: torch.Tensor, scaling_mode: str = "rceil") -> torch.Tensor:
    """dequantize_reference(*quantize_reference(x, scaling_mode), x.dtype): x's dtype and shape."""
    return dequantize_reference(*quantize_reference(x, scaling_mode), x.dtype)


@triton.jit
def _roundtrip_kernel(
    x_ptr,  # bf16/fp32 [M, K], strides (stride_xm, stride_xk)
    out_ptr,  # bf16/fp32 [M, K], row stride stride_om, unit column stride
    n_groups,  # M * K // 32
    groups_per_row,  # K // 32
    stride_xm,
    stride_xk,
    stride_om,
    RCEIL: tl.constexpr,
    BLOCK_G: tl.constexpr,
    SOFT: tl.constexpr,
    HW_E8M0: tl.constexpr,
    INT64: tl.constexpr,
):
    n_tiles = tl.cdiv(n_groups, BLOCK_G)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        gmask, row, cg = block_tile(tile, BLOCK_G, n_groups, groups_per_row)
        col = cg[:, None] * 32 + tl.arange(0, 32)[None, :]
        if INT64:  # col too: col * stride_xk passes 2**31 for a column-strided x
            row = row.to(tl.int64)
            col = col.to(tl.int64)
        x = tl.load(x_ptr + row[:, None] * stride_xm + col * stride_xk, mask=gmask[:, None])
        q, b = mx_quantize_blocks(to_fp32(x, SOFT), RCEIL, HW_E8M0, SOFT)
        y = mx_dequantize_blocks(q, b, SOFT)
        store_float(out_ptr + row[:, None] * stride_om + col, y, gmask[:, None], SOFT)


def _launch(
    x2d: torch.Tensor,
    out: torch.Tensor,
    scaling_mode: str,
    max_programs: int | None = None,
    block_g: int | None = None,
    num_warps: int | None = None,
) -> None:
    """out [M, K] (x2d's dtype, unit column stride) <- round trip of x2d [M, K].

    max_programs caps the grid (programs loop over tiles); block_g (blocks of 32 per
    program) and num_warps override the config's values."""
    m, k = x2d.shape
    n_groups = block_count(m, k, "x")
    if n_groups <= 0:
        return
    check_e4m3_gpu(x2d.device)
    soft = x2d.device.type == "cpu"
    block_g = _config.INTERPRET_BLOCK_G if soft else block_g or _config.ROUNDTRIP_BLOCK_G
    in_extent = (m - 1) * x2d.stride(0) + (k - 1) * x2d.stride(1) + 1
    args = (x2d, out, n_groups, k // BLOCK, x2d.stride(0), x2d.stride(1), out.stride(0))
    consts = {
        "RCEIL": scaling_mode == "rceil",
        "BLOCK_G": block_g,
        "SOFT": soft,
        "HW_E8M0": hw_e8m0(x2d.device),
        "INT64": _needs_int64(in_extent, m * out.stride(0)),
    }
    warps = num_warps or _config.ROUNDTRIP_NUM_WARPS
    launch_tiles(_roundtrip_kernel, n_groups, args, consts, warps, max_programs)


def _roundtrip_impl(x: torch.Tensor, scaling_mode: str) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(as_rows(x), as_rows(out), scaling_mode)
    return out


_roundtrip_op = torch.library.custom_op(
    "mxfp8_a2a::quantize_dequantize", _roundtrip_impl, mutates_args=()
)


@_roundtrip_op.register_fake
def _(x: torch.Tensor, scaling_mode: str) -> torch.Tensor:
    return x.new_empty(x.shape)  # row-major, as the op's output (not x's strides)


def quantize_dequantize(
    x: torch.Tensor, *, scaling_mode: str = "rceil", backend: str = "auto"
) -> torch.Tensor:
    """MXFP8 round trip in one pass: dequantize(quantize(x)) without the 8-bit copy.

    Args:
        x: bfloat16 or float32, shape [..., K], K % 32 == 0; any strides.
        scaling_mode, backend: as for :func:`mxfp8_a2a.quantize`.
    Returns:
        x's dtype and shape; bit for bit ``dequantize(*quantize(x), out_dtype=x.dtype)``.
    """
    check_float_input(x)
    check_scaling_mode(scaling_mode)
    if resolve_backend(backend, x.device, _roundtrip_kernel) == "torch":
        return quantize_dequantize_reference(x, scaling_mode)
    return _roundtrip_op(x, scaling_mode)


__all__ = ["quantize_dequantize", "quantize_dequantize_reference"]
