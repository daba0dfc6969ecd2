"""The MoE layer's experts on grouped_mm, on CPU: the expert-parallel layer against the
single-process MoE of the same precision, FP8 weight reuse (the CUDA FP8 path with
torch._scaled_grouped_mm emulated), bad precisions.

    python -m pytest -q tests/test_moe_experts.py
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from emulated_gemm import _emulated_op
from grouped_mm_data import fr, gm
from helpers import fresh_generator, sqnr_db
from moe_reference import moe_reference

from mxfp8_a2a.moe.layer import ExpertParallelMoE, init_moe_weights


def _layer_vs_reference(rank, world, seed, precision):
    """The expert-parallel layer (plain exchange) against the single-process MoE of the same
    precision: the same rows in the same order per expert, so the same FP8 groups."""
    torch.manual_seed(seed)
    hidden, ffn, experts, tokens, top_k = 64, 32, 2 * world, 24, 2
    layer = ExpertParallelMoE(
        hidden, ffn, experts, top_k, exchange="bf16", precision=precision, seed=seed
    )
    gens = [torch.Generator().manual_seed(seed + r) for r in range(world)]
    dtype = torch.bfloat16 if precision == "fp8_rowwise_gw_hp" else torch.float32  # (bf16 only)
    xs = [torch.randn(tokens, hidden, generator=g).to(dtype) for g in gens]
    x = xs[rank].clone().requires_grad_(True)
    out = layer(x)
    out.sum().backward()
    full = init_moe_weights(hidden, ffn, experts, seed)
    ref_w = {k: v.to(dtype).requires_grad_(True) for k, v in full.items()}
    x_all = torch.cat(xs).requires_grad_(True)
    ref = moe_reference(x_all, ref_w, top_k, precision=precision)
    ref.sum().backward()
    rows = slice(rank * tokens, (rank + 1) * tokens)
    local = slice(rank * experts // world, (rank + 1) * experts // world)
    pairs = [
        (out, ref[rows]),
        (x.grad, x_all.grad[rows]),
        (layer.w1.grad, ref_w["w1"].grad[local]),
        (layer.w2.grad, ref_w["w2"].grad[local]),
    ]
    for got, want in pairs:
        if precision == "bf16":
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        else:  # the same FP8 arithmetic; last-bit differences upstream may flip an e4m3 cast
            assert sqnr_db(want, got) >= 40.0, sqnr_db(want, got)


@pytest.mark.parametrize("precision", gm.PRECISIONS)
def test_layer_matches_reference_of_its_precision(precision):
    run_distributed(_layer_vs_reference, 2, fresh_generator().initial_seed() % 2**20, precision)


def test_layer_rejects_bad_precision():
    run_distributed(_bad_layer, 1)


def test_layer_fp8_weight_reuse():
    run_distributed(_layer_reuse, 1, fresh=True)  # it patches modules


def _layer_reuse(rank, world):
    """Inside fp8_weight_reuse() the layer (its CUDA FP8 path, the GEMM emulated) casts each
    weight once per activation dtype, gives the same bits as without the block, refuses a
    weight changed inside it, makes nothing in inference mode, and frees the casts at its
    end."""
    fr._scaled_gmm = _emulated_op  # (this process only)
    gm.gemm_path = lambda x, precision: "scaled" if precision == "fp8_rowwise" else "loop"
    casts = []  # the forward's cast of w alone, or both of w's copies in one pass
    per_column, both = fr._weights_per_column, fr.weight_scales
    fr._weights_per_column = lambda w: casts.append(w.dtype) or per_column(w)
    fr.weight_scales = lambda w, **k: casts.append(w.dtype) or both(w, **k)
    layer = ExpertParallelMoE(64, 32, 4, 2, exchange="bf16", precision="fp8_rowwise")
    x = torch.randn(24, 64)
    offs = torch.tensor([5, 5, 17, 24], dtype=torch.int32)
    want = layer.experts(x, offs)
    assert len(casts) == 2
    with layer.fp8_weight_reuse():
        with torch.inference_mode():
            layer.experts(x, offs)
        assert layer.experts._fp8_weights == {} and len(casts) == 4
        for _ in range(2):
            got = layer.experts(x, offs)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            got.sum().backward()
        assert len(casts) == 6  # w1 and w2 once each for both micro-batches
        layer.experts(x.bfloat16(), offs)  # another activation dtype: its own casts
        assert casts[6:] == [torch.bfloat16] * 2 and len(layer.experts._fp8_weights) == 4
        with pytest.raises(RuntimeError, match="already active"):
            with layer.fp8_weight_reuse():
                pass
        with torch.no_grad():
            layer.w1.mul_(0.5)  # an optimizer step inside the block
        with pytest.raises(ValueError, match="w1 changed"):
            layer.experts(x, offs)
    assert layer.experts._fp8_weights is None
    layer.precision = "bf16"
    with layer.fp8_weight_reuse():
        layer.experts(x, offs)
        assert layer.experts._fp8_weights == {}  # nothing cast for bf16


def _bad_layer(rank, world):
    with pytest.raises(ValueError, match="precision must be one of"):
        ExpertParallelMoE(64, 32, 2, 1, precision="fp4")
    with pytest.raises(ValueError, match="multiples of 16"):
        ExpertParallelMoE(64, 40, 2, 1, precision="fp8_rowwise")
