"""A wire per leg of dispatch and combine (exchange/wires.py): each preset's four legs, and a
mix no preset has, bit for bit against a plain-torch model of the legs, on the synced and the
static path, at 1 to 3 ranks (gloo)."""

from __future__ import annotations

import random

import pytest
import torch
from dist_utils import run_distributed
from wires_workers import legs_match_model

import mxfp8_a2a as mx
from mxfp8_a2a.exchange.wires import combine_default, layer_wires, leg_pair


def test_presets_and_their_legs():
    assert set(mx.WIRE_PRESETS) == {"mxfp8", "bf16", "mxfp8_to_experts"}
    split = mx.WIRE_PRESETS["mxfp8_to_experts"]
    assert split == mx.Wires("mxfp8", "bf16", "bf16", "mxfp8")
    assert (split.dispatch, split.combine) == (("mxfp8", "bf16"), ("bf16", "mxfp8"))
    assert leg_pair("mxfp8_to_experts", "combine") == ("bf16", "mxfp8")
    assert combine_default(("mxfp8", "bf16")) == ("bf16", "mxfp8")  # each direction its wire
    assert layer_wires(("bf16", "bf16", "bf16", "mxfp8")).combine_bwd == "mxfp8"
    for bad in ("fp8", ("mxfp8",), ("mxfp8", "fp16"), None, ("bf16",) * 5):
        with pytest.raises(ValueError, match="exchange must be a preset"):
            layer_wires(bad)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize(
    "exchange", ["mxfp8", "bf16", "mxfp8_to_experts", ("bf16", "mxfp8", "mxfp8", "bf16")],
    ids=str,
)  # fmt: skip
def test_each_leg_matches_the_model(world, exchange):
    seed = random.randrange(2**31)
    tokens = [5 + 2 * r for r in range(world)]  # ranks with different token counts
    run_distributed(legs_match_model, world, "gloo", seed, tokens, 2, 2, exchange, timeout=300)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("hidden", [384, 2048, 7168])
@pytest.mark.parametrize(
    "exchange", ["mxfp8", "bf16", "mxfp8_to_experts", ("bf16", "mxfp8", "mxfp8", "bf16")],
    ids=str,
)  # fmt: skip
def test_each_leg_matches_the_model_on_cuda(hidden, exchange):
    """The same legs on CUDA tensors (the GPU kernels) against the CPU model, one rank."""
    seed = random.randrange(2**31)
    run_distributed(
        legs_match_model, 1, "nccl", seed, [77], 2, 4, exchange, hidden, backend="nccl", timeout=300
    )


def test_layer_takes_presets_and_checks_hidden(group_of_one):
    layer = mx.ExpertParallelMoE(64, 32, 4, 2, exchange="mxfp8_to_experts")
    assert layer.wires == mx.WIRE_PRESETS["mxfp8_to_experts"]
    layer(torch.randn(6, 64)).sum().backward()
    with pytest.raises(ValueError, match="multiple of 32"):
        mx.ExpertParallelMoE(48, 32, 4, 2, exchange="mxfp8_to_experts")
    mx.ExpertParallelMoE(48, 32, 4, 2, exchange="bf16")
    with pytest.raises(ValueError, match="exchange must be a preset"):
        mx.ExpertParallelMoE(64, 32, 4, 2, exchange="fp8")
