"""Rows past the last group: grouped_mm's rows at and after offs[-1] (the padding of the
static dispatch's expert-major layout) are zero in its output and in x's gradient.

torch's grouped GEMMs ignore those rows and leave their output memory unwritten; zeroing
them with a mask would read and write the whole output. ``zero_trailing_rows_`` writes only
the rows from offs[-1] on: a Triton kernel reads offs[-1] on the device (programs of rows
before it exit at once), so nothing is read on the host. On CPU, a masked fill.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import cdiv, kernels_run_on

_ROWS, _COLS = 16, 256  # a program: 16 rows x 256 columns of zeros (any dtype)


@triton.jit
def _zero_rows_kernel(t_ptr, offs_ptr, n_groups, rows, cols, stride, BR: tl.constexpr,
                      BC: tl.constexpr):  # fmt: skip
    end = tl.load(offs_ptr + n_groups - 1).to(tl.int64)
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    if tl.program_id(0).to(tl.int64) * BR + BR <= end:
        return
    for c0 in range(0, cols, BC):
        c = c0 + tl.arange(0, BC)
        mask = ((r >= end) & (r < rows))[:, None] & (c < cols)[None, :]
        zero = tl.zeros([BR, BC], dtype=t_ptr.dtype.element_ty)
        tl.store(t_ptr + r[:, None] * stride + c[None, :], zero, mask=mask)


@torch.library.custom_op("mxfp8_a2a::zero_trailing_rows", mutates_args=("t",))
def _zero_op(t: torch.Tensor, offs: torch.Tensor) -> None:
    rows, cols = t.shape
    if rows == 0 or cols == 0 or offs.numel() == 0:
        return
    grid = (cdiv(rows, _ROWS),)
    _zero_rows_kernel[grid](t, offs, offs.numel(), rows, cols, t.stride(0), BR=_ROWS, BC=_COLS)


def zero_trailing_rows_(t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """t [M, N] (rows contiguous) with rows offs[-1] .. M-1 set to zero, in place; offs int32
    [E] on t's device (E = 0: all rows). Returns t."""
    if offs.numel() == 0:
        return t.zero_()
    if t.stride(-1) == 1 and kernels_run_on(t.device, _zero_rows_kernel):
        _zero_op(t, offs)
        return t
    trailing = torch.arange(t.shape[0], device=t.device) >= offs[-1]
    return t.masked_fill_(trailing[:, None], 0)
