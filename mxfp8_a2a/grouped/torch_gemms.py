"""torch's grouped GEMMs, through their public API where the installed torch has it.

- :func:`grouped_gemm` (bf16, unscaled): ``torch.nn.functional.grouped_mm``, which calls
  ``torch._grouped_mm``; the private op directly where torch has no public one.
- :func:`scaled_grouped_gemm` (e4m3 operands, fp32 rowwise multipliers, bf16 out):
  ``torch.nn.functional.scaled_grouped_mm`` with the RowWise recipe for both operands. Its
  op (``torch._scaled_grouped_mm_v2``) has no meta kernel in torch 2.13, so fake tensors (what
  torch.compile traces grouped_mm's backward with) cannot run it; where it has none, tensors
  other than plain ones take the private ``torch._scaled_grouped_mm``, which has one, and so
  does every call on a torch without the public function. On CUDA both ops take the same
  path for fp32 rowwise scales (aten/src/ATen/native/cuda/GroupedBlas.cpp:
  ``_f8_f8_bf16_rowwise_grouped_mm``, fast accumulation off, the same scale shape checks):
  the same bits (tests/test_grouped_mm_gpu.py compares them).

Operands as torch takes them: a row-major, b column-major (per expert for 3-D b), offs int32
[E] group end offsets; scales 2-D x 3-D: scale_a [M], scale_b [E, N]; 2-D x 2-D: scale_a
[E * K], scale_b [E * N] (gemm.py's docstring lists the layout rules and how they are met).
"""

from __future__ import annotations

import torch

_F = torch.nn.functional
PUBLIC_GROUPED_MM = hasattr(_F, "grouped_mm")
HAS_GROUPED_MM = PUBLIC_GROUPED_MM or hasattr(torch, "_grouped_mm")
HAS_PUBLIC_SCALED_GROUPED_MM = hasattr(_F, "scaled_grouped_mm") and hasattr(_F, "ScalingType")
HAS_SCALED_GROUPED_MM = HAS_PUBLIC_SCALED_GROUPED_MM or hasattr(torch, "_scaled_grouped_mm")


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch's grouped GEMM of a [M, K] (rows grouped by offs) and b [E, K, N] -> [M, N], or
    of a [K, M] and b [M, N] (groups along M) -> [E, K, N]; a's dtype, fp32 accumulation."""
    if PUBLIC_GROUPED_MM:
        return _F.grouped_mm(a, b, offs=offs)
    return torch._grouped_mm(a, b, offs=offs)


def _public_scaled(a, b, scale_a, scale_b, offs) -> torch.Tensor:
    rowwise = _F.ScalingType.RowWise
    return _F.scaled_grouped_mm(
        a, b, scale_a, rowwise, scale_b, rowwise, offs=offs, output_dtype=torch.bfloat16
    )


def _public_scaled_has_meta() -> bool:
    """Whether the public FP8 grouped GEMM runs on meta tensors (so fake tensors run it)."""
    if not HAS_PUBLIC_SCALED_GROUPED_MM:
        return False
    e4m3, meta = torch.float8_e4m3fn, "meta"
    a = torch.empty(16, 16, dtype=e4m3, device=meta)
    b = torch.empty(1, 16, 16, dtype=e4m3, device=meta).transpose(1, 2)
    scales = torch.empty(16, device=meta), torch.empty(1, 16, device=meta)
    try:
        _public_scaled(a, b, *scales, torch.empty(1, dtype=torch.int32, device=meta))
    except (NotImplementedError, RuntimeError, TypeError, ValueError):
        return False
    return True


PUBLIC_SCALED_TRACES = _public_scaled_has_meta()  # False on torch 2.13


def scaled_path(a: torch.Tensor) -> str:
    """Which FP8 grouped GEMM runs for operand ``a``: "public" or "private" (see above)."""
    if HAS_PUBLIC_SCALED_GROUPED_MM and (PUBLIC_SCALED_TRACES or type(a) is torch.Tensor):
        return "public"
    return "private"


def scaled_grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor,
) -> torch.Tensor:
    """torch's FP8 grouped GEMM, bf16 out: a e4m3 row-major, b e4m3 column-major, scale_a and
    scale_b fp32 dequantization multipliers (one per row of a and per column of b, per group
    for 2-D x 2-D); shapes as :func:`grouped_gemm`'s."""
    if scaled_path(a) == "public":
        return _public_scaled(a, b, scale_a, scale_b, offs)
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)
