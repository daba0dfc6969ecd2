"""Triton quantize/dequantize kernels against the torch reference, bit for bit.

Runs on CPU through the Triton interpreter (CI) and compiled on CUDA (GPU machines).
"""

from __future__ import annotations

import pytest
import torch
from helpers import KERNEL_DEVICES, bits, fresh_generator, random_blocks, sqnr_db, with_specials

import mxfp8_a2a as mx

MODES = ["rceil", "floor"]
DTYPES = [torch.bfloat16, torch.float32]
SHAPES = [(1, 32), (7, 96), (37, 160), (130, 64), (3, 5, 128)]


def _check_quantize(x: torch.Tensor, mode: str) -> None:
    ref_data, ref_scales = mx.quantize_reference(x, mode)
    data, scales = mx.quantize(x, scaling_mode=mode, backend="triton")
    assert data.dtype == torch.float8_e4m3fn and scales.dtype == torch.float8_e8m0fnu
    assert data.shape == x.shape and scales.shape == (*x.shape[:-1], x.shape[-1] // 32)
    assert torch.equal(bits(scales), bits(ref_scales))
    assert torch.equal(bits(data), bits(ref_data))
    packed = mx.quantize_packed(x, scaling_mode=mode, backend="triton")
    assert torch.equal(packed, mx.pack(ref_data, ref_scales))


def _check_dequantize(data: torch.Tensor, scales: torch.Tensor) -> None:
    packed = mx.pack(data, scales)
    for out_dtype in DTYPES:
        ref = mx.dequantize_reference(data, scales, out_dtype)
        out = mx.dequantize(data, scales, out_dtype=out_dtype, backend="triton")
        torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)
        out = mx.dequantize_packed(packed, out_dtype=out_dtype, backend="triton")
        torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_random(device, mode, dtype, shape):
    g = fresh_generator(device)
    x = random_blocks(shape, dtype, device, g)
    _check_quantize(x, mode)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_special_values(device, mode, dtype):
    g = fresh_generator(device)
    x = with_specials(random_blocks((24, 128), dtype, device, g), fresh_generator())
    _check_quantize(x, mode)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_quantize_boundary_amax(device, mode):
    """amax right at the RCEIL/FLOOR switch points, including subnormal quotients."""
    base = torch.tensor([448.0 * 2.0**e for e in range(-130, 120, 7)] + [1.75 * 2.0**-119])
    steps = torch.arange(-3, 4).float()
    amax = torch.stack([torch.nextafter(base, base * 2) for _ in range(1)]).flatten()
    vals = base.view(torch.int32)[:, None] + steps.int()[None, :]
    amax = vals.flatten().view(torch.float32)
    x = torch.rand(len(amax), 64, generator=fresh_generator()) * amax[:, None]
    x[:, 7] = amax
    x[:, 40] = -amax
    _check_quantize(x.to(device), mode)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_non_contiguous(device, dtype):
    g = fresh_generator(device)
    x = random_blocks((64, 96), dtype, device, g)
    _check_quantize(x[::3], "rceil")  # row stride 3 * 96
    _check_quantize(x[:, 32:], "rceil")  # row stride 96, K = 64
    _check_quantize(random_blocks((96, 64), dtype, device, g).t(), "floor")  # K-stride 64


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("shape", [(0, 64), (5, 0), (2, 3, 0), (0, 0)])
def test_empty_sizes(device, shape):
    """No rows or K = 0: every cast gives the reference's (empty) shapes."""
    x = torch.empty(shape, device=device, dtype=torch.bfloat16)
    data, scales = mx.quantize(x, backend="triton")
    want_d, want_s = mx.quantize_reference(x)
    assert data.shape == want_d.shape and scales.shape == want_s.shape
    packed = mx.quantize_packed(x, backend="triton")
    assert packed.shape == (*shape[:-1], mx.packed_row_bytes(shape[-1]))
    assert mx.dequantize(data, scales, backend="triton").shape == shape
    assert mx.dequantize_packed(packed, backend="triton").shape == shape
    assert mx.quantize_dequantize(x, backend="triton").shape == shape


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_cast_ops_pass_opcheck(device):
    """The custom ops' fakes agree with them (shapes, dtypes, strides), also for transposed
    and sliced inputs (finite data: opcheck compares outputs with NaN != NaN)."""
    g = fresh_generator()  # the data is drawn on the CPU
    base = (torch.randn(96, 64, generator=g, device="cpu") * 4).to(device)
    ops = torch.ops.mxfp8_a2a
    # the fake and autograd checks (the schema check multiplies fp8 outputs: not on CPU)
    checks = dict(test_utils=("test_faketensor", "test_autograd_registration"))
    for x in (base, base.t(), base[:, 32:], base.bfloat16()[::2]):
        data, scales = mx.quantize(x)
        for op, args in [
            (ops.quantize, (x, "rceil")),
            (ops.quantize_packed, (x, "floor")),
            (ops.quantize_dequantize, (x, "rceil")),
            (ops.dequantize, (data, scales, "bfloat16")),
            (ops.dequantize_packed, (mx.quantize_packed(x), "float32")),
        ]:
            torch.library.opcheck(op, args, **checks)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
