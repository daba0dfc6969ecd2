"""Expert-parallel MoE dispatch/combine on spawned gloo groups (NCCL with >= 2 GPUs)."""

from __future__ import annotations

import random

import pytest
import torch
from dist_utils import BACKENDS, run_distributed
from moe_workers import (
    copy_engine_matches_nccl,
    copy_engine_needs_cuda_pair,
    matches_reference,
    mxfp8_vs_bf16,
)

CASES = [(1, "normal"), (2, "normal"), (2, "one_expert"), (1, "empty_experts")]


def _seed() -> int:
    return random.SystemRandom().randrange(2**20)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [2, 4])
def test_layer_matches_single_process_reference(backend, world):
    if backend == "nccl":
        world = min(world, torch.cuda.device_count())
    for top_k, routing in CASES:
        run_distributed(matches_reference, world, backend, _seed(), top_k, routing, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mxfp8_exchange_close_to_bf16(backend):
    # 256 tokens per rank: over 12 the figure for x's gradient was too noisy for the floor.
    for top_k, routing in CASES:
        for out_db, grad_db in run_distributed(
            mxfp8_vs_bf16, 2, backend, _seed(), top_k, routing, 256, backend=backend
        ):
            assert out_db >= 25.0 and grad_db >= 25.0, (top_k, routing, out_db, grad_db)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_copy_engine_transport_matches_nccl():
    for top_k, routing in CASES:
        run_distributed(
            copy_engine_matches_nccl, 2, "nccl", _seed(), top_k, routing, 64, backend="nccl"
        )


def test_copy_engine_transport_needs_a_cuda_pair():
    assert run_distributed(copy_engine_needs_cuda_pair, 2, "gloo") == [True, True]
