"""Bit-level helpers shared by the MXFP8 Triton kernels.

Every helper works on fp32/int32 tensors inside a kernel. Where the hardware has a
conversion instruction (fp32 -> e4m3, fp32 -> bf16, fp32 -> e8m0 on sm_100+) the
kernels use it; the ``SOFT`` variants compute the same bits with integer operations
and are used when Triton runs in its CPU interpreter, whose float casts do not round
to nearest even.
"""

import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)  # largest finite e4m3fn value


@triton.jit
def block_tile(tile, BLOCK_G: tl.constexpr, n_groups, groups_per_row):
    """The blocks of 32 that program ``tile`` handles: (mask, row, block within the row),
    each [BLOCK_G]; blocks are numbered row-major over rows of ``groups_per_row`` blocks."""
    g = tile * BLOCK_G + tl.arange(0, BLOCK_G)
    row = g // groups_per_row
    return g < n_groups, row, g - row * groups_per_row


@triton.jit
def skip_gap(row, gap_at, gap_len):
    """Row ``row`` of a tensor with rows [gap_at, gap_at + gap_len) of another cut out: the
    other tensor's row. gap_len = 0 maps every row to itself."""
    return row + (row >= gap_at).to(row.dtype) * gap_len


@triton.jit
def pow2(e):
    """2**e as fp32 for int32 ``e`` in [-126, 127] (built from the exponent field)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_from_amax_bits(amax_bits, RCEIL: tl.constexpr):
    """Scale byte (int32 in [0, 255]) of a block from ``amax_bits``, the int32 bits of |x|max.

    RCEIL: the byte of the smallest power of two >= fp32(amax / 448). Derived without a
    division: with amax = 1.m * 2^E, amax / 448 = (1.m / 1.75) * 2^(E-8), so the byte is
    E_field - 8, plus one when 1.m > 1.75 (mantissa field > 0x600000). Quotients that are
    fp32 subnormals give byte 1, except those that round to <= 2^-127 (byte 0): exactly
    the amax at or below 1.75 * 2^-119 plus one ulp (bits 0x04600001).
    FLOOR: E_field - 8, clamped at 0. Both: inf -> 254, NaN -> 255.
    """
    exp_field = amax_bits >> 23
    if RCEIL:
        b = exp_field - 8 + ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        b = tl.where(amax_bits > 0x04600001, tl.maximum(b, 1), 0)
    else:
        b = tl.maximum(exp_field - 8, 0)
    b = tl.where(amax_bits >= 0x7F800000, 254, b)
    return tl.where(amax_bits > 0x7F800000, 255, b)


@triton.jit
def e8m0_rceil_hw(amax):
    """RCEIL scale byte from the hardware ``cvt.rp.satfinite.ue8m0x2.f32`` (sm_100+)."""
    q = tl.math.div_rn(amax, E4M3_MAX)
    return (
        tl.inline_asm_elementwise(
            "{ .reg .b16 t; cvt.rp.satfinite.ue8m0x2.f32 t, $1, $1; cvt.u32.u16 $0, t; }",
            "=r,r",
            [q],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
        & 0xFF
    )


@triton.jit
def fp32_to_e4m3_bits(y, SOFT: tl.constexpr):
    """Round fp32 ``y`` (|y| <= 448 or NaN) to nearest-even e4m3fn; returns uint8 bits."""
    if SOFT:
        bits = y.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = bits & 0x7FFFFFFF
        # normal e4m3 (|y| >= 2^-6): round the mantissa from 23 to 3 bits, rebias 127 -> 7
        normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
        # subnormal e4m3: |y| / 2^-9 rounded to nearest even by the 2^23 trick
        t = tl.abs(y) * 512.0
        sub = ((t + 8388608.0) - 8388608.0).to(tl.int32)
        mag = tl.where(a >= (121 << 23), normal, sub)
        mag = tl.where(a > 0x7F800000, 0x7F, mag)
        return (mag | sign).to(tl.uint8)
    else:
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def e4m3_bits_to_fp32(u, SOFT: tl.constexpr):
    """Decode uint8 e4m3fn bits to fp32 (exact)."""
    if SOFT:
        v = u.to(tl.int32)
        e = (v >> 3) & 0xF
        m = v & 0x7
        normal = ((e + 120) << 23 | m << 20).to(tl.float32, bitcast=True)
        mag = tl.where(e > 0, normal, m.to(tl.float32) * 0.001953125)
        val = tl.where((v & 0x80) != 0, -mag, mag)
        return tl.where((v & 0x7F) == 0x7F, float("nan"), val)
    else:
        return u.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def to_fp32(x, SOFT: tl.constexpr):
    """Widen bf16/fp32 ``x`` to fp32 exactly (the interpreter flushes bf16 subnormals)."""
    if SOFT and x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def fp32_to_bf16(y, SOFT: tl.constexpr):
    """Round fp32 to nearest-even bf16."""
    if SOFT:
        bits = y.to(tl.int32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
        return (r & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return y.to(tl.bfloat16)


@triton.jit
def block_scale_bits(x, RCEIL: tl.constexpr, HW_E8M0: tl.constexpr):
    """The e8m0 scale byte (int32 [BLOCK_G]) of each row of 32 fp32 values ``x``: 255 where
    the row holds a NaN."""
    amax_bits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
    if HW_E8M0 and RCEIL:
        b = e8m0_rceil_hw(amax_bits.to(tl.float32, bitcast=True))
        return tl.where(amax_bits > 0x7F800000, 255, b)
    return e8m0_from_amax_bits(amax_bits, RCEIL)


@triton.jit
def mx_quantize_blocks(x, RCEIL: tl.constexpr, HW_E8M0: tl.constexpr, SOFT: tl.constexpr):
    """MXFP8-quantize fp32 ``x`` [BLOCK_G, 32], one block of 32 per row.

    Returns (e4m3 bits uint8 [BLOCK_G, 32], scale byte int32 [BLOCK_G]), bit for bit what
    quantize_reference gives.
    """
    b = block_scale_bits(x, RCEIL, HW_E8M0)
    # x * 2^(127 - b) as two exact power-of-two multiplies, each factor a normal fp32
    e = 127 - b
    e_lo = e >> 1
    y = x * pow2(e_lo)[:, None] * pow2(e - e_lo)[:, None]
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    y = tl.where((b == 255)[:, None], float("nan"), y)
    return fp32_to_e4m3_bits(y, SOFT), b


@triton.jit
def mx_dequantize_blocks(u, b, SOFT: tl.constexpr):
    """fp32 [BLOCK_G, 32] from e4m3 bits ``u`` (uint8 [BLOCK_G, 32]) and scale bytes ``b``
    (int32 [BLOCK_G]): e4m3 * 2^(b - 127), NaN where b == 255."""
    # two exact power-of-two multiplies, each factor a normal fp32
    e = b - 127
    e_lo = e >> 1
    y = e4m3_bits_to_fp32(u, SOFT) * pow2(e_lo)[:, None] * pow2(e - e_lo)[:, None]
    return tl.where((b == 255)[:, None], float("nan"), y)


@triton.jit
def store_float(ptrs, y, mask, SOFT: tl.constexpr):
    """Store fp32 ``y`` to bf16 (rounded to nearest even) or fp32 pointers."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        tl.store(ptrs, fp32_to_bf16(y, SOFT), mask=mask)
    else:
        tl.store(ptrs, y, mask=mask)
