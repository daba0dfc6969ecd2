"""Grouped GEMMs of MoE experts: ``grouped_mm(x, w, offs, precision=...)``.

x [M, K] holds rows grouped by expert (group e is rows offs[e-1]:offs[e]), w [E, K, N] the
experts' weights: out[rows of e] = x[rows of e] @ w[e]. Layers: torch's grouped GEMMs (public:
torch.nn.functional.grouped_mm and scaled_grouped_mm; the private torch._grouped_mm and
torch._scaled_grouped_mm only where those are missing or cannot be traced: torch_gemms.py)
and the custom op ``mxfp8_a2a::grouped_mm_loop`` (a per-expert loop) -> the autograd
Function _GroupedMM (bf16) and the custom op ``mxfp8_a2a::fp8_rowwise_grouped_mm`` with its
autograd (fp8_rowwise.py) -> grouped_mm.
The plain-torch definition is grouped_mm_reference.py.

Layout rules of torch's CUDA grouped GEMMs, as read in its sources (aten/src/ATen/native/
cuda/GroupedBlas.cpp, GroupMMCommon.cuh, GroupedMMUtils.h; two versions of GroupMMCommon.cuh,
an older and the current one) and in the meta kernels of torch 2.13, and how they are met:
- every operand row- or column-major with 16-byte aligned strides and data pointers: x and w
  are made contiguous; bf16 needs K and N multiples of 8, FP8 multiples of 16 (FP8 also
  checks mat_a.size(-1), mat_b.size(-2) and mat_b.size(-1) % 16 == 0); otherwise a
  ValueError says what to pad;
- FP8: mat_a row-major, mat_b column-major, fp32 scales (dequantization multipliers, the
  reciprocals of the per-group kernels' scales), bf16 output, fewer than 1024 groups;
  2-D x 3-D scales: scale_a [M], scale_b [E, N]; 2-D x 2-D: scale_a [E * K], scale_b [E * N];
- 2-D x 2-D FP8 (grad_w, groups along the tokens, the contraction axis): each group but the
  last must span a multiple of 16 tokens (TMA), and some torch versions assert every group
  is non-empty. The per-group kernel therefore writes both operands with each group's tokens
  starting on a multiple of 16 and at least 16 wide, zeros between (static length
  round_up(M, 16) + 16 E; zero tokens add nothing), and the padded offsets, on the device
  (per_group_scales.padded_token_scales). The bf16 2-D x 2-D GEMM reads x^T column-major and
  grad_out row-major, the layout for which torch checks neither alignment nor non-empty
  groups, so it needs no padding;
- 2-D x 3-D (forward, grad_x, groups along M): torch checks no group alignment there (row
  pointers move by whole rows of K, a multiple of 16 bytes), so rows stay where they are;
  the forward's weights come column-major per expert from the per-group kernel
  (per_group_scales.expert_column_scales), grad_x's are w's own storage.
Rows past offs[-1] (x longer than its groups: the static dispatch's zero padding) belong to no
group. torch's grouped GEMMs ignore them (2-D x 3-D: their output rows are left unwritten;
2-D x 2-D: those tokens are not read), as do the per-group kernels; the output and grad_x
rows from offs[-1] on are zeroed after the GEMM by trailing.py's kernel, which reads offs[-1]
on the device and writes only those rows (the loop op and the reference start from zeros).
Nothing here reads offs on the host except the CPU loop and ``validate=True``.
"""

from __future__ import annotations

import torch

from .. import _config
from .._common import capability, contiguous
from .fp8_rowwise import (
    Fp8Weights,
    check_fp8_weights,
    fp8_rowwise_grouped_mm,
    fp8_rowwise_weights,
)
from .grouped_mm_reference import grouped_mm_reference
from .torch_gemms import HAS_GROUPED_MM, HAS_SCALED_GROUPED_MM, grouped_gemm
from .trailing import zero_trailing_rows_

