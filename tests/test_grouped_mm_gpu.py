"""grouped_mm on a CUDA GPU ("fp8_rowwise" ones on sm_90+): against the reference with the
tolerance table, exact on representable data, SQNR against bf16, empty experts,
torch.compile, torch's public grouped GEMMs against the private ones (the same bits), and the
fallbacks without either. They skip without CUDA.

    python -m pytest -q tests/test_grouped_mm_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from grouped_mm_data import (
    KINDS,
    SM90,
    SQNR_FLOOR_DB,
    _close,
    _exact,
    _fwd_bwd,
    _gpu_inputs,
    _public,
    _reference,
    _representable_inputs,
    fr,
    gm,
    needs_cuda,
    needs_sm90,
)
from helpers import fresh_generator, sqnr_db

import mxfp8_a2a as mx
from mxfp8_a2a.grouped import torch_gemms as tg
from mxfp8_a2a.moe.layer import ExpertParallelMoE


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_bf16_matches_reference(dtype, kind):
    args = _gpu_inputs(kind, dtype)
    _close(_fwd_bwd(_public("bf16"), *args), _fwd_bwd(_reference("bf16"), *args), "bf16")


@needs_sm90
@pytest.mark.parametrize(
    "precision, dtype",
    [("fp8_rowwise", torch.bfloat16), ("fp8_rowwise", torch.float32),
     ("fp8_rowwise_gw_hp", torch.bfloat16)],
)  # fmt: skip
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1003, 4096])
def test_gpu_fp8_matches_reference(precision, dtype, kind, m):
    args = _gpu_inputs(kind, dtype, m=m)
    got = _fwd_bwd(_public(precision), *args)
    _close(got, _fwd_bwd(_reference(precision), *args), precision)
    assert all(t.dtype == dtype for t in got)


@needs_sm90
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_fp8_is_exact_on_representable_data(kind):
    args = _representable_inputs(301, 64, 96, 6, kind, torch.bfloat16, fresh_generator())
    args = [t.cuda() for t in args]
    _close(_fwd_bwd(_public("fp8_rowwise"), *args), _exact(*args), "fp8_rowwise")


@needs_sm90
@pytest.mark.parametrize("precision", ["fp8_rowwise", "fp8_rowwise_gw_hp"])
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_fp8_sqnr_against_bf16(kind, precision):
    args = _gpu_inputs(kind, m=4096, k=1024, n=512, e=8)
    fp8 = _fwd_bwd(_public(precision), *args)
    bf16 = _fwd_bwd(_public("bf16"), *args)
    for name, a, b in zip(("out", "grad_x", "grad_w"), fp8, bf16, strict=True):
        assert sqnr_db(b, a) >= SQNR_FLOOR_DB, (name, sqnr_db(b, a))


@needs_cuda
@pytest.mark.parametrize("precision", gm.PRECISIONS)
def test_gpu_empty_experts_get_zero_weight_gradients(precision):
    if precision != "bf16" and not SM90:
        pytest.skip(f"{precision} needs an sm_90+ GPU")
    x, w, offs, grad = _gpu_inputs("with_empty", m=517)
    _, _, gw = _fwd_bwd(_public(precision), x, w, offs, grad)
    sizes = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    for e, size in enumerate(sizes):
        assert (gw[e].abs().sum() == 0) == (size == 0), (e, size)


@needs_cuda
@pytest.mark.parametrize("precision", gm.PRECISIONS)
def test_gpu_torch_compile_fullgraph(precision):
    if precision != "bf16" and not SM90:
        pytest.skip(f"{precision} needs an sm_90+ GPU")
    args = _gpu_inputs("with_empty", m=500)
    compiled = torch.compile(_public(precision), fullgraph=True, backend="inductor")
    _close(_fwd_bwd(compiled, *args), _fwd_bwd(_public(precision), *args), precision)


@needs_cuda
def test_gpu_validate_reads_offsets():
    x, w, offs, _ = _gpu_inputs("uneven")
    with pytest.raises(ValueError, match="non-decreasing"):
        mx.grouped_mm(x, w, offs.flip(0), validate=True)
    with pytest.raises(ValueError, match="multiples of 8"):
        mx.grouped_mm(x[:, :100], w[:, :100], offs)


def _layer_sqnr(rank, world, seed):
    torch.manual_seed(seed)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    res = []
    for exchange, precision in (("bf16", "bf16"), ("mxfp8", "fp8_rowwise")):
        layer = ExpertParallelMoE(256, 128, 8, 2, exchange=exchange, precision=precision, seed=seed)
        layer = layer.to("cuda", torch.bfloat16)
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        out.float().pow(2).sum().backward()
        res.append((out.detach(), xi.grad, layer.w1.grad, layer.w2.grad))
    return [sqnr_db(a, b) for a, b in zip(*res, strict=True)]


@needs_sm90
def test_gpu_layer_fp8_close_to_bf16():
    for db in run_distributed(_layer_sqnr, 1, 7, backend="nccl")[0]:
        assert db >= 20.0, db


@needs_cuda
@pytest.mark.parametrize("precision", gm.PRECISIONS)
def test_gpu_fallbacks_without_torch_grouped_gemms(monkeypatch, precision):
    """Without torch's grouped GEMMs (public or private): the loop op, the reference."""
    if precision != "bf16" and not SM90:
        pytest.skip(f"{precision} needs an sm_90+ GPU")
    args = _gpu_inputs("with_empty")
    want = _fwd_bwd(_public(precision), *args)
    monkeypatch.setattr(gm, "HAS_GROUPED_MM", False)
    monkeypatch.setattr(gm, "HAS_SCALED_GROUPED_MM", False)
    _close(_fwd_bwd(_public(precision), *args), want, precision)


@needs_sm90
def test_gpu_fp8_weights_made_once_give_the_same_bits():
    """grouped_mm with fp8_rowwise_weights(w) made beforehand: the same bits as without."""
    args = _gpu_inputs("with_empty")
    fp8 = fr.fp8_rowwise_weights(args[1])
    reused = _fwd_bwd(
        lambda x, w, o: mx.grouped_mm(x, w, o, precision="fp8_rowwise", fp8_weights=fp8), *args
    )
    for a, b in zip(reused, _fwd_bwd(_public("fp8_rowwise"), *args), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@needs_cuda
@pytest.mark.parametrize("precision", gm.PRECISIONS)
def test_gpu_public_and_private_torch_gemms_give_the_same_bits(monkeypatch, precision):
    """torch.nn.functional.grouped_mm / scaled_grouped_mm and the private ops they fall back
    to (torch_gemms.py): the same bits, forward and backward."""
    if precision != "bf16" and not SM90:
        pytest.skip(f"{precision} needs an sm_90+ GPU")
    if not (tg.PUBLIC_GROUPED_MM and tg.HAS_PUBLIC_SCALED_GROUPED_MM):
        pytest.skip("this torch has no torch.nn.functional.grouped_mm / scaled_grouped_mm")
    args = _gpu_inputs("with_empty", m=1003)
    assert tg.scaled_path(args[0]) == "public"
    public = _fwd_bwd(_public(precision), *args)
    monkeypatch.setattr(tg, "PUBLIC_GROUPED_MM", False)
    monkeypatch.setattr(tg, "HAS_PUBLIC_SCALED_GROUPED_MM", False)
    assert tg.scaled_path(args[0]) == "private"
    for a, b in zip(public, _fwd_bwd(_public(precision), *args), strict=True):
        assert torch.equal(a, b)