def test_dequantize_random_bytes(device, shape):
    """Every byte pattern: random e4m3 bytes (NaN codes included) and all scale bytes."""
    g = fresh_generator(device)
    data = torch.randint(0, 256, shape, generator=g, device=device, dtype=torch.uint8)
    scale_shape = (*shape[:-1], shape[-1] // 32)
    scales = torch.randint(0, 256, scale_shape, generator=g, device=device, dtype=torch.uint8)
    scales.view(-1)[0] = 0
    scales.view(-1)[-1] = 255
    _check_dequantize(data.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_sqnr(device, mode, dtype):
    g = fresh_generator(device)
    x = torch.randn(64, 512, generator=g, device=device).to(dtype)  # 32768 values
    y = mx.dequantize(
        *mx.quantize(x, scaling_mode=mode, backend="triton"),
        out_dtype=torch.float32,
        backend="triton",
    )
    assert sqnr_db(x, y) >= 28.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_more_than_2_31_elements():
    """64-bit offsets: rows past element 2**31 are quantized like the reference."""
    g = fresh_generator("cuda")
    m, k = 2**31 // 4096 + 17, 4096
    x = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    tail = random_blocks((64, k), torch.bfloat16, "cuda", g)
    x[-64:] = tail
    packed = mx.quantize_packed(x)
    data, scales = mx.quantize(x)
    ref_data, ref_scales = mx.quantize_reference(tail)
    assert torch.equal(bits(data[-64:]), bits(ref_data))
    assert torch.equal(bits(scales[-64:]), bits(ref_scales))
    assert torch.equal(packed[-64:], mx.pack(ref_data, ref_scales))
    out = mx.dequantize_packed(packed)
    torch.testing.assert_close(
        out[-64:], mx.dequantize_reference(ref_data, ref_scales), rtol=0, atol=0
    )
    del x, packed, data, scales, out


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_torch_compile_fullgraph(device):
    backend = "inductor" if device == "cuda" else "aot_eager"

    @torch.compile(fullgraph=True, backend=backend)
    def round_trip(x):
        packed = mx.quantize_packed(x)
        data, scales = mx.quantize(x, scaling_mode="floor")
        return mx.dequantize_packed(packed), mx.dequantize(data, scales)

    g = fresh_generator(device)
    x = random_blocks((16, 128), torch.bfloat16, device, g)
    a, b = round_trip(x)
    torch.testing.assert_close(
        a, mx.dequantize_reference(*mx.quantize_reference(x)), rtol=0, atol=0
    )
    torch.testing.assert_close(
        b, mx.dequantize_reference(*mx.quantize_reference(x, "floor")), rtol=0, atol=0
    )


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: mx.quantize(torch.randn(4, 48)), ValueError, r"x.shape\[-1\] \(K=48\)"),
        (
            lambda: mx.quantize(torch.ones(4, 32, dtype=torch.int32)),
            TypeError,
            "x must be bfloat16",
        ),
        (lambda: mx.quantize(torch.randn(4, 32), scaling_mode="ceil"), ValueError, "scaling_mode"),
        (lambda: mx.quantize(torch.randn(4, 32), backend="cuda"), ValueError, "backend"),
        (lambda: mx.quantize_packed(torch.randn(4, 33)), ValueError, "multiple of 32"),
        (
            lambda: mx.dequantize(
                torch.zeros(4, 64, dtype=torch.float8_e4m3fn),
                torch.zeros(4, 3, dtype=torch.float8_e8m0fnu),
            ),
            ValueError,
            "scales must have shape",
        ),
        (
            lambda: mx.dequantize(
                torch.zeros(4, 64), torch.zeros(4, 2, dtype=torch.float8_e8m0fnu)
            ),
            TypeError,
            "data must be float8_e4m3fn",
        ),
        (
            lambda: mx.dequantize(
                torch.zeros(4, 64, dtype=torch.float8_e4m3fn),
                torch.zeros(4, 2, dtype=torch.float8_e8m0fnu),
                out_dtype=torch.float16,
            ),
            TypeError,
            "out_dtype",
        ),
        (
            lambda: mx.dequantize_packed(torch.zeros(4, 64, dtype=torch.uint8)),
            ValueError,
            "packed.shape",
        ),
        (lambda: mx.dequantize_packed(torch.zeros(4, 66)), TypeError, "packed must be a uint8"),
    ],
)
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("gap", [(0, 0), (0, 40), (12, 10), (30, 10), (40, 0), (5, 1)])
def test_gap_launch_skips_rows(device, gap):
    """The exchange's launches: quantize of x with rows [at, at + n) cut out, dequantize into
    out leaving those rows untouched, with a capped grid (programs loop over tiles)."""
    from mxfp8_a2a.formats.dequantize import _launch as dequantize_launch
    from mxfp8_a2a.formats.quantize import _launch as quantize_launch

    g = fresh_generator(device)
    x = random_blocks((40, 96), torch.bfloat16, device, g)
    at, n = gap
    keep = torch.cat([x[:at], x[at + n :]])
    row = mx.packed_row_bytes(96)
    buf = torch.empty(40 - n, row, dtype=torch.uint8, device=device)
    quantize_launch(x, buf, buf[:, 96:], row, row, "rceil", gap, max_programs=3)
    assert torch.equal(buf, mx.quantize_packed(keep, backend="torch"))
    out = torch.full((40, 96), 7.0, dtype=torch.bfloat16, device=device)
    dequantize_launch(buf, buf[:, 96:], row, row, out, gap, max_programs=2)
    want = torch.full_like(out, 7.0)
    y = mx.dequantize_packed(buf, backend="torch")
    want[:at], want[at + n :] = y[:at], y[at:]
    assert torch.equal(out, want)


def _same_bits_nan_as_nan(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit for bit, except that any NaN matches any NaN (NaN payloads are not specified)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.isnan(), b.isnan())
    ints = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    assert torch.equal(a.nan_to_num(0).view(ints), b.nan_to_num(0).view(ints))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:4])
def test_quantize_dequantize_matches_reference(device, mode, dtype, shape):
    g = fresh_generator(device)
    x = random_blocks(shape, dtype, device, g)
    if shape[0] >= 8:
        x = with_specials(x, fresh_generator())
    y = mx.quantize_dequantize(x, scaling_mode=mode, backend="triton")
    _same_bits_nan_as_nan(y, mx.quantize_dequantize_reference(x, mode))
    two_pass = mx.dequantize(*mx.quantize(x, scaling_mode=mode, backend="triton"), out_dtype=dtype)
    _same_bits_nan_as_nan(y, two_pass.to(y.device))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_quantize_dequantize_strided_and_empty(device):
    g = fresh_generator(device)
    x = random_blocks((64, 96), torch.float32, device, g)
    for view in (x[::3], x[:, 32:], x[:0]):
        y = mx.quantize_dequantize(view, backend="triton")
        _same_bits_nan_as_nan(y, mx.quantize_dequantize_reference(view))
