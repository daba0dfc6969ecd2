"""A real job's mistakes fail loudly: ExpertParallelMoE's construction checks and first-forward
check (DDP without prepare_ddp, fully_shard without shard_experts, ranks seeded
differently), seeds from torch's RNG, max_tokens (ranks with different token counts), the
static dispatch's per-configuration agreement and PushBuffer's device errors, on gloo."""

from __future__ import annotations

import pydoc

import pytest
import torch
from dist_utils import run_distributed
from layer_check_workers import (
    ddp_mistakes,
    fsdp_without_shard_experts,
    layer_configs_differ,
    push_buffer_device_on_one_rank,
    replicas_and_upcycling,
    seeds,
    static_agrees_once,
    static_sizes_differ,
    static_tokens_differ,
    static_validate_compiled,
)

import mxfp8_a2a as mx


def test_construction_checks_what_the_host_knows(group_of_one):
    with pytest.raises(ValueError, match=r"hidden=100: exchange='mxfp8' .* multiple of 32, or"):
        mx.ExpertParallelMoE(100, 32, 4, 2)
    assert mx.ExpertParallelMoE(100, 32, 4, 2, exchange="bf16").router.shape == (100, 4)
    with pytest.raises(ValueError, match="capacity_factor needs max_tokens"):
        mx.ExpertParallelMoE(64, 32, 4, 2, capacity_factor=1.25)
    for kw, match in [
        ({"capacity_factor": 1.0, "max_tokens": 8.0}, "max_tokens must be an int"),
        ({"capacity": 4.0}, "capacity must be an int"),
        ({"capacity_factor": "2"}, "capacity_factor must be a number"),
        ({"max_tokens": 8}, "max_tokens is for the static dispatch"),
        ({"align": 0}, "align must be an int"),
        ({"precision": "fp8_rowwise", "exchange": "bf16"}, "multiples of 16"),
    ]:
        with pytest.raises(ValueError, match=match):
            mx.ExpertParallelMoE(64 if "precision" not in kw else 72, 32, 4, 2, **kw)
    layer = mx.ExpertParallelMoE(64, 32, 4, 2, capacity_factor=1.5, max_tokens=10)
    assert layer.capacity == 30  # capacity_for(10, 2, 1, 1.5)
    with pytest.raises(ValueError, match="x has 11 tokens, more than the layer's max_tokens=10"):
        layer(torch.randn(11, 64))
    with pytest.raises(ValueError, match="bfloat16 or float32 for exchange='mxfp8'"):
        layer(torch.randn(4, 64, dtype=torch.float16))


def test_seed_comes_from_torch_manual_seed(group_of_one):
    torch.manual_seed(3)
    a, b = mx.ExpertParallelMoE(64, 32, 4, 2), mx.ExpertParallelMoE(64, 32, 4, 2)
    assert not torch.equal(a.router, b.router) and not torch.equal(a.w1, b.w1)
    torch.manual_seed(3)
    again = mx.ExpertParallelMoE(64, 32, 4, 2)
    assert torch.equal(again.router, a.router) and torch.equal(again.w1, a.w1)
    fixed = [mx.ExpertParallelMoE(64, 32, 4, 2, seed=7) for _ in range(2)]
    assert torch.equal(fixed[0].w2, fixed[1].w2)


def test_help_repr_and_stats(group_of_one):
    text = pydoc.render_doc(mx.ExpertParallelMoE, renderer=pydoc.plaintext)
    assert "capacity_factor, capacity, max_tokens" in text and "the most tokens any" in text
    assert "Initialize internal Module state" not in text  # (torch's inherited __init__ text)
    layer = mx.ExpertParallelMoE(64, 32, 4, 2, capacity_factor=2.0, max_tokens=8)
    shown = repr(layer)
    for part in ("hidden=64", "ffn=32", "num_experts=4", "top_k=2", "group_size=1",
                 "exchange='mxfp8'", "static, capacity=32, max_tokens=8", "transport='nccl'",
                 "precision='bf16'"):  # fmt: skip
        assert part in shown, (part, shown)
    assert "dispatch=(synced)" in repr(mx.ExpertParallelMoE(64, 32, 4, 2))
    assert mx.STAT_NAMES == ("dropped", "needed_capacity", "invalid_ids", "num_experts_differs")
    layer(torch.randn(8, 64))
    stats = layer.read_dispatch_stats()
    assert list(stats) == list(mx.STAT_NAMES) and stats["needed_capacity"] > 0
    layer.reset_dispatch_stats()
    assert layer.read_dispatch_stats() == dict.fromkeys(mx.STAT_NAMES, 0)


def test_static_layer_compiles_with_dynamic_shapes(group_of_one):
    layer = mx.ExpertParallelMoE(64, 32, 4, 2, capacity_factor=2.0, max_tokens=16, seed=1)
    run = torch.compile(layer, fullgraph=True, dynamic=True)
    for t in (9, 16, 5):
        x = torch.randn(t, 64)
        torch.testing.assert_close(run(x), layer(x), rtol=1e-4, atol=1e-5)


def test_push_buffer_emulated_world_must_be_positive():
    for world in (0, -1):
        with pytest.raises(ValueError, match="world must be an int >= 1"):
            mx.PushBuffer.emulated(world, 64, 4, capacity=4, device="cpu")


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_mistakes_raise_on_every_rank(world):
    run_distributed(ddp_mistakes, world)


def test_fully_shard_without_shard_experts_raises_on_every_rank():
    run_distributed(fsdp_without_shard_experts, 2)


def test_layers_built_differently_raise_on_every_rank():
    run_distributed(layer_configs_differ, 2)


def test_ranks_seeded_differently_raise_on_every_rank():
    run_distributed(seeds, 2)


@pytest.mark.parametrize(("world", "compiled"), [(2, False), (3, False), (2, True)])
def test_static_layer_takes_different_token_counts(world, compiled):
    run_distributed(static_tokens_differ, world, compiled)


@pytest.mark.parametrize("world", [2, 3])
def test_static_sizes_that_differ_raise_on_every_rank(world):
    run_distributed(static_sizes_differ, world)


def test_static_dispatch_agrees_once_per_configuration():
    run_distributed(static_agrees_once, 2)


def test_static_dispatch_validate_under_compile():
    run_distributed(static_validate_compiled, 2)


def test_push_buffer_device_on_one_rank_raises_on_every_rank():
    run_distributed(push_buffer_device_on_one_rank, 2)


def test_replicas_upcycling_and_combine_legs():
    run_distributed(replicas_and_upcycling, 4)
