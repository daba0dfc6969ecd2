"""Triton kernels of the static dispatch/combine's row movement (rows.py): rows
encoded for the wire straight into their slots, and decoded straight into their place.

Each kernel moves its bytes once: a source row is read once per output row it feeds (a
token's row once for its k slots, quantized once), every output byte is written once. A
program takes BLOCK_T rows x BLOCK_H columns as lanes of W columns: W = 32 for the "mxfp8"
wire (one MXFP8 block and its scale byte per lane), one lane per row for the "bf16" wire
(rows in their own dtype). Indices and addresses are int64 (a buffer may pass 2**31
bytes); -1 means no row.

Numbers: the references of rows.py bit for bit (MXFP8: formats/bits.py's bits in
fewer instructions, _quantize; decoded values and weights rounded to the working dtype
first; sums over j in order in fp32, one rounding, no FMA (enable_fp_fusion=False)), except
grad_w, summed per column block in the kernel and over the blocks in torch (the reference
within fp32 rounding, the same bits in every run).

Layers: kernels -> launchers (allocation, tiles, grid) -> custom ops ``mxfp8_a2a::moe_*``
(rows.py; push.py's for the encoders' ``*_into`` launchers with PUSH: rows
stored straight into the receive buffers of the group's ranks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import _config
from .._common import cdiv, check_e4m3_gpu, hw_e8m0, next_pow2
from ..exchange.rows import wire_row
from ..formats.bits import (
    block_scale_bits,
    e4m3_bits_to_fp32,
    fp32_to_bf16,
    fp32_to_e4m3_bits,
    store_float,
    to_fp32,
)
from ..formats.launch import launch

DTYPES = (torch.bfloat16, torch.float32)  # the rows the kernels take
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # read as they are (exact)


def wire_shape(rows: int, hidden: int, dtype: torch.dtype, wire: str) -> tuple[tuple, torch.dtype]:
    """(shape, dtype) of a wire buffer of ``rows`` rows of ``hidden`` values of ``dtype``."""
    if wire == "mxfp8":
        return (rows, wire_row(hidden)), torch.uint8
    return (rows, hidden), dtype


# ---------------------------------------------------------------------------- helpers


@triton.jit
def _lanes(first, h0, n_rows, hidden, BLOCK_T: tl.constexpr, NB: tl.constexpr, W: tl.constexpr,
           MX: tl.constexpr):  # fmt: skip
    """The lanes of rows [first, first + BLOCK_T) x columns [h0, h0 + NB * W): row (int64
    [L], L = BLOCK_T * NB), first column c0 [L], columns [L, W], lane mask [L] (row and c0
    in range) and element mask [L, W] (MX: [L, 1], a lane of 32 is in range or not: H % 32
    == 0; one predicate per lane, not per value)."""
    lane = tl.arange(0, BLOCK_T * NB)
    row = first + lane // NB
    c0 = h0 + (lane % NB) * W
    cols = c0[:, None] + tl.arange(0, W)[None, :]
    lmask = (row < n_rows) & (c0 < hidden)
    if MX:
        return row, c0, cols, lmask, lmask[:, None]
    else:
        return row, c0, cols, lmask, lmask[:, None] & (cols < hidden)


@triton.jit
def _rounded(y, BF16: tl.constexpr, SOFT: tl.constexpr):
    """fp32 ``y`` rounded to the working dtype (bf16 if BF16, else fp32), as fp32."""
    if BF16:
        return to_fp32(fp32_to_bf16(y, SOFT), SOFT)
    else:
        return y


@triton.jit
def _weight(w_ptr, i, mask, BF16: tl.constexpr, SOFT: tl.constexpr):
    """Weights (fp32/bf16/fp16) at ``i``, rounded to the working dtype, as fp32; 0 masked."""
    return _rounded(to_fp32(tl.load(w_ptr + i, mask=mask, other=0.0), SOFT), BF16, SOFT)


@triton.jit
def _wire_bytes(buf_ptr, row, c0, cols, mask, hidden, row_stride, MX: tl.constexpr):
    """The raw lanes of wire rows ``row`` (int64 [L], -1: none -> zeros): MX (e4m3 bits
    [L, W], scale bytes int32 [L]), else (values [L, W], c0)."""
    ok = row >= 0
    at = buf_ptr + row * row_stride
    if MX:
        u = tl.load(at[:, None] + cols, mask=mask & ok[:, None], other=0)
        return u, tl.load(at + hidden + c0 // 32, mask=ok, other=0).to(tl.int32)
    else:
        return tl.load(at[:, None] + cols, mask=mask & ok[:, None], other=0.0), c0


@triton.jit
def _decoded(u, b, MX: tl.constexpr, BF16: tl.constexpr, SOFT: tl.constexpr):
    """_wire_bytes's lanes decoded: MX the values rounded to the working dtype, as fp32
    (what decoding into rows gives), else the raw values."""
    if MX:
        return _rounded(_dequantize(u, b, SOFT), BF16, SOFT)
    else:
        return u


@triton.jit
def _load_wire(buf_ptr, row, c0, cols, mask, hidden, row_stride, MX: tl.constexpr,
               BF16: tl.constexpr, SOFT: tl.constexpr):  # fmt: skip
    """Lanes of wire rows ``row`` (int64 [L], -1: none -> zeros), decoded (_decoded)."""
    u, b = _wire_bytes(buf_ptr, row, c0, cols, mask, hidden, row_stride, MX)
    return _decoded(u, b, MX, BF16, SOFT)


@triton.jit
def _dequantize(u, b, SOFT: tl.constexpr):
    """mx_dequantize_blocks's values in one multiply: e4m3 * f, f = 2^(b - 127) (2^-127 a
    subnormal for b = 0) or NaN (b = 255). Exact: the e4m3 values are multiples of 2^-9
    below 2^9, so every product is an fp32 (normal, subnormal, or rounded to inf alike)."""
    f = tl.where(b == 255, 0x7FC00000, tl.where(b == 0, 0x00400000, b << 23))
    return e4m3_bits_to_fp32(u, SOFT) * f.to(tl.float32, bitcast=True)[:, None]


@triton.jit
def _quantize(x, RCEIL: tl.constexpr, HW_E8M0: tl.constexpr, SOFT: tl.constexpr):
    """Lanes of 32 values -> (e4m3 bits uint8 [L, 32], scale bytes uint8 [L]), the bits of
    mx_quantize_blocks with fewer instructions per value: x times one factor 2^(127 - b)
    (2^-127 a subnormal for b = 254; NaN for b = 255, whose product is NaN) and, on the
    GPU, the conversion's own saturation (to +-448, inf included) in place of the clamp.
    The same e4m3 bits: where the one rounding of x * 2^(127 - b) differs from two exact
    steps, the value is below 2^-126, an e4m3 zero of x's sign either way."""
    x = to_fp32(x, SOFT)
    b = block_scale_bits(x, RCEIL, HW_E8M0)
    f = tl.where(b == 255, 0x7FC00000, tl.where(b == 254, 0x00400000, (254 - b) << 23))
    y = x * f.to(tl.float32, bitcast=True)[:, None]
    if SOFT:  # (the interpreter's casts neither round to nearest even nor saturate)
        y = tl.where((b == 255)[:, None], float("nan"), tl.minimum(tl.maximum(y, -448.0), 448.0))
        q = fp32_to_e4m3_bits(y, SOFT)
    else:
        q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return q, b.to(tl.uint8)


