"""Shared test data and device lists."""

from __future__ import annotations

import pytest
import torch

from mxfp8_a2a._common import interpreted
from mxfp8_a2a.formats.quantize import _quantize_kernel

# Where the Triton kernels can run in this process: CPU through the interpreter, or CUDA.
KERNEL_DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            not interpreted(_quantize_kernel),
            reason="Triton kernels on CPU need TRITON_INTERPRET=1",
        ),
    ),
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    ),
]


def fresh_generator(device: str = "cpu") -> torch.Generator:
    """A generator seeded from the OS, so every run draws new data; its seed is in the name."""
    g = torch.Generator(device=device)
    g.seed()
    return g


def random_blocks(
    shape: tuple[int, ...], dtype: torch.dtype, device: str, g: torch.Generator
) -> torch.Tensor:
    """Random normal data whose blocks of 32 span many magnitudes (2^-40 .. 2^40)."""
    k = shape[-1]
    x = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
    block_exp = torch.randint(-40, 41, (*shape[:-1], max(k // 32, 1)), generator=g, device=device)
    x = x * torch.exp2(block_exp.float()).repeat_interleave(32, dim=-1)[..., :k]
    return x.to(dtype)


def with_specials(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Plant special blocks in a copy of x [M, K] (M >= 8): NaN, +-inf, zeros, subnormal,
    tiny, huge, exact powers of two times 448, a -0 block."""
    x = x.clone()
    m, k = x.shape
    f32 = torch.finfo(torch.float32)
    rows = torch.randperm(m, generator=g, device="cpu")[:8].tolist()
    x[rows[0], 3] = float("nan")
    x[rows[1], k - 1] = float("inf")
    x[rows[2], 0] = -float("inf")
    x[rows[3], :32] = 0.0
    x[rows[4], :32] = -0.0
    tiny = torch.randn(k, generator=g, device="cpu") * f32.smallest_normal
    x[rows[5]] = tiny.to(x.device, x.dtype)
    x[rows[6], :32] = (448.0 * 2.0 ** torch.randint(-100, 100, (1,), generator=g)).item()
    huge = torch.randn(k, generator=g, device="cpu") * 2.0**120
    x[rows[7]] = huge.to(x.device, x.dtype)
    return x


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of an fp8/e8m0 tensor as uint8 (for bit-for-bit comparisons)."""
    return t.view(torch.uint8)


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    ref, approx = ref.double(), approx.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - approx).pow(2).sum())).item()


def assert_sum_within_rounding(got: torch.Tensor, terms: torch.Tensor) -> None:
    """got (in its dtype) is a sum of ``terms`` [..., k, ...] over dim -2 accumulated in fp32
    in any order, then rounded once to got's dtype: within k - 1 fp32 roundings of the sum
    of magnitudes plus one rounding of the result (a bound relative to the result alone
    fails where terms cancel). Non-finite exact sums must match as NaN/inf."""
    exact = terms.double().sum(-2)
    k = terms.shape[-2]
    eps32, eps_out = torch.finfo(torch.float32).eps, torch.finfo(got.dtype).eps
    acc = max(k - 1, 0) * eps32 * terms.double().abs().sum(-2)
    bound = acc * (1 + eps_out) + eps_out * exact.abs()
    finite = exact.isfinite()
    err = (got.double() - exact).abs()
    assert bool((err[finite] <= bound[finite]).all()), (err - bound).max()
    torch.testing.assert_close(
        got.double()[~finite], exact[~finite], rtol=0, atol=0, equal_nan=True
    )
