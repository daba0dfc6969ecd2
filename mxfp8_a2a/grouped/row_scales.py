"""One FP8 scale per row of a 2-D tensor, in one pass: the rowwise operands of the FP8
grouped GEMMs (the forward's tokens, grad_x's gradient and weights). The same numbers as
per_group_rowwise_scales(x, [C]) (one group spanning each row, reference.py), from a kernel
that holds whole rows in registers: each element is read once and written once (3 bytes
per bf16 element), where the row-block kernel reads rows wider than its largest size class
twice, in tiles of part of a row.

Layers: ``_row_scales_kernel`` -> ``_row_scales_impl`` (allocation, grid), registered as the
custom op ``mxfp8_a2a::row_scales`` -> :func:`row_scales`, which takes the per-group kernels
for rows wider than ``_config.ROW_SCALES_MAX_WIDTH`` or strided along the row, and the
plain-torch reference where the kernels do not run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _config
from .._common import cdiv, check_e4m3_gpu, next_pow2
from ..formats.bits import to_fp32
from ..formats.launch import launch
from .kernels import _amax_bits, _e4m3_bits, _offsets, _scales, _stored_scale
from .per_group_scales import INT64_FROM, _extent, _kernels_run_on, per_group_rowwise_scales
from .reference import empty_group_scale, per_group_rowwise_reference


@triton.jit
def _row_scales_kernel(
    x_ptr, data_ptr, scale_ptr, n_rows, n_cols, sxr, sxc,
    ROUND_POW2: tl.constexpr, SOFT: tl.constexpr, INT64: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, INVERSE: tl.constexpr,
):  # fmt: skip
    """x [n_rows, n_cols] through strides (sxr, sxc); data uint8 e4m3 bits [n_rows, n_cols]
    row-major; scale fp32 [n_rows] (INVERSE: their reciprocals). Program t: rows
    [t * BLOCK_R, (t + 1) * BLOCK_R), each whole (BLOCK_C >= n_cols): loaded once, its amax,
    its scale, its data."""
    t = tl.program_id(0)
    r = (t.to(tl.int64) if INT64 else t) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_C)
    rmask = r < n_rows
    mask = rmask[:, None] & (c < n_cols)[None, :]
    x = to_fp32(tl.load(x_ptr + _offsets(r, c, sxr, sxc, INT64), mask=mask, other=0.0), SOFT)
    scale = _scales(_amax_bits(x), ROUND_POW2)
    y = _e4m3_bits(x * scale[:, None], SOFT)
    tl.store(data_ptr + _offsets(r, c, n_cols, 1, INT64), y, mask=mask)
    tl.store(scale_ptr + r, _stored_scale(scale, INVERSE), mask=rmask)


def _row_scales_impl(
    x: torch.Tensor, pow2: bool, inverse: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    check_e4m3_gpu(x.device)
    n_rows, n_cols = x.shape
    data = torch.empty((n_rows, n_cols), dtype=torch.uint8, device=x.device)
    scales = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows and n_cols:
        block_c = next_pow2(n_cols)
        block_r = max(1, _config.ROW_SCALES_TILE // block_c)
        launch(
            _row_scales_kernel, cdiv(n_rows, block_r),
            (x, data, scales, n_rows, n_cols, x.stride(0), x.stride(1)),
            dict(ROUND_POW2=pow2, SOFT=x.device.type == "cpu",
                 INT64=max(_extent(x), data.numel(), n_rows + block_r) >= INT64_FROM,
                 BLOCK_R=block_r, BLOCK_C=block_c, INVERSE=inverse),
            _config.ROW_SCALES_NUM_WARPS,
        )  # fmt: skip
    else:  # rows without columns: the scale of an empty group
        scales.fill_(empty_group_scale(pow2, inverse))
    return data.view(torch.float8_e4m3fn), scales


_row_scales_op = torch.library.custom_op("mxfp8_a2a::row_scales", _row_scales_impl, mutates_args=())


@_row_scales_op.register_fake
def _(x, pow2, inverse=False):
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty(
        x.shape[0], dtype=torch.float32
    )


def row_scales(
    x: torch.Tensor, round_scales_to_power_of_2: bool = False, *, inverse: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16/fp32 [R, C], any strides -> (data float8_e4m3fn [R, C] row-major, scales fp32
    [R]): scale = 448 / max(amax of the row, 1e-12), data = e4m3(clamp(x * scale, +-448)),
    as per_group_rowwise_scales(x, offs=[C]) gives them (its scales reshaped to [R]).
    ``inverse``: the scales come out as their reciprocals (torch.reciprocal's values), the
    dequantization multipliers an FP8 GEMM takes."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(
            f"row_scales: x must be a 2-D bf16 or fp32 tensor, got {x.dtype} {tuple(x.shape)}"
        )
    if _kernels_run_on(x.device) and _row_kernel_fits(x):
        return _row_scales_op(x, round_scales_to_power_of_2, inverse)
    whole = torch.full((1,), x.shape[1], dtype=torch.int32, device=x.device)
    if _kernels_run_on(x.device):  # the per-group kernels choose a kernel for x's strides
        data, scales = per_group_rowwise_scales(
            x, whole, round_scales_to_power_of_2=round_scales_to_power_of_2, backend="triton",
            validate=False,
        )  # fmt: skip
    else:
        data, scales = per_group_rowwise_reference(x, whole, round_scales_to_power_of_2)
    scales = scales.reshape(-1)
    return data.contiguous(), scales.reciprocal() if inverse else scales


def _row_kernel_fits(x: torch.Tensor) -> bool:
    """Rows at most ROW_SCALES_MAX_WIDTH wide with unit column stride (whole rows in
    registers, loads along them); other x take the per-group kernels."""
    return x.shape[1] <= _config.ROW_SCALES_MAX_WIDTH and (x.stride(1) == 1 or x.shape[1] <= 1)
