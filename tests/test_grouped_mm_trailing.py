"""grouped_mm with rows past offs[-1] (the static dispatch's padding): ignored, with zero
output and zero gradient there, every precision, CPU paths and CUDA."""

from __future__ import annotations

import pytest
import torch
from helpers import fresh_generator

import mxfp8_a2a as mx

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    ),
]


def _run(x, w, offs, precision):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    out = mx.grouped_mm(x, w, offs, precision=precision)
    g = torch.ones_like(out) * torch.linspace(-1, 1, out.shape[1], device=out.device).to(out.dtype)
    (out.float() * g.float()).sum().backward()
    return out.detach(), x.grad, w.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["bf16", "fp8_rowwise", "fp8_rowwise_gw_hp"])
@pytest.mark.parametrize("ends", [[5, 5, 21], [0, 16, 32], [0, 0, 0]])
def test_trailing_rows_ignored(device, precision, ends):
    g = fresh_generator()
    e, k, n, m = 3, 32, 48, 40
    x = (torch.randn(m, k, generator=g) * 3).bfloat16().to(device)  # trailing rows: garbage
    w = torch.randn(e, k, n, generator=g).bfloat16().to(device)
    offs = torch.tensor(ends, dtype=torch.int32, device=device)
    out, gx, gw = _run(x, w, offs, precision)
    end = ends[-1]
    assert not out[end:].any() and not gx[end:].any()
    ref_out, ref_gx, ref_gw = _run(x[:end], w, offs, precision)
    assert torch.equal(out[:end], ref_out)
    assert torch.equal(gx[:end], ref_gx)
    assert torch.equal(gw, ref_gw)


def test_offsets_past_the_rows_raise():
    x, w = torch.randn(8, 32), torch.randn(2, 32, 16)
    with pytest.raises(ValueError, match="at most x.shape"):
        mx.grouped_mm(x, w, torch.tensor([4, 9], dtype=torch.int32))