PRECISIONS = ("bf16", "fp8_rowwise", "fp8_rowwise_gw_hp")
MAX_GROUPS = 1023  # torch's CUTLASS grouped GEMMs: "Can't process more than 1024 groups"
# Where torch has neither the public nor the private form of a grouped GEMM
# (HAS_GROUPED_MM, HAS_SCALED_GROUPED_MM from torch_gemms.py), grouped_mm runs the loop op
# for "bf16" and the plain-torch reference for the FP8 precisions (the same arithmetic,
# slower, reading offs on the host).


# ---------------------------------------------------------------------------- helpers


def _host_bounds(offs: torch.Tensor, extent: int) -> list[tuple[int, int]]:
    """(start, end) of each group, read on the host; a ValueError unless the offsets are
    non-decreasing, >= 0, and the last at most ``extent``."""
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if any(b < a for a, b in zip(starts, ends, strict=True)):
        raise ValueError(f"grouped_mm: offs must be non-decreasing and >= 0, got {ends}")
    if ends and ends[-1] > extent:
        raise ValueError(
            f"grouped_mm: offs[-1] must be at most x.shape[0] = {extent} (rows past offs[-1] "
            f"are ignored), got {ends[-1]}: the groups overrun x; pad x with zero rows to "
            f"offs[-1] rows, or pass the end offsets of x's own rows"
        )
    return list(zip(starts, ends, strict=True))


# ---------------------------------------------------------------------------- GEMMs


@torch.library.custom_op("mxfp8_a2a::grouped_mm_loop", mutates_args=())
def _loop_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch's grouped GEMM's 2-D x 3-D and 2-D x 2-D cases as a loop over groups (offs read
    on the host), each product in fp32 rounded once to a's dtype."""
    if b.dim() == 3:  # a [M, K] rows grouped, b [E, K, N] -> [M, N]; rows past offs[-1]: 0
        out = a.new_zeros((a.shape[0], b.shape[2]))
        for e, (lo, hi) in enumerate(_host_bounds(offs, a.shape[0])):
            out[lo:hi] = (a[lo:hi].float() @ b[e].float()).to(out.dtype)
        return out
    # a [K, M], b [M, N], groups along M -> [E, K, N]
    out = a.new_zeros((offs.shape[0], a.shape[0], b.shape[1]))
    for e, (lo, hi) in enumerate(_host_bounds(offs, a.shape[1])):
        if hi > lo:
            out[e] = (a[:, lo:hi].float() @ b[lo:hi].float()).to(out.dtype)
    return out


@_loop_op.register_fake
def _(a, b, offs):
    if b.dim() == 3:
        return a.new_empty((a.shape[0], b.shape[2]))
    return a.new_empty((offs.shape[0], a.shape[0], b.shape[1]))


def _gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, loop: bool) -> torch.Tensor:
    return _loop_op(a, b, offs) if loop else grouped_gemm(a, b, offs)


class _GroupedMM(torch.autograd.Function):
    """Unscaled: torch's grouped GEMM (CUDA, bf16) or the loop op, forward and backward."""

    @staticmethod
    def forward(ctx, x, w, offs, loop):
        ctx.save_for_backward(x, w, offs)
        ctx.loop = loop
        if x.shape[0] == 0:
            return x.new_empty((0, w.shape[2]))
        out = _gmm(x, w, offs, loop)
        return out if loop else zero_trailing_rows_(out, offs)

    @staticmethod
    def backward(ctx, grad):
        x, w, offs = ctx.saved_tensors
        gx = gw = None
        if x.shape[0] == 0:
            gx, gw = torch.zeros_like(x), torch.zeros_like(w)
        else:
            grad = contiguous(grad)
            if ctx.needs_input_grad[0]:  # w^T: column-major (E, N, K)
                gx = _gmm(grad, w.transpose(-2, -1), offs, ctx.loop)
                gx = gx if ctx.loop else zero_trailing_rows_(gx, offs)
            if ctx.needs_input_grad[1]:  # x^T column-major, grad row-major: 2-D x 2-D
                gw = _gmm(x.t(), grad, offs, ctx.loop)
        return gx, gw, None, None


# ---------------------------------------------------------------------------- public


