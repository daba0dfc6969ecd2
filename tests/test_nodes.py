"""The node-aware route (mxfp8_a2a.NodeTopology, dispatch(..., topology=...)) on emulated
nodes (gloo on CPU): the experts' rows bit for bit the flat path's, combine and every
gradient bit for bit a plain-torch model of the hops (node_workers.py)."""

from __future__ import annotations

import random

import pytest
from dist_utils import run_distributed
from node_workers import route_matches_model

EXCHANGES = ["mxfp8", "bf16", "mxfp8_to_experts", ("bf16", "mxfp8", "mxfp8", "bf16")]


@pytest.mark.parametrize(
    "world, layouts, tokens",
    [(4, (2, 1, 4), [5, 0, 7, 3])],
)
def test_route_matches_flat_and_model(world, layouts, tokens):
    seed = random.randrange(2**31)
    run_distributed(route_matches_model, world, "gloo", seed, tokens, 3, 2, layouts, EXCHANGES,
                    timeout=600)  # fmt: skip
