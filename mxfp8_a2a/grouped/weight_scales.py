"""Both FP8 copies of expert weights w [E, K, N] that precision="fp8_rowwise" needs, from two
reads of w instead of three: the forward's (one scale per (expert, column of N), each expert
column-major: per_group_scales.expert_column_scales) and grad_x's (one scale per (expert,
row of K), w's own row-major storage: row_scales.row_scales).

Made apart, the column copy reads w twice (its amax launch, then its cast launch) and the
row copy once. Here one kernel, ``_weight_rows_kernel``, reads w once and writes the row copy
as row_scales' kernel does (whole rows in registers) while it also reduces each column's
amax over its rows and merges it into the colwise kernels' workspace by atomic max; the
colwise cast launch then makes the column copy from that workspace. Bytes per bf16 element:
2 reads and 2 one-byte writes (6), against 3 reads and 2 writes (8). The numbers are those
of the two ops apart, bit for bit (the same amax bits, the same scale and cast code).

Layers: ``_weight_rows_kernel`` + the colwise cast launch (per_group_scales._colwise) ->
``_weight_scales_impl`` (allocation, grid), the custom op ``mxfp8_a2a::weight_scales`` ->
:func:`weight_scales`,
which composes the two ops apart where the kernel does not apply (rows wider than
``_config.ROW_SCALES_MAX_WIDTH``) and the references where the kernels do not run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _config
from .._common import cdiv, check_e4m3_gpu, next_pow2
from ..formats.bits import to_fp32
from ..formats.launch import launch
from .kernels import _amax_bits, _e4m3_bits, _scales, _stored_scale
from .per_group_scales import INT64_FROM, _colwise, _kernels_run_on, expert_column_scales
from .row_scales import row_scales


@triton.jit
def _weight_rows_kernel(
    w_ptr, data_ptr, scale_ptr, ws_ptr, k, n, rows,
    SOFT: tl.constexpr, INT64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    STAGES: tl.constexpr, INVERSE: tl.constexpr,
):  # fmt: skip
    """w [E, K, N] contiguous; data uint8 e4m3 bits [E * K, N] row-major, one scale per row
    (scale fp32 [E * K]; INVERSE: their reciprocals); ws int32 [E, N], zeroed: max of the
    column amax bits of every program. Grid (cdiv(K, rows), E): program (t, e) takes rows
    [t * rows, (t + 1) * rows) of expert e (rows: a multiple of BLOCK_R; BLOCK_C >= N),
    BLOCK_R whole rows at a time, STAGES loads in flight (software pipelining; None: one at
    a time)."""
    t = tl.program_id(0)
    e = tl.program_id(1)
    c = tl.arange(0, BLOCK_C)
    cmask = c < n
    k0 = t * rows
    k1 = tl.minimum(k0 + rows, k)
    base = e.to(tl.int64) * k if INT64 else e * k
    col = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.int32)  # elementwise, reduced once at the end
    for r0 in tl.range(k0, k1, BLOCK_R, num_stages=STAGES):
        r = r0 + tl.arange(0, BLOCK_R)
        rmask = r < k1
        row = base + r
        mask = rmask[:, None] & cmask[None, :]
        offsets = row[:, None] * n + c[None, :]
        x = to_fp32(tl.load(w_ptr + offsets, mask=mask, other=0.0), SOFT)
        scale = _scales(_amax_bits(x), False)
        tl.store(data_ptr + offsets, _e4m3_bits(x * scale[:, None], SOFT), mask=mask)
        tl.store(scale_ptr + row, _stored_scale(scale, INVERSE), mask=rmask)
        # masked lanes loaded 0.0: bits 0, below every amax
        col = tl.maximum(col, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    ws = ws_ptr + (e.to(tl.int64) * n if INT64 else e * n)
    tl.atomic_max(ws + c, tl.max(col, axis=0), mask=cmask, sem="relaxed")


def _rows_per_program(k: int, e: int, block_r: int) -> int:
    """Rows per program: WEIGHT_SCALES_ROWS (a multiple of block_r), halved (not below
    block_r) while the launch would have fewer than WEIGHT_SCALES_MIN_PROGRAMS programs."""
    rows = max(block_r, _config.WEIGHT_SCALES_ROWS // block_r * block_r)
    while rows > block_r and cdiv(k, rows) * e < _config.WEIGHT_SCALES_MIN_PROGRAMS:
        rows = max(block_r, rows // 2 // block_r * block_r)
    return rows


def _weight_scales_impl(
    w: torch.Tensor, inverse: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    check_e4m3_gpu(w.device)
    e, k, n = w.shape
    by_column = torch.empty((e, n, k), dtype=torch.uint8, device=w.device).transpose(1, 2)
    by_row = torch.empty((e * k, n), dtype=torch.uint8, device=w.device)
    row_s = torch.empty(e * k, dtype=torch.float32, device=w.device)
    ws = torch.zeros((e, 1, n), dtype=torch.int32, device=w.device)
    block_c = next_pow2(n)
    block_r = max(1, _config.ROW_SCALES_TILE // block_c)
    rows = _rows_per_program(k, e, block_r)
    launch(
        _weight_rows_kernel, (cdiv(k, rows), e), (w, by_row, row_s, ws, k, n, rows),
        dict(SOFT=w.device.type == "cpu",
             INT64=max(w.numel(), ws.numel()) + block_c >= INT64_FROM,
             BLOCK_R=block_r, BLOCK_C=block_c, STAGES=_config.WEIGHT_SCALES_STAGES or None,
             INVERSE=inverse),
        _config.WEIGHT_SCALES_NUM_WARPS,
    )  # fmt: skip
    offs = torch.full((1,), k, dtype=torch.int32, device=w.device)
    col_s = _colwise(w, offs, False, by_column, None, amax=ws, inverse=inverse)
    by_row = by_row.view(e, k, n).transpose(1, 2)
    f8 = torch.float8_e4m3fn
    return by_column.view(f8), col_s.view(e, n), by_row.view(f8), row_s.view(e, k)


_weight_scales_op = torch.library.custom_op(
    "mxfp8_a2a::weight_scales", _weight_scales_impl, mutates_args=()
)


@_weight_scales_op.register_fake
def _(w, inverse=False):
    e, k, n = w.shape
    by_column = w.new_empty((e, n, k), dtype=torch.float8_e4m3fn).transpose(1, 2)
    by_row = w.new_empty((e, k, n), dtype=torch.float8_e4m3fn).transpose(1, 2)
    scales = w.new_empty((e, n), dtype=torch.float32), w.new_empty((e, k), dtype=torch.float32)
    return by_column, scales[0], by_row, scales[1]


def weight_scales(
    w: torch.Tensor, *, inverse: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [E, K, N] bf16/fp32 contiguous -> (by_column, column_scales, by_row, row_scales):

    - by_column: e4m3 [E, K, N], each expert column-major (strides (N*K, 1, K)), one scale per
      (expert, column of N): column_scales fp32 [E, N] (= expert_column_scales(w));
    - by_row: e4m3 [E, N, K] = w^T, each expert column-major (strides (K*N, 1, N): w's own
      row-major storage), one scale per (expert, row of K): row_scales fp32 [E, K]
      (= row_scales(w.reshape(E * K, N)) reshaped).

    Scales as the per-group kernels define them (448 / max(amax, 1e-12)); ``inverse``: their
    reciprocals (torch.reciprocal's values, the FP8 GEMM's multipliers). Memory: 2 bytes per
    element of w in all, plus the scales. No host synchronization on CUDA."""
    if w.dim() != 3 or w.dtype not in (torch.bfloat16, torch.float32) or not w.is_contiguous():
        raise ValueError(
            f"weight_scales: w must be a contiguous 3-D bf16 or fp32 tensor, got {w.dtype} "
            f"{tuple(w.shape)} with strides {w.stride()}"
        )
    fits = w.shape[2] <= _config.ROW_SCALES_MAX_WIDTH and w.numel() > 0
    if fits and _kernels_run_on(w.device):
        return _weight_scales_op(w, inverse)
    return weight_scales_apart(w, inverse=inverse)


def weight_scales_apart(
    w: torch.Tensor, *, inverse: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight_scales' results from the two casts apart (expert_column_scales, row_scales):
    three reads of w; for weights the one-pass kernel does not take, and as its yardstick."""
    e, k, n = w.shape
    by_column, col_s = expert_column_scales(w, inverse)
    data, row_s = row_scales(w.reshape(e * k, n), inverse=inverse)
    return by_column, col_s, data.view(e, k, n).transpose(1, 2), row_s.view(e, k)