def gemm_path(x: torch.Tensor, precision: str) -> str:
    """What runs: "scaled" (the FP8 op on torch's FP8 grouped GEMM), "reference" (plain
    torch: the FP8 precisions on CPU or without the GEMMs they use), "grouped" (torch's bf16
    grouped GEMM: CUDA bf16) or "loop" (the loop op: everything else)."""
    if precision == "fp8_rowwise":
        return "scaled" if x.is_cuda and HAS_SCALED_GROUPED_MM else "reference"
    if precision == "fp8_rowwise_gw_hp":
        ops = HAS_SCALED_GROUPED_MM and HAS_GROUPED_MM
        return "scaled" if x.is_cuda and ops else "reference"
    return "grouped" if x.is_cuda and x.dtype == torch.bfloat16 and HAS_GROUPED_MM else "loop"


def _check(x, w, offs, precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"grouped_mm: precision must be one of {PRECISIONS}, got {precision!r}")
    for name, t, dims in (("x", x, 2), ("w", w, 3)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims:
            what = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"grouped_mm: {name} must be a {dims}-D tensor, got {what}")
    dtypes = {"bf16": (torch.bfloat16, torch.float32, torch.float16),
              "fp8_rowwise": (torch.bfloat16, torch.float32),
              "fp8_rowwise_gw_hp": (torch.bfloat16,)}[precision]  # fmt: skip
    if x.dtype not in dtypes or w.dtype != x.dtype:
        raise TypeError(
            f"grouped_mm: x and w must share one dtype of {dtypes} for precision="
            f"{precision!r}, got {x.dtype} and {w.dtype}"
        )
    e, k, n = w.shape
    if x.shape[1] != k:
        raise ValueError(f"grouped_mm: x is [M, K={x.shape[1]}] but w is [E, K={k}, N={n}]")
    if e < 1:
        raise ValueError("grouped_mm: w must hold at least one expert")
    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or offs.shape != (e,):
        got = (offs.dtype, tuple(offs.shape)) if isinstance(offs, torch.Tensor) else type(offs)
        raise ValueError(
            f"grouped_mm: offs must be an int32 tensor [E={e}] of group end offsets, got {got}"
        )
    if not (x.device == w.device == offs.device):
        raise ValueError(
            f"grouped_mm: x, w and offs must be on one device, got {x.device}, {w.device} "
            f"and {offs.device}"
        )
    fp8 = precision != "bf16"
    multiple = 16 if fp8 else 16 // x.element_size()
    if (fp8 or gemm_path(x, precision) == "grouped") and (k % multiple or n % multiple):
        raise ValueError(
            f"grouped_mm: precision={precision!r} needs K and N multiples of {multiple} (16-byte "
            f"rows for the GEMM), got K={k}, N={n}: pad x's columns and w's rows to a multiple "
            f"of {multiple} with zeros (K), and w's columns (N), slicing the output"
        )
    if x.is_cuda and e > MAX_GROUPS:
        raise ValueError(f"grouped_mm: at most {MAX_GROUPS} experts on CUDA, got {e}")
    if fp8 and x.is_cuda and not torch.compiler.is_compiling():
        cap = capability(x.device)
        if cap < (9, 0):
            raise RuntimeError(
                f"grouped_mm: precision={precision!r} needs an sm_90+ GPU "
                f"(torch's FP8 grouped GEMM), got sm_{cap[0]}{cap[1]}; use precision='bf16'"
            )


def grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    *,
    precision: str = "bf16",
    validate: bool = False,
    fp8_weights: Fp8Weights | None = None,
) -> torch.Tensor:
    """out[offs[e-1]:offs[e]] = x[offs[e-1]:offs[e]] @ w[e] for every expert e.

    Args:
        x: [M, K] rows grouped by expert (bf16; fp32 also, and fp16 for "bf16"); M, K and
            N may be 0 (zeros, zero gradients).
        w: [E, K, N] the experts' weights, x's dtype.
        offs: int32 [E] group end offsets on x's device: non-decreasing, offs[-1] <= M; empty
            groups allowed. Rows past offs[-1] are ignored: zero output, zero gradient (and
            nothing added to w's gradient), whatever they hold. Not read on the host
            on CUDA for bf16 inputs and for "fp8_rowwise" (unless ``validate``); fp32/fp16
            inputs with "bf16" take the per-expert loop, which reads them (one host sync per
            GEMM).
        precision: "bf16": unscaled, in the inputs' dtype: torch.nn.functional.grouped_mm
            on CUDA for bf16 (K, N multiples of 8), else a per-expert loop (a custom op; on
            CUDA it reads offs on the host). "fp8_rowwise" (CUDA sm_90+; K, N multiples of
            16): e4m3 operands with fp32 scales, products accumulated in fp32, through
            torch.nn.functional.scaled_grouped_mm:
            forward x per row and w per (expert, output column); grad_x grad_out per row and
            w per (expert, row of K); grad_w both per (expert, column) along the tokens, with
            the per-group kernels. The output and gradients are rounded to bf16, then cast to
            the inputs' dtype. On CPU "fp8_rowwise" runs the plain-torch reference. torch's
            private torch._grouped_mm / torch._scaled_grouped_mm run where the public
            functions are missing (and the FP8 one while tracing where its public form has
            no meta kernel: torch_gemms.py); where torch has neither, the loop / the
            reference run instead (``HAS_GROUPED_MM``, ``HAS_SCALED_GROUPED_MM``).
            "fp8_rowwise_gw_hp" (bf16 inputs): the forward and grad_x of "fp8_rowwise",
            grad_w unscaled in bf16 as for "bf16" (torch's grouped GEMM): no per-group casts
            along the tokens, and grad_w as exact as bf16's. With the FP8 precisions, when
            x requires grad and w is large (``_config.WEIGHT_SCALES_IN_FORWARD_FROM``
            elements), the forward makes both FP8 copies of w in one pass
            (``fp8_rowwise_weights``: two reads of w instead of three) and keeps grad_x's
            for the backward: 1 byte per element of w held from forward to backward.
        fp8_weights: with the FP8 precisions, ``fp8_rowwise_weights(w)`` made earlier for this
            same, unchanged w: the call uses those casts instead of making its own (the
            caller vouches that w has not changed since; the results are the same bits).
            Ignored where the plain-torch reference runs.
        validate: check the values of offs with a clear error (reads them on the host, one
            synchronization on CUDA). CPU offsets are always checked. Without it bad offsets
            on CUDA give wrong rows, not an error.
    Returns:
        [M, N] in x's dtype, differentiable in x and w. torch.compile(fullgraph=True) traces
        it (the FP8 precisions' reference excepted: on CPU, or without torch's FP8 GEMM).
    """
    _check(x, w, offs, precision)
    if fp8_weights is not None:
        check_fp8_weights(w, fp8_weights, precision)
    offs = offs.contiguous()  # the kernels and torch's GEMMs read it densely
    if validate or (offs.device.type == "cpu" and not torch.compiler.is_compiling()):
        _host_bounds(offs, x.shape[0])
    if w.numel() == 0:  # K or N = 0 (torch's grouped GEMMs reject a 0 inner size): zeros,
        return x @ w.sum(0)  # and x's gradient zeros, through one plain matmul
    path = gemm_path(x, precision)
    if path == "reference":
        return grouped_mm_reference(x, w, offs, precision=precision)
    if path == "scaled":
        big = w.numel() >= _config.WEIGHT_SCALES_IN_FORWARD_FROM
        if fp8_weights is None and big and x.requires_grad and torch.is_grad_enabled():
            fp8_weights = fp8_rowwise_weights(w)  # grad_x's copy of w made with the forward's
        cached = [] if fp8_weights is None else list(fp8_weights)
        hp = precision == "fp8_rowwise_gw_hp"
        return fp8_rowwise_grouped_mm(x.contiguous(), w.contiguous(), offs, cached, hp)
    if path == "grouped":
        return _GroupedMM.apply(x.contiguous(), w.contiguous(), offs, False)
    return _GroupedMM.apply(x, w, offs, True)
