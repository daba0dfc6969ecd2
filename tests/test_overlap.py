"""ExpertParallelMoE's overlap options on spawned gloo groups: shared experts (shared_ffn)
and chunks (overlap_chunks) equal the serial layer (tests/overlap_workers.py); ranks that
disagree on them get the same error. The GPU side is in test_overlap_gpu.py."""

from __future__ import annotations

import random

import pytest
from dist_utils import run_distributed
from overlap_workers import (
    compiled_equals_eager,
    overlap_equals_serial,
    settings_differ,
    shared_is_dense,
)

import mxfp8_a2a as mx


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("static", [False, True], ids=["synced", "static"])
@pytest.mark.parametrize("node", [False, True], ids=["flat", "node"])
def test_overlapped_layer_equals_serial(world, static, node):
    seed = random.SystemRandom().randrange(2**20)
    worst = run_distributed(overlap_equals_serial, world, "gloo", seed, static, node)
    assert max(worst) <= 1e-5


def test_overlapped_static_layer_compiles_fullgraph():
    run_distributed(compiled_equals_eager, 2, "gloo", random.SystemRandom().randrange(2**20))


def test_ranks_that_disagree_on_overlap_get_one_error():
    messages = run_distributed(settings_differ, 2, "gloo")
    assert messages[0] == messages[1]
    assert "overlap_chunks differs between ranks ([1, 2] by rank)" in messages[0][0]
    assert "shared_ffn differs between ranks ([None, 48] by rank)" in messages[0][1]


def test_shared_mlp_is_dense():
    names = run_distributed(shared_is_dense, 2, "gloo")
    assert names[0] == ["0.shared.w1", "0.shared.w2"]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(overlap_chunks=0), "overlap_chunks must be an int >= 1"),
        (dict(overlap_chunks=2.0), "overlap_chunks must be an int >= 1"),
        (dict(shared_ffn=0), "shared_ffn must be None, an int >= 1"),
        (dict(shared_ffn="wide"), "shared_ffn must be None, an int >= 1"),
    ],
)
def test_bad_overlap_arguments_name_the_argument(kw, match):
    run_distributed(_bad_argument, 1, "gloo", kw, match)


def _bad_argument(rank, world, backend, kw, match):
    with pytest.raises(ValueError, match=match):
        mx.ExpertParallelMoE(64, 32, 4, 2, **kw)
