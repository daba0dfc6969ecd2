"""FP8 e4m3 copies of jagged MoE tensors with one fp32 scale per (group, column) or
(group, row), for FP8-rowwise grouped GEMMs.

Layers: Triton kernels (kernels.py: ``_row_block_kernel`` for rowwise, ``_group_item_kernel``
for colwise) -> launcher -> custom op ``mxfp8_a2a::per_group_scales`` ->
``per_group_colwise_scales`` / ``per_group_rowwise_scales``. The definitions (loops over groups
in plain torch) are in reference.py.
"""

from __future__ import annotations

import torch
import triton

from .. import _config
from .._common import resolve_backend, sm_count
from .kernels import _group_item_kernel, _row_block_kernel
from .reference import per_group_colwise_reference, per_group_rowwise_reference

_METHODS = ("auto", "direct", "transpose")
INT64_FROM = 2**31  # the rowwise kernel uses 64-bit element offsets from this extent up
MAX_ROW_BLOCK = 1024  # rows per rowwise item at most (each value compiles its own kernel)


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
