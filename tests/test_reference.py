"""The torch reference against an independent, per-element, exact-arithmetic formula."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from helpers import bits, fresh_generator, random_blocks

from mxfp8_a2a import dequantize_reference, quantize_reference

# every finite e4m3fn value, as an exact fraction, with its byte
_E4M3 = [
    (Fraction(v), code)
    for code, v in enumerate(
        torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    )
    if math.isfinite(v) and code < 128
]


def _round_e4m3(v: Fraction) -> int:
    """Nearest e4m3fn byte to v (|v| <= 448), ties to the even mantissa."""
    mag = abs(v)
    best = min(_E4M3, key=lambda fc: (abs(fc[0] - mag), fc[1] & 1))
    return best[1] | (0x80 if v < 0 or (v == 0 and math.copysign(1, float(v)) < 0) else 0)


def _scale_byte(amax: float, mode: str) -> int:
    if math.isnan(amax):
        return 255
    if math.isinf(amax):
        return 254
    if mode == "rceil":
        q = float(np.float32(amax) / np.float32(448.0))  # the fp32 quotient
        return next(k + 127 for k in range(-127, 128) if Fraction(2) ** k >= Fraction(q))
    if amax == 0:
        return 0
    return min(max(math.floor(math.log2(Fraction(amax))) - 8 + 127, 0), 254)


def _quantize_block(xs: list[float], mode: str) -> tuple[list[int], int]:
    amax = max((abs(v) for v in xs), key=lambda a: (math.isnan(a), a))
    if any(math.isnan(v) for v in xs):
        return [0x7F] * len(xs), 255
    b = _scale_byte(amax, mode)
    out = []
    for v in xs:
        if math.isinf(v):
            out.append(0x7E | (0x80 if v < 0 else 0))  # saturates to +-448
            continue
        y = Fraction(v) * Fraction(2) ** (127 - b)
        y = max(min(y, Fraction(448)), Fraction(-448))
        code = _round_e4m3(y)
        if y == 0 and math.copysign(1, v) < 0:
            code |= 0x80
        out.append(code)
    return out, b


@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_exact_formula(mode, dtype):
    g = fresh_generator()
    x = random_blocks((3, 96), dtype, "cpu", g)
    specials = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-38, 3e-36, 1e-40, 448.0]
    x[0, : len(specials)] = torch.tensor(specials, dtype=dtype)
    x[1, 32:64] = 448.0 * 2.0**-3  # exactly a power of two times 448: no round-up
    x[1, 70] = -float("inf")  # an inf block without NaN
    x[2, 64:96] = torch.tensor(2.0**-125, dtype=dtype) * torch.rand(32, generator=g).to(dtype)
    data, scales = quantize_reference(x, mode)
    for m in range(x.shape[0]):
        for blk in range(x.shape[1] // 32):
            xs = x[m, blk * 32 : (blk + 1) * 32].float().tolist()
            want_data, want_scale = _quantize_block(xs, mode)
            assert bits(scales)[m, blk].item() == want_scale, (m, blk, xs)
            assert bits(data)[m, blk * 32 : (blk + 1) * 32].tolist() == want_data, (m, blk)


def test_rceil_boundary_quotients():
    """Quotients near 2^-127 and 2^-126 and exact powers of two pick the right byte."""
    base = torch.tensor(448.0 * 2.0**-127, dtype=torch.float32)
    neighbors = [base]
    for _ in range(4):
        neighbors.append(torch.nextafter(neighbors[-1], torch.tensor(1.0)))
    cases = torch.stack(
        neighbors
        + [torch.tensor(448.0 * 2.0**-126), torch.tensor(448.0), torch.tensor(449.0)]
        + [torch.tensor(v) for v in (1e-45, 2e-43, 1.0, 3.0e38)]
    )
    x = torch.zeros(len(cases), 32)
    x[:, 5] = cases
    _, scales = quantize_reference(x, "rceil")
    want = [_scale_byte(v, "rceil") for v in cases.tolist()]
    assert bits(scales)[:, 0].tolist() == want


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dequantize_reference_exact(out_dtype):
    g = fresh_generator()
    data = torch.randint(0, 256, (4, 64), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 256, (4, 2), generator=g, dtype=torch.uint8)
    scales[0, 0], scales[1, 1], scales[2, 0] = 0, 254, 255
    out = dequantize_reference(
        data.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu), out_dtype
    )
    vals = data.view(torch.float8_e4m3fn).float().double()
    want = vals * torch.exp2(scales.double() - 127).repeat_interleave(32, dim=1)
    want[(scales == 255).repeat_interleave(32, dim=1)] = float("nan")
    torch.testing.assert_close(out, want.to(out_dtype), rtol=0, atol=0, equal_nan=True)


def test_imports_under_python_OO():
    """python -OO strips docstrings; the package must not rely on them at import."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-OO", "-c", "import mxfp8_a2a"],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
