"""The node-aware route (mxfp8_a2a.NodeTopology, dispatch(..., topology=...)) on emulated
nodes (gloo on CPU): the experts' rows bit for bit the flat path's, combine and every
gradient bit for bit a plain-torch model of the hops (node_workers.py)."""

from __future__ import annotations

import random

import pytest
from dist_utils import run_distributed
from node_workers import (
    bad_topology_fails_everywhere,
    bytes_match_routing,
    layer_takes_the_route,
    route_matches_model,
    static_route_matches,
    topology_sources_agree,
    weights_grad_on_some_ranks,
)

EXCHANGES = ["mxfp8", "bf16", "mxfp8_to_experts", ("bf16", "mxfp8", "mxfp8", "bf16")]


@pytest.mark.parametrize(
    "world, layouts, tokens",
    [
        (4, (2, 1, 4), [5, 0, 7, 3]),  # 2x2, 4x1 and one node; a rank without tokens
        (6, (3, 2), [4, 6, 0, 5, 3, 7]),  # 2x3 and 3x2
        (8, (4, 2), [3, 5, 0, 4, 6, 2, 5, 1]),  # 2x4 and 4x2
    ],
)
def test_route_matches_flat_and_model(world, layouts, tokens):
    """Each layout of the world, each preset and a mix, top-3 of 2 experts per rank with
    repeated ids."""
    seed = random.randrange(2**31)
    exchanges = EXCHANGES if world == 4 else EXCHANGES[3:]  # (bigger groups: less CI time)
    run_distributed(route_matches_model, world, "gloo", seed, tokens, 3, 2, layouts, exchanges,
                    timeout=600)  # fmt: skip


@pytest.mark.parametrize("world, layouts", [(4, (2, 1))])
def test_sent_bytes_match_the_routing(world, layouts):
    seed = random.randrange(2**31)
    tokens = [6, 0, 9, 4][:world]
    run_distributed(bytes_match_routing, world, "gloo", seed, tokens, 3, 2, layouts, timeout=600)


def test_layer_under_ddp_and_dcp(tmp_path):
    run_distributed(layer_takes_the_route, 4, "gloo", str(tmp_path / "ckpt"), 2, timeout=600)


def test_bad_topology_fails_on_every_rank():
    run_distributed(bad_topology_fails_everywhere, 4, "gloo", timeout=300)


def test_topology_from_ranks_per_node_mesh_or_torchrun():
    run_distributed(topology_sources_agree, 4, "gloo", timeout=300)


def test_weights_without_grad_on_one_rank_do_not_hang():
    run_distributed(weights_grad_on_some_ranks, 4, "gloo", timeout=120)


def test_static_route_matches_the_synced_one():
    """MXFP8 eager and compiled, bf16 eager."""
    seed = random.randrange(2**31)
    run_distributed(static_route_matches, 4, "gloo", seed, [5, 0, 7, 3], 3, 2, 2,
                    ("mxfp8", "bf16"), timeout=600)  # fmt: skip
