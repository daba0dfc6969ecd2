"""Static (sync-free) dispatch/combine on spawned gloo groups (NCCL with >= 2 GPUs)."""

from __future__ import annotations

import random

import pytest
from dist_utils import run_distributed
from static_workers import (
    layer_arguments_and_shapes,
    static_layer_matches_synced,
    static_layer_reports_drops,
    static_matches_model,
    static_vs_dispatch,
)


def _seed() -> int:
    return random.SystemRandom().randrange(2**20)


@pytest.mark.parametrize("exchange", ["mxfp8", "bf16"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_static_equals_synced_dispatch(world, exchange):
    run_distributed(static_vs_dispatch, world, "gloo", _seed(), 9, 2, 2, exchange, timeout=300)


# (tokens by rank, top_k, experts per rank, routing, capacity, align)
MODEL_CASES = [
    ([7, 7], 2, 2, "normal", 3, 4),  # drops under random routing
    ([6, 6], 1, 1, "one_expert", 2, 16),  # everything to one expert, overflow
    ([8, 0], 2, 2, "one_rank", 5, 1),  # a rank with no tokens; every row to rank 0
    ([5, 5], 4, 2, "normal", 20, 8),  # top_k = num_experts, dropless
    ([5, 5], 1, 2, "normal", 0, 16),  # capacity 0: everything dropped
]


@pytest.mark.parametrize("exchange", ["mxfp8", "bf16"])
@pytest.mark.parametrize("case", range(len(MODEL_CASES)))
def test_static_drop_rule_matches_model(case, exchange):
    tokens, top_k, per_rank, routing, cap, align = MODEL_CASES[case]
    run_distributed(
        static_matches_model, len(tokens), "gloo", _seed(), tokens, top_k, per_rank, routing,
        cap, exchange, align, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("exchange", ["mxfp8", "bf16", "mxfp8_to_experts"])
def test_static_layer_matches_synced_layer(exchange, compiled):
    run_distributed(static_layer_matches_synced, 2, "gloo", _seed(), exchange, compiled,
                    timeout=600)  # fmt: skip


def test_static_layer_counts_drops_and_check_raises_everywhere():
    messages = run_distributed(static_layer_reports_drops, 2, "gloo")
    assert messages[0] == messages[1]


def test_layer_checks_arguments_and_takes_batch_seq_hidden():
    run_distributed(layer_arguments_and_shapes, 2)
