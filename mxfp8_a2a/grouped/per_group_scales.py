"""FP8 e4m3 copies of jagged MoE tensors with one fp32 scale per (group, column) or
(group, row), for FP8-rowwise grouped GEMMs.

Layers: two Triton kernels, both reading and writing any strides: the row-block kernel
(kernels.py, groups along the contiguous axis of x and of the data) and the colwise kernels
(kernels_colwise.py, every other layout: an amax launch and a cast launch) -> launcher, registered
as the custom op ``mxfp8_a2a::per_group_scales`` -> ``per_group_colwise_scales`` /
``per_group_rowwise_scales``.
Rowwise scales of x are colwise scales of x.t() (the same numbers, the data transposed), so
each function can run either kernel without a copy ("direct": its own orientation;
"transpose": the other one on the view x.t()); "auto" picks from the strides. The definitions
(loops over groups in plain torch) are in reference.py.
"""

from __future__ import annotations

import torch

from .. import _config
from .._common import (
    cdiv,
    check_e4m3_gpu,
    kernels_run_on,
    next_pow2,
    resolve_backend,
)
from ..formats.launch import launch
from .kernels import _row_block_kernel
from .kernels_colwise import _amax_kernel, _cast_kernel
from .reference import (
    DATA_LAYOUTS,
    empty_data,
    empty_group_scale,
    expert_column_reference,
    padded_length,
    padded_token_reference,
    per_group_colwise_reference,
    per_group_rowwise_reference,
    scales_from_amax,
)

_METHODS = ("auto", "direct", "transpose")
INT64_FROM = 2**31  # the kernels use 64-bit element offsets from this extent up
MAX_ROW_BLOCK = 1024  # rows per rowwise item at most (each value compiles its own kernel)


# ---------------------------------------------------------------------------- launchers


def _row_block(tiling: _config.RowBlockTiling, n_other: int, extent: int, n_groups: int) -> int:
    """Other-axis indices per item of the row-block kernel: a power of two near
    tiling.item / (average group width), at most next_power_of_2(n_other) and MAX_ROW_BLOCK."""
    want = tiling.item // max(1, extent // n_groups)
    return min(next_pow2(max(1, want)), next_pow2(n_other), MAX_ROW_BLOCK)


def _extent(t: torch.Tensor) -> int:
    """One past the largest element offset of t."""
    return sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1


