"""The cast kernels' launch path (mxfp8_a2a/formats/launch.py): the key, the version gate,
and on a GPU the cached launch against the public one, bit for bit."""

from __future__ import annotations

import pytest
import torch
import triton

import mxfp8_a2a as mx
from mxfp8_a2a.formats import launch


def test_arg_key_follows_triton_specialization():
    base = torch.zeros(64, dtype=torch.uint8)
    assert launch._arg_key(base) == (torch.uint8, True)
    assert launch._arg_key(base[1:])[1] is False  # 1 byte off a 16-byte boundary
    assert launch._arg_key(1) == (True, False, True)
    assert launch._arg_key(32) == (False, True, True)
    assert launch._arg_key(2**31) == (False, True, False)
    assert launch._arg_key(True) is True  # bools are constexpr-like, kept as they are


def test_host_integer_helpers_match_triton():
    """cdiv and next_pow2 (the launchers' grid arithmetic) give triton's numbers."""
    from mxfp8_a2a._common import cdiv, next_pow2

    values = list(range(0, 70)) + [2**k + d for k in range(6, 40) for d in (-1, 0, 1)]
    for a in values:
        assert next_pow2(a) == triton.next_power_of_2(a), a
        for b in (1, 2, 3, 16, 32, 128, 256, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_gate_and_environment(monkeypatch):
    monkeypatch.delenv(launch.PUBLIC_LAUNCH_ENV, raising=False)
    expected = triton.__version__.startswith(launch.FAST_TRITON)
    assert launch.fast_launch_enabled() is expected
    monkeypatch.setenv(launch.PUBLIC_LAUNCH_ENV, "1")
    assert launch.fast_launch_enabled() is False
    launch.clear_cache()
    assert not launch._COMPILED


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cached_launch_matches_public_launch(monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 5120, device="cuda", generator=g).to(torch.bfloat16)
    outs = []
    # the public path, then a first and a cached launch, then a cached one without torch's
    # private raw-stream accessor (the public current_stream)
    for public, raw in (("1", True), ("0", True), ("0", True), ("0", False)):
        monkeypatch.setenv(launch.PUBLIC_LAUNCH_ENV, public)
        if not raw:
            monkeypatch.setattr(launch, "_raw_stream", None)
        packed = mx.quantize_packed(x)
        outs.append((packed, mx.dequantize_packed(packed), mx.quantize_dequantize(x)))
    for later in outs[2:]:
        for a, b in zip(outs[0], later, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if launch.fast_launch_enabled():
        assert launch._COMPILED, "the cached path kept its kernels"