@triton.jit
def _store_wire(buf_ptr, row, c0, cols, mask, v, s, hidden, row_stride, cap, MX: tl.constexpr,
                PUSH: tl.constexpr):  # fmt: skip
    """Store lanes at wire rows ``row`` (int64 [L], -1: none): values ``v`` [L, W] (MX:
    e4m3 bits, ``s`` the scale bytes [L]; the lanes at column 0 zero their row's pad, the
    row_stride - 33 * hidden / 32 bytes past the scales). PUSH: buf_ptr is an int64 table
    [W] of addresses (where this rank's rows start in each rank's receive buffer) and row r
    goes to row r % cap there, of table[r // cap] (an all-to-all of equal splits ``cap``)."""
    ok = row >= 0
    if PUSH:
        r = tl.where(ok, row, 0).to(tl.int32)  # (send rows < 2**31: int32 division is cheaper)
        peer = r // cap
        base = tl.load(buf_ptr + peer, mask=ok, other=0).to(tl.pointer_type(v.dtype))
        # (rows of a multiple of 16 bytes from 16-byte aligned regions, push.check_fits:
        # said here, so that the stores are 16-byte vectors, as into a buffer argument)
        at = tl.multiple_of(base + (r - peer * cap).to(tl.int64) * row_stride, 16)
    else:
        at = buf_ptr + row * row_stride
    tl.store(at[:, None] + cols, v, mask=mask & ok[:, None])
    if MX:
        tl.store(at + hidden + c0 // 32, s, mask=ok)
        p = tl.arange(0, 16)
        pad = at + hidden + hidden // 32
        pmask = (ok & (c0 == 0))[:, None] & (p < row_stride - hidden - hidden // 32)[None, :]
        tl.store(pad[:, None] + p[None, :], tl.zeros([16], dtype=tl.uint8)[None, :], mask=pmask)


# ---------------------------------------------------------------------------- kernels
# Program (i, c) of the one-pass kernels: rows [i * BLOCK_T, ...), columns [c * NB * W, ...).


@triton.jit
def _scatter_encode_kernel(
    x_ptr, rows_of_ptr, buf_ptr, n_tokens, hidden, stride_x, row_stride, cap,
    K: tl.constexpr, MX: tl.constexpr, RCEIL: tl.constexpr, HW_E8M0: tl.constexpr,
    SOFT: tl.constexpr, BLOCK_T: tl.constexpr, NB: tl.constexpr, W: tl.constexpr,
    PUSH: tl.constexpr,
):  # fmt: skip
    """x [n_tokens, hidden] (row stride stride_x) -> buf[rows_of[t, j]] = encode(x[t]) for
    rows_of int64 [n_tokens, K]; each tile read and encoded once, stored K times."""
    first = tl.program_id(0).to(tl.int64) * BLOCK_T
    h0 = tl.program_id(1) * (NB * W)
    t, c0, cols, lmask, mask = _lanes(first, h0, n_tokens, hidden, BLOCK_T, NB, W, MX)
    x = tl.load(x_ptr + t[:, None] * stride_x + cols, mask=mask, other=0.0)
    if MX:
        v, s = _quantize(x, RCEIL, HW_E8M0, SOFT)
    else:
        v, s = x, c0
    for j in tl.static_range(K):
        row = tl.load(rows_of_ptr + t * K + j, mask=lmask, other=-1)
        _store_wire(buf_ptr, row, c0, cols, mask, v, s, hidden, row_stride, cap, MX, PUSH)


@triton.jit
def _gather_encode_kernel(
    y_ptr, index_ptr, buf_ptr, n_out, hidden, stride_y, row_stride, cap,
    MX: tl.constexpr, RCEIL: tl.constexpr, HW_E8M0: tl.constexpr, SOFT: tl.constexpr,
    BLOCK_T: tl.constexpr, NB: tl.constexpr, W: tl.constexpr, PUSH: tl.constexpr,
):  # fmt: skip
    """buf[i] = encode(y[index[i]]) (zeros where index[i] = -1; PUSH: not written) for
    i < n_out."""
    first = tl.program_id(0).to(tl.int64) * BLOCK_T
    h0 = tl.program_id(1) * (NB * W)
    i, c0, cols, lmask, mask = _lanes(first, h0, n_out, hidden, BLOCK_T, NB, W, MX)
    src = tl.load(index_ptr + i, mask=lmask, other=-1)
    x = tl.load(y_ptr + src[:, None] * stride_y + cols, mask=mask & (src >= 0)[:, None], other=0.0)
    if MX:
        v, s = _quantize(x, RCEIL, HW_E8M0, SOFT)
    else:
        v, s = x, c0
    if PUSH:  # (no zero rows on the wire: receivers read only the rows sent to them)
        row = tl.where(lmask & (src >= 0), i, -1)
    else:
        row = tl.where(lmask, i, -1)
    _store_wire(buf_ptr, row, c0, cols, mask, v, s, hidden, row_stride, cap, MX, PUSH)


@triton.jit
def _gather_decode_kernel(
    buf_ptr, index_ptr, out_ptr, n_out, hidden, row_stride,
    MX: tl.constexpr, BF16: tl.constexpr, SOFT: tl.constexpr, BLOCK_T: tl.constexpr,
    NB: tl.constexpr, W: tl.constexpr,
):  # fmt: skip
    """out [n_out, hidden] (bf16/fp32): out[i] = decode(buf[index[i]]), zeros for -1."""
    first = tl.program_id(0).to(tl.int64) * BLOCK_T
    h0 = tl.program_id(1) * (NB * W)
    i, c0, cols, lmask, mask = _lanes(first, h0, n_out, hidden, BLOCK_T, NB, W, MX)
    src = tl.load(index_ptr + i, mask=lmask, other=-1)
    v = _load_wire(buf_ptr, src, c0, cols, mask, hidden, row_stride, MX, BF16, SOFT)
    at = out_ptr + i[:, None] * hidden + cols
    if MX:
        store_float(at, v, mask, SOFT)
    else:
        tl.store(at, v, mask=mask)


@triton.jit
def _slot_sum_decode_kernel(
    buf_ptr, rows_of_ptr, w_ptr, out_ptr, n_tokens, hidden, row_stride,
    K: tl.constexpr, UNIT: tl.constexpr, MX: tl.constexpr, BF16: tl.constexpr,
    SOFT: tl.constexpr, BLOCK_T: tl.constexpr, NB: tl.constexpr, W: tl.constexpr,
):  # fmt: skip
    """out [n_tokens, hidden] = sum_j w[t, j] * decode(buf[rows_of[t, j]]) over the slots
    that hold a row (UNIT: w all 1), as slot_sum_reference."""
    first = tl.program_id(0).to(tl.int64) * BLOCK_T
    h0 = tl.program_id(1) * (NB * W)
    t, c0, cols, lmask, mask = _lanes(first, h0, n_tokens, hidden, BLOCK_T, NB, W, MX)
    acc = tl.zeros([BLOCK_T * NB, W], dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(rows_of_ptr + t * K + j, mask=lmask, other=-1)
        raw = _load_wire(buf_ptr, row, c0, cols, mask, hidden, row_stride, MX, BF16, SOFT)
        r = to_fp32(raw, SOFT)
        if UNIT:
            acc += r
        else:
            acc += _weight(w_ptr, t * K + j, row >= 0, BF16, SOFT)[:, None] * r
    store_float(out_ptr + t[:, None] * hidden + cols, acc, mask, SOFT)


# ---------------------------------------------------------------------------- launchers
# Tensors in, new tensors out (checked by rows.py); no launch for empty inputs.


def _tile(
    hidden: int, rows: int, mx: bool, soft: bool, elems: int | None = None
) -> tuple[int, int, int]:
    """(BLOCK_T, NB, W) of the one-pass kernels: BLOCK_H, the widest power of two up to the
    cap that pads the row by at most 1/8 (not below 32), and rows up to the tile's size
    (``elems`` elements on the GPU, STATIC_ROWS_TILE by default)."""
    if soft:
        elems, cap = _config.INTERPRET_STATIC_ROWS_TILE, _config.INTERPRET_STATIC_ROWS_BLOCK_H
    else:
        elems, cap = elems or _config.STATIC_ROWS_TILE, _config.STATIC_ROWS_BLOCK_H
    bh = min(next_pow2(hidden), cap)
    while bh > 32 and cdiv(hidden, bh) * bh - hidden > hidden // 8:
        bh //= 2
    bt = min(max(elems // bh, 1), next_pow2(rows))
    return (bt, bh // 32, 32) if mx else (bt, 1, bh)


def _unit_cols(t: Tensor) -> Tensor:
    """t [R, C] with unit column stride (the kernels take any row stride)."""
    return t if t.stride(1) == 1 else t.contiguous()


def _consts(wire: str, device: torch.device, scaling_mode: str | None = None) -> dict:
    """MX (and with a scaling mode RCEIL, HW_E8M0), the kernels' first wire constants."""
    if wire == "mxfp8":
        check_e4m3_gpu(device)
    out = dict(MX=wire == "mxfp8")
    if scaling_mode is not None:
        out.update(RCEIL=scaling_mode == "rceil", HW_E8M0=hw_e8m0(device))
    return out


def _launch(kernel, rows: int, hidden: int, args: tuple, consts: dict, wire: str) -> None:
    """A one-pass kernel over tiles of rows x columns (_tile)."""
    soft = args[0].device.type == "cpu"
    bt, nb, w = _tile(hidden, rows, wire == "mxfp8", soft)
    consts.update(SOFT=soft, BLOCK_T=bt, NB=nb, W=w)
    grid = (cdiv(rows, bt), cdiv(hidden, nb * w))
    launch(kernel, grid, args, consts, _config.STATIC_ROWS_NUM_WARPS, enable_fp_fusion=False)


def scatter_encode_into(x: Tensor, rows_of: Tensor, dest: Tensor, row_stride: int, cap: int,
                        wire: str, scaling_mode: str, push: bool) -> None:  # fmt: skip
    """The scatter_encode kernel into ``dest``: a wire buffer (row_stride elements a row), or
    with ``push`` an int64 table [W] of addresses (_store_wire's PUSH)."""
    (t, h), k = x.shape, rows_of.shape[1]
    if min(t, k, h) > 0:
        x = _unit_cols(x)
        args = (x, rows_of.contiguous(), dest, t, h, x.stride(0), row_stride, cap)
        consts = dict(K=k, PUSH=push, **_consts(wire, x.device, scaling_mode))
        _launch(_scatter_encode_kernel, t, h, args, consts, wire)


def gather_encode_into(y: Tensor, index: Tensor, dest: Tensor, row_stride: int, cap: int,
                       wire: str, scaling_mode: str, push: bool) -> None:  # fmt: skip
    """The gather_encode kernel into ``dest`` (as scatter_encode_into) for index int64 [R]."""
    (n, h), r = y.shape, index.numel()
    if min(n, r, h) > 0:
        y = _unit_cols(y)
        args = (y, index.contiguous(), dest, r, h, y.stride(0), row_stride, cap)
        consts = dict(PUSH=push, **_consts(wire, y.device, scaling_mode))
        _launch(_gather_encode_kernel, r, h, args, consts, wire)


def scatter_encode(x: Tensor, rows_of: Tensor, n_rows: int, wire: str, scaling_mode: str) -> Tensor:
    """x bf16/fp32 [T, H], rows_of int64 [T, k] (values < n_rows) -> wire buffer [n_rows]
    with encode(x[t]) at every rows_of[t, j] >= 0; rows no token targets left unwritten."""
    shape, dtype = wire_shape(n_rows, x.shape[1], x.dtype, wire)
    buf = torch.empty(shape, dtype=dtype, device=x.device)
    if n_rows:
        scatter_encode_into(x, rows_of, buf, buf.stride(0), 1, wire, scaling_mode, False)
    return buf


def gather_encode(y: Tensor, index: Tensor, wire: str, scaling_mode: str) -> Tensor:
    """y bf16/fp32 [N, H], index int64 [R] -> wire buffer [R]: encode(y[index[i]]), zero rows
    (all zero bytes for "mxfp8") where index[i] = -1."""
    shape, dtype = wire_shape(index.numel(), y.shape[1], y.dtype, wire)
    if min(*y.shape, index.numel()) == 0:  # (without rows to read, every index is -1)
        return torch.zeros(shape, dtype=dtype, device=y.device)
    buf = torch.empty(shape, dtype=dtype, device=y.device)
    gather_encode_into(y, index, buf, buf.stride(0), 1, wire, scaling_mode, False)
    return buf


def gather_decode(buf: Tensor, index: Tensor, hidden: int, dtype: torch.dtype, wire: str) -> Tensor:
    """buf: wire rows ("bf16": of ``dtype``); index int64 [N] -> [N, hidden] of ``dtype``
    (bf16/fp32): decode(buf[index[i]]), zeros where index[i] = -1."""
    n = index.numel()
    if min(buf.shape[0], n, hidden) == 0:
        return torch.zeros((n, hidden), dtype=dtype, device=buf.device)
    out, buf = torch.empty((n, hidden), dtype=dtype, device=buf.device), _unit_cols(buf)
    args = (buf, index.contiguous(), out, n, hidden, buf.stride(0))
    consts = dict(**_consts(wire, buf.device), BF16=dtype == torch.bfloat16)
    _launch(_gather_decode_kernel, n, hidden, args, consts, wire)
    return out


def _weights(weights: Tensor, dtype: torch.dtype) -> Tensor:
    """Weights the kernels read as they are (others rounded to ``dtype`` here, once)."""
    return (weights if weights.dtype in WEIGHT_DTYPES else weights.to(dtype)).contiguous()


def slot_sum_decode(
    buf: Tensor, rows_of: Tensor, weights: Tensor | None, hidden: int, dtype: torch.dtype,
    wire: str,
) -> Tensor:  # fmt: skip
    """buf: wire rows; rows_of int64 [T, k]; weights floating [T, k] or None (all 1) ->
    [T, hidden] of ``dtype`` (bf16/fp32): sum_j w[t, j] * decode(buf[rows_of[t, j]]) over
    the slots that hold a row."""
    t, k = rows_of.shape
    if min(t, k, hidden, buf.shape[0]) == 0:  # (without rows, every slot is -1)
        return torch.zeros((t, hidden), dtype=dtype, device=buf.device)
    out = torch.empty((t, hidden), dtype=dtype, device=buf.device)
    buf, rows_of = _unit_cols(buf), rows_of.contiguous()
    w = rows_of if weights is None else _weights(weights, dtype)
    consts = dict(K=k, UNIT=weights is None, **_consts(wire, buf.device))
    consts["BF16"] = dtype == torch.bfloat16
    args = (buf, rows_of, w, out, t, hidden, buf.stride(0))
    _launch(_slot_sum_decode_kernel, t, hidden, args, consts, wire)
    return out
