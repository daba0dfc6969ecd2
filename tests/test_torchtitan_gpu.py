"""mxfp8_a2a.torchtitan on CUDA tensors against torchtitan's own modules: an expert-parallel
mesh of one rank over NCCL wired into the dispatchers, so that they take their exchange path
(not torchtitan's local one). The checks of test_torchtitan.py that one process can run.
Skipped without a GPU or torchtitan."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("torchtitan")

from dist_utils import run_distributed  # noqa: E402


def seed() -> int:
    return random.randrange(2**31)


def one_rank(fn, *args, device: str = "cuda"):
    """fn's result at one rank, its tensors on ``device`` (the workers' last argument)."""
    backend = "nccl" if device == "cuda" else "gloo"
    return run_distributed(fn, 1, *args, device, backend=backend, timeout=600)[0]


def test_dispatcher_bf16_wire_within_rounding_of_torchtitans():
    from torchtitan_workers import dispatcher_bf16_bounds

    top_k = 3
    worst_out, worst_x, worst_s = one_rank(dispatcher_bf16_bounds, seed(), 40, top_k, 8, 256)
    assert worst_out <= top_k + 4 and worst_x <= top_k + 6 and worst_s <= 2


@pytest.mark.parametrize("wire", ["mxfp8", "mxfp8_to_experts"])
def test_dispatcher_presets_match_legs_model(wire):
    from torchtitan_workers import dispatcher_matches_legs_model

    one_rank(dispatcher_matches_legs_model, seed(), [37], 3, 8, wire, 256)


def test_debug_moe_bf16_wire_close_to_torchtitans():
    from torchtitan_workers import moe_bf16_matches_torchtitan

    diffs = one_rank(moe_bf16_matches_torchtitan, seed(), 16, None)
    assert all(v == 0 for k, v in diffs.items() if k not in ("out", "x")), diffs
    assert diffs["out"] < 2**-7 and diffs["x"] < 2**-7, diffs


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("wire", ["bf16", "mxfp8"])
def test_static_dispatcher_against_the_synced_one(wire, compiled):
    from torchtitan_workers import static_against_synced

    diffs = one_rank(static_against_synced, seed(), wire, compiled)
    limit = 0 if not compiled else 2**-6 if wire == "bf16" else 2**-5
    assert max(diffs.values()) <= limit, diffs
