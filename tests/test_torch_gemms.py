"""grouped/torch_gemms.py: torch's public grouped GEMMs where torch has them, the private ops
as the fallback; which one runs and what each is given. Both paths on a GPU, bit for bit:
test_grouped_mm_gpu.py.

    python -m pytest -q tests/test_torch_gemms.py
"""

from __future__ import annotations

import pytest
import torch
from helpers import fresh_generator
from torch._subclasses.fake_tensor import FakeTensorMode

from mxfp8_a2a.grouped import torch_gemms as tg

F = torch.nn.functional
needs_public_grouped = pytest.mark.skipif(
    not hasattr(F, "grouped_mm"), reason="this torch has no torch.nn.functional.grouped_mm"
)
needs_public_scaled = pytest.mark.skipif(
    not tg.HAS_PUBLIC_SCALED_GROUPED_MM,
    reason="this torch has no torch.nn.functional.scaled_grouped_mm",
)


def _record(monkeypatch, owner, name: str) -> list:
    calls: list = []
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **k: calls.append((a, k)) or real(*a, **k))
    return calls


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
@pytest.mark.parametrize("public", [pytest.param(True, marks=needs_public_grouped), False])
def test_grouped_gemm_paths_give_the_same_bits(monkeypatch, public):
    """The public torch.nn.functional.grouped_mm or the private op (CPU kernels): the same
    products, 2-D x 3-D and 2-D x 2-D, and only the chosen one is called."""
    g = fresh_generator()
    x = torch.randn(40, 32, generator=g).bfloat16()
    w = torch.randn(3, 32, 16, generator=g).bfloat16()
    grad = torch.randn(40, 16, generator=g).bfloat16()
    offs = torch.tensor([10, 10, 40], dtype=torch.int32)
    want = (torch._grouped_mm(x, w, offs=offs), torch._grouped_mm(x.t(), grad, offs=offs))
    monkeypatch.setattr(tg, "PUBLIC_GROUPED_MM", public)
    calls = _record(monkeypatch, F, "grouped_mm") if hasattr(F, "grouped_mm") else []
    got = (tg.grouped_gemm(x, w, offs), tg.grouped_gemm(x.t(), grad, offs))
    assert len(calls) == (2 if public else 0)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@needs_public_scaled
def test_public_scaled_gemm_gets_rowwise_recipes(monkeypatch):
    """torch.nn.functional.scaled_grouped_mm receives the private op's operands and scales
    with the RowWise recipe for both, bf16 out (plain tensors: the public path)."""
    calls: list = []
    monkeypatch.setattr(F, "scaled_grouped_mm", lambda *a, **k: calls.append((a, k)) or "out")
    a, b, sa, sb, offs = (torch.empty(1) for _ in range(5))
    assert tg.scaled_path(a) == "public"
    assert tg.scaled_grouped_gemm(a, b, sa, sb, offs) == "out"
    (args, kwargs), rowwise = calls[0], F.ScalingType.RowWise
    assert args == (a, b, sa, rowwise, sb, rowwise)
    assert kwargs == {"offs": offs, "output_dtype": torch.bfloat16}


def test_scaled_path_falls_back_where_the_public_op_cannot_run(monkeypatch):
    """Fake tensors (torch.compile's tracing) take the private op unless the public one has a
    meta kernel; without the public function every call takes the private op."""
    with FakeTensorMode():
        fake = torch.empty(4, 16, device="cuda")
    plain = torch.empty(4, 16)
    public = tg.HAS_PUBLIC_SCALED_GROUPED_MM
    assert tg.scaled_path(plain) == ("public" if public else "private")
    assert tg.scaled_path(fake) == ("public" if public and tg.PUBLIC_SCALED_TRACES else "private")
    monkeypatch.setattr(tg, "HAS_PUBLIC_SCALED_GROUPED_MM", False)
    assert tg.scaled_path(plain) == tg.scaled_path(fake) == "private"


@pytest.mark.skipif(not tg.HAS_SCALED_GROUPED_MM, reason="this torch has no FP8 grouped GEMM")
def test_scaled_gemm_traces_with_fake_cuda_tensors():
    """Both of grouped_mm's FP8 GEMM shapes on fake CUDA tensors (what torch.compile traces
    its backward with): the op chosen for them has a meta kernel."""
    m, k, n, e = 48, 32, 16, 3
    e4m3, gpu = torch.float8_e4m3fn, {"device": "cuda"}
    with FakeTensorMode():
        a = torch.empty(m, k, device="cuda", dtype=e4m3)
        b = torch.empty(e, n, k, device="cuda", dtype=e4m3).transpose(1, 2)
        offs = torch.empty(e, device="cuda", dtype=torch.int32)
        out = tg.scaled_grouped_gemm(a, b, torch.empty(m, **gpu), torch.empty(e, n, **gpu), offs)
        assert out.shape == (m, n) and out.dtype == torch.bfloat16
        at = torch.empty(k, m, device="cuda", dtype=e4m3)  # 2-D x 2-D: groups along m
        bt = torch.empty(n, m, device="cuda", dtype=e4m3).t()
        out = tg.scaled_grouped_gemm(
            at, bt, torch.empty(e * k, **gpu), torch.empty(e * n, **gpu), offs
        )
        assert out.shape == (e, k, n) and out.dtype == torch.bfloat16
