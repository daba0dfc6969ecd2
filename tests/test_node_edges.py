"""The node-aware route's edge cases on gloo (node_edge_workers.py): top_k = 0 and capacity 0
run forward and backward as the flat path does; nodes of unequal size, and top_k or
LOCAL_WORLD_SIZE that differ between ranks, raise the same ValueError on every rank."""

from __future__ import annotations

import pytest
from dist_utils import run_distributed
from node_edge_workers import (
    kept_topologies_are_never_dropped,
    top_k_differs_raises_alike,
    top_k_zero_and_capacity_zero,
    unequal_nodes_raise_alike,
)


def test_top_k_zero_and_capacity_zero_match_the_flat_path():
    run_distributed(top_k_zero_and_capacity_zero, 4, timeout=300)


@pytest.mark.parametrize("world", [3, 5])
def test_nodes_of_unequal_size_raise_on_every_rank(world):
    run_distributed(unequal_nodes_raise_alike, world, timeout=300)


def test_top_k_that_differs_raises_on_every_rank():
    run_distributed(top_k_differs_raises_alike, 4, timeout=300)


def test_kept_topologies_are_never_dropped():
    run_distributed(kept_topologies_are_never_dropped, 4, timeout=300)