def _per_group_triton(
    x: torch.Tensor, offs: torch.Tensor, pow2: bool, group_dim: int, column_major: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups along ``group_dim``: data e4m3 shaped like x (row-major, or column-major),
    scales fp32 (G, x.shape[1 - group_dim]). group_dim 1 runs the row-block kernel, 0 the
    colwise kernels. No host synchronization."""
    g = offs.numel()
    soft = x.device.type == "cpu"
    other_dim = 1 - group_dim
    n_other, extent = x.shape[other_dim], x.shape[group_dim]
    data = empty_data(x.shape, "column_major" if column_major else "row_major", x.device)
    if g == 0 or extent == 0 or n_other == 0:  # nothing to read: no groups, or no indices
        data.zero_()
        empty = scales_from_amax(torch.zeros(()), pow2).item()
        return data.view(torch.float8_e4m3fn), x.new_full((g, n_other), empty, dtype=torch.float32)
    if group_dim == 0:
        scales = _colwise(x.unsqueeze(0), offs, pow2, data.unsqueeze(0), None)[0]
        return data.view(torch.float8_e4m3fn), scales
    check_e4m3_gpu(x.device)  # (the colwise kernels check in _colwise)
    scales = torch.empty((g, n_other), dtype=torch.float32, device=x.device)
    strides = (
        x.stride(other_dim),
        x.stride(group_dim),
        data.stride(other_dim),
        data.stride(group_dim),
    )
    int64 = max(_extent(x), data.numel(), scales.numel()) >= INT64_FROM
    t = _config.per_group_tiling(1, interpreted=soft)
    block = _row_block(t, n_other, extent, g)
    launch(
        _row_block_kernel, cdiv(n_other, block) * g,
        (x, offs, scales, data, n_other, extent, g, *strides),
        dict(ROUND_POW2=pow2, SOFT=soft, INT64=int64, ALIGN=16 if x.stride(1) == 1 else 1,
             BLOCK=block, TILE=t.tile, MIN_GROUP=t.min_group, N_CLASSES=t.n_classes),
        t.num_warps, **({"maxnreg": t.maxnreg} if t.maxnreg and not soft else {}),
    )  # fmt: skip
    return data.view(torch.float8_e4m3fn), scales


def _colwise_rows(c: _config.ColwiseTiling, rows: int, extent: int, strips: int) -> int:
    """Group-axis rows per tile: ``rows`` halved (down to 4 * c.sub) while the launch would
    have fewer than c.min_programs programs."""
    while rows > 4 * c.sub and cdiv(extent, rows) * strips < c.min_programs:
        rows //= 2
    return rows


def _colwise(
    x: torch.Tensor,
    offs: torch.Tensor,
    pow2: bool,
    data: torch.Tensor,
    pad: torch.Tensor | None,
    amax: torch.Tensor | None = None,
    inverse: bool = False,
) -> torch.Tensor:
    """The colwise kernels (kernels_colwise.py): x [B, extent, n_other], groups along dim 1,
    any strides; data uint8 [B, dest_extent, n_other], any strides, every element written
    (dest_extent: extent, or with ``pad`` int32 [G] the padded length, which receives the
    padded end offsets). ``amax``: int32 [B, G, n_other], the amax bits of every group
    already reduced (the amax launch is skipped; weight_scales.py makes them). Returns
    scales fp32 [B, G, n_other] (``inverse``: their reciprocals). No host synchronization."""
    check_e4m3_gpu(x.device)
    soft = x.device.type == "cpu"
    c = _config.per_group_tiling(0, interpreted=soft)
    batch, extent, n_other = x.shape
    dest_extent, g = data.shape[1], offs.numel()
    scales = torch.empty((batch, g, n_other), dtype=torch.float32, device=x.device)
    # (with ``pad`` the cast kernel runs even without columns: it writes the padded offsets)
    if min(batch, dest_extent) == 0 or (n_other == 0 and pad is None):
        return scales.fill_(empty_group_scale(pow2, inverse))
    if g == 0:  # no group: nothing for the kernels to write, all data 0
        data.zero_()
        return scales
    ws = (
        torch.zeros((batch, g, n_other), dtype=torch.int32, device=x.device)
        if amax is None
        else amax
    )
    int64 = max(_extent(x), _extent(data), ws.numel()) >= INT64_FROM
    n_strips = max(1, cdiv(n_other, c.block_other))
    bg = max(2, next_pow2(g))
    if extent and n_other and amax is None:
        rows = _colwise_rows(c, c.amax_rows, extent, n_strips * batch)
        launch(
            _amax_kernel, (cdiv(extent, rows) * n_strips, batch),
            (x, offs, ws, n_other, extent, g, x.stride(0), x.stride(2), x.stride(1), n_strips),
            dict(SOFT=soft, INT64=int64, BO=c.block_other, BL=rows, SUB=c.sub, BG=bg,
                 ALIGN=16 if x.stride(1) == 1 else 1, STAGES=c.amax_stages or None),
            c.num_warps,
        )  # fmt: skip
    rows = _colwise_rows(c, c.cast_rows, dest_extent, n_strips * batch)
    n_chunks = cdiv(dest_extent, rows)
    launch(
        _cast_kernel, (n_chunks * n_strips, batch),
        (x, offs, ws, scales, data, ws if pad is None else pad, n_other, extent, g, dest_extent,
         x.stride(0), x.stride(2), x.stride(1), data.stride(0), data.stride(2), data.stride(1),
         n_strips, n_chunks),
        dict(ROUND_POW2=pow2, SOFT=soft, INT64=int64, PAD=pad is not None, BO=c.block_other,
             BL=rows, SUB=c.sub, BG=bg, ALIGN=16 if data.stride(1) == 1 else 1,
             STAGES=c.cast_stages or None, INVERSE=inverse),
        c.num_warps,
    )  # fmt: skip
    return scales


_per_group_op = torch.library.custom_op(
    "mxfp8_a2a::per_group_scales", _per_group_triton, mutates_args=()
)


@_per_group_op.register_fake
def _(x, offs, pow2, group_dim, column_major):
    scales = x.new_empty((offs.numel(), x.shape[1 - group_dim]), dtype=torch.float32)
    if column_major:
        return x.new_empty(x.shape[::-1], dtype=torch.float8_e4m3fn).t(), scales
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), scales


# ---------------------------------------------------------------------------- grouped GEMMs
# Two operand layouts of torch._scaled_grouped_mm that no (M, K)-shaped output gives, written
# by the colwise kernels directly (mxfp8_a2a/grouped/gemm.py uses them).


def _kernels_run_on(device: torch.device) -> bool:
    """CUDA, or CPU under the Triton interpreter (else the plain-torch reference runs)."""
    return kernels_run_on(device, _cast_kernel)


def padded_token_scales(
    x: torch.Tensor, offs: torch.Tensor, inverse: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (any strides), groups of rows (tokens) ending at offs int32 [G] -> data
    e4m3 [K, cap] row-major, x.t() scaled per (group, row of x.t()), each group's tokens
    from a multiple of 16 on, at least 16 wide, zeros between; scales fp32 [G, K] (as
    per_group_rowwise_scales(x.t(), offs)); the padded end offsets int32 [G] (the last one
    cap). cap = padded_length(M, G). The grad_w operands of a 2-D x 2-D FP8 grouped GEMM.
    ``inverse``: the scales come out as their reciprocals (the GEMM's multipliers)."""
    if not _kernels_run_on(x.device):
        data, scales, pad = padded_token_reference(x, offs)
        return data, scales.reciprocal() if inverse else scales, pad
    return _padded_token_op(x, offs, inverse)


def _padded_token_impl(
    x: torch.Tensor, offs: torch.Tensor, inverse: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, k = x.shape
    cap = padded_length(m, offs.numel())
    data = torch.empty((k, cap), dtype=torch.uint8, device=x.device)
    pad = torch.empty(offs.numel(), dtype=torch.int32, device=x.device)
    scales = _colwise(
        x.unsqueeze(0), offs.contiguous(), False, data.t().unsqueeze(0), pad, inverse=inverse
    )
    return data.view(torch.float8_e4m3fn), scales[0], pad


_padded_token_op = torch.library.custom_op(
    "mxfp8_a2a::padded_token_scales", _padded_token_impl, mutates_args=()
)


@_padded_token_op.register_fake
def _(x, offs, inverse=False):
    cap = padded_length(x.shape[0], offs.shape[0])
    data = x.new_empty((x.shape[1], cap), dtype=torch.float8_e4m3fn)
    scales = x.new_empty((offs.shape[0], x.shape[1]), dtype=torch.float32)
    return data, scales, offs.new_empty(offs.shape, dtype=torch.int32)


def expert_column_scales(
    w: torch.Tensor, inverse: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, K, N] (any strides) -> data e4m3 [E, K, N], each expert column-major (strides
    (N*K, 1, K)), scaled per (expert, column); scales fp32 [E, N] (as
    per_group_colwise_scales(w.reshape(E*K, N), offsets of K each)). The forward's weights
    of an FP8 grouped GEMM. ``inverse``: the scales come out as their reciprocals."""
    if not _kernels_run_on(w.device):
        data, scales = expert_column_reference(w)
        return data, scales.reciprocal() if inverse else scales
    return _expert_column_op(w, inverse)


def _expert_column_impl(
    w: torch.Tensor, inverse: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    e, k, n = w.shape
    data = torch.empty((e, n, k), dtype=torch.uint8, device=w.device).transpose(1, 2)
    offs = torch.full((1,), k, dtype=torch.int32, device=w.device)
    scales = _colwise(w, offs, False, data, None, inverse=inverse)
    return data.view(torch.float8_e4m3fn), scales.view(e, n)


_expert_column_op = torch.library.custom_op(
    "mxfp8_a2a::expert_column_scales", _expert_column_impl, mutates_args=()
)


@_expert_column_op.register_fake
def _(w, inverse=False):
    e, k, n = w.shape
    data = w.new_empty((e, n, k), dtype=torch.float8_e4m3fn).transpose(1, 2)
    return data, w.new_empty((e, n), dtype=torch.float32)


def _contiguous_along(t: torch.Tensor, dim: int) -> bool:
    return t.stride(dim) == 1 or t.shape[dim] <= 1


def _triton(x, offs, pow2: bool, group_dim: int, method: str, data_layout: str):
    """Run the kernel ``method`` names; "auto": the row-block kernel where the group axis is
    contiguous in x and in the data, the colwise kernels everywhere else."""
    column_major = data_layout == "column_major"
    offs = offs.contiguous()  # the kernels read offs[g] at offs_ptr + g
    if method == "auto":
        data_along_groups = column_major == (group_dim == 0)
        # branches, not a comparison of bools: under torch.compile (torch 2.11) the stride
        # test is symbolic and comparing it with a bool failed to trace
        if data_along_groups and _contiguous_along(x, group_dim):  # the row-block kernel
            method = "direct" if group_dim == 1 else "transpose"
        else:
            method = "transpose" if group_dim == 1 else "direct"
    if method == "direct":
        return _per_group_op(x, offs, pow2, group_dim, column_major)
    data, scales = _per_group_op(x.t(), offs, pow2, 1 - group_dim, not column_major)
    return data.t(), scales


# ---------------------------------------------------------------------------- public


def _check(x, offs, dim: int, backend: str, method: str, data_layout: str, validate: bool) -> str:
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"x must be bfloat16 or float32, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got shape {tuple(x.shape)}")
    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or offs.dim() != 1:
        raise TypeError("offs must be a 1-D int32 tensor of group end offsets")
    if offs.device != x.device:
        raise ValueError(f"offs ({offs.device}) must be on x's device ({x.device})")
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    if data_layout not in DATA_LAYOUTS:
        raise ValueError(f"data_layout must be one of {DATA_LAYOUTS}, got {data_layout!r}")
    if validate:
        _check_values(offs, x.shape[dim], dim)
    return resolve_backend(backend, x.device, _row_block_kernel)


def _check_values(offs: torch.Tensor, extent: int, dim: int) -> None:
    """Non-decreasing, >= 0, last == extent. Reads offs on the host (one synchronization)."""
    host = offs.tolist()
    if any(b < a for a, b in zip([0, *host], host, strict=False)):  # (previous end, end)
        raise ValueError(f"offs must be non-decreasing and >= 0, got {host}")
    if (host[-1] if host else 0) != extent:
        raise ValueError(
            f"offs[-1] must equal x.shape[{dim}] = {extent} (groups cover every index), "
            f"got {host[-1] if host else 'no groups'}"
        )


_DOC_COMMON = """
    Args:
        round_scales_to_power_of_2: round each scale down to a power of two.
        backend: "auto" (Triton on CUDA, torch on CPU), "triton", "torch".
        method: which kernel (results are identical): "auto" picks from the strides (the
            row-block kernel where the group axis is contiguous in x and in the data, the
            colwise kernels otherwise; never a copy); "direct" runs this function's own
            orientation on x, "transpose" the other one's on the view x.t().
        data_layout: "row_major" (data contiguous) or "column_major" (data.t() contiguous),
            written by the kernel directly.
        validate: check the values of offs (non-decreasing, >= 0, offs[-1] == the group
            axis' length) with a clear error; reads offs on the host, one synchronization.
            With False nothing synchronizes (for hot loops and CUDA graphs), and every
            backend gives the same defined result for any offs: offsets clamped into
            [0, length] and made non-decreasing (running maximum), group g covering
            [e[g-1], e[g]); indices past the last end belong to no group and get data 0;
            empty offs give data 0 and scales with 0 rows.
"""


def per_group_colwise_scales(
    x: torch.Tensor,
    offs: torch.Tensor,
    *,
    round_scales_to_power_of_2: bool = False,
    backend: str = "auto",
    method: str = "auto",
    data_layout: str = "row_major",
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 copy of x (M, K) with one scale per (group of rows, column).

    x: bfloat16 or float32 (M, K), any strides. offs: int32 [G] group end offsets along
    dim 0, non-decreasing, offs[-1] == M. Returns data float8_e4m3fn (M, K) in
    ``data_layout`` and scales float32 (G, K): data = e4m3(clamp(x * scale, +-448)),
    scale = 448 / max(amax of the group's column, 1e-12) (reference.py).
    """
    if _check(x, offs, 0, backend, method, data_layout, validate) == "torch":
        return per_group_colwise_reference(x, offs, round_scales_to_power_of_2, data_layout)
    return _triton(x, offs, round_scales_to_power_of_2, 0, method, data_layout)


def per_group_rowwise_scales(
    x: torch.Tensor,
    offs: torch.Tensor,
    *,
    round_scales_to_power_of_2: bool = False,
    backend: str = "auto",
    method: str = "auto",
    data_layout: str = "row_major",
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 copy of x (N, M) with one scale per (group of columns, row).

    x: bfloat16 or float32 (N, M), any strides. offs: int32 [G] group end offsets along
    dim 1, non-decreasing, offs[-1] == M. Returns data float8_e4m3fn (N, M) in
    ``data_layout`` and scales float32 (G, N). The same numbers as
    per_group_colwise_scales(x.t(), offs) with the data transposed.
    """
    if _check(x, offs, 1, backend, method, data_layout, validate) == "torch":
        return per_group_rowwise_reference(x, offs, round_scales_to_power_of_2, data_layout)
    return _triton(x, offs, round_scales_to_power_of_2, 1, method, data_layout)


if __doc__ is not None:  # (python -OO strips docstrings)
    per_group_colwise_scales.__doc__ += _DOC_COMMON
    per_group_rowwise_scales.__doc__ += _DOC_COMMON
