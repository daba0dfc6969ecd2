"""Checkpoints of a model with an ExpertParallelMoE layer on gloo: torch.distributed.checkpoint
round trips (unwrapped, DDP, FSDP2; worlds 1 to 4) keep every rank's experts bit for bit and
load at another expert-parallel size, and so do the experts' optimizer states
(prepare_optimizer); full_state_dict / load_full_state_dict take wrapped models;
full_state_dict called on one rank only says so instead of hanging."""

from __future__ import annotations

import numpy as np
import pytest
from checkpoint_workers import (
    EXPERTS,
    bad_dst,
    full_round_trip,
    load,
    one_rank_only,
    optimizer_load,
    optimizer_save,
    save,
    state_dict_forms,
)
from dist_utils import run_distributed

# (world, wrap, data-parallel size); expert-parallel size = world / dp
SAVES = [(2, "none", 1), (2, "ddp", 1), (2, "fsdp2", 1), (3, "none", 1), (3, "ddp", 1),
         (3, "fsdp2", 1), (4, "fsdp2", 2)]  # fmt: skip
# loads of a checkpoint saved at ep=2 through the torch.distributed.checkpoint.state_dict
# helpers (no wrapper prefix): other expert-parallel sizes, other wrappers
ELSEWHERE = [(1, "none", 1), (2, "ddp", 2), (2, "fsdp2", 2), (3, "fsdp2", 1), (4, "fsdp2", 2),
             (4, "ddp", 2)]  # fmt: skip


def _api(wrap: str) -> str:
    return "plain" if wrap == "none" else "dcp_helpers"


@pytest.mark.parametrize("world,wrap,dp", SAVES)
def test_dcp_round_trip(tmp_path, world, wrap, dp):
    """model.state_dict() -> dcp.save -> dcp.load -> load_state_dict, the same layout: every
    rank's experts come back (the experts are one DTensor [E, ...] in the state dict)."""
    path = str(tmp_path / "ckpt")
    forms = run_distributed(save, world, path, wrap, dp, "plain")
    prefix = "module." if wrap == "ddp" else ""
    for form in forms:
        assert f"{prefix}moe.dispatch_stats" not in form["keys"]
        assert form["experts"] == {
            f"{prefix}moe.experts.w1": ("DTensor", (6, 16, 16)),
            f"{prefix}moe.experts.w2": ("DTensor", (6, 16, 16)),
        }
        assert form["router"] == ("DTensor" if wrap == "fsdp2" else "Tensor")
    assert run_distributed(load, world, path, wrap, dp, "plain") == [[]] * world


@pytest.fixture(scope="module")
def ep2_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ep2") / "ckpt")
    run_distributed(save, 2, path, "none", 1, "dcp_helpers")
    return path


@pytest.mark.parametrize("world,wrap,dp", ELSEWHERE)
def test_dcp_loads_at_another_expert_parallel_size(ep2_checkpoint, world, wrap, dp):
    got = run_distributed(load, world, ep2_checkpoint, wrap, dp, "dcp_helpers")
    assert got == [[]] * world


@pytest.mark.parametrize("world,wrap,dp", [(2, "ddp", 1), (2, "fsdp2", 2), (3, "none", 1),
                                           (4, "fsdp2", 2)])  # fmt: skip
def test_full_state_dict_of_a_wrapped_model(world, wrap, dp):
    """Standard keys, every expert, on rank dst only; loads at any layout."""
    results = run_distributed(full_round_trip, world, wrap, dp)
    for rank, got in enumerate(results):
        assert got["none"] == (rank != world - 1)
        assert got["loaded_differ"] == []
    last = results[-1]
    assert last["differ"] == []
    assert results[0]["torch_differ"] == []
    assert last["keys"] == ["head", "moe.experts.w1", "moe.experts.w2", "moe.router",
                            "pre.bias", "pre.weight"]  # fmt: skip


@pytest.mark.parametrize("others", ["barrier", "exit"])
def test_full_state_dict_on_one_rank_only_says_so(others):
    """``if rank == 0: full_state_dict(model)``: rank 0 raises the fix, after its timeout if
    the other rank went on to a barrier (which then fails when rank 0 exits: no hang), at
    once if it has ended."""
    got = run_distributed(one_rank_only, 2, others, finish=False, timeout=120)
    reason = "Timed out waiting" if others == "barrier" else "Connection closed by peer"
    assert got[0].startswith(f"full_state_dict: not every rank joined it ({reason}"), got[0]
    assert "waited up to 3.0 s). It is a collective: call it on every rank, not only" in got[0]
    assert "Connection closed by peer" in got[1] if others == "barrier" else got[1] == "exited"


@pytest.mark.parametrize("world", [2, 3])
def test_full_state_dict_arguments_that_differ_raise_on_every_rank(world):
    got = run_distributed(bad_dst, world)
    if world == 2:  # rank 1 passes dst=5
        want = "full_state_dict: bad arguments on rank(s) [1] of the group: rank 1: dst must be"
    else:
        want = "full_state_dict: dst differs between ranks ([0, 1, 2] by rank)"
    assert all(g.startswith(want) for g in got), got


def _full_moments(pieces: list) -> list[np.ndarray]:
    """Every expert's moments from the ranks' (first row, local moments)."""
    full = [np.full((EXPERTS, *m.shape[1:]), np.nan, m.dtype) for m in pieces[0][1]]
    for start, moments in pieces:
        for f, m in zip(full, moments, strict=True):
            f[start : start + len(m)] = m
    assert not any(np.isnan(f).any() for f in full)
    return full


@pytest.mark.parametrize("save_at,load_at", [
    ((2, "none", 1), [(2, "none", 1), (1, "none", 1), (2, "fsdp2", 2), (2, "ddp", 2)]),
    ((3, "ddp", 1), [(3, "ddp", 1)]),
    ((4, "fsdp2", 2), [(4, "fsdp2", 2), (2, "fsdp2", 1)]),
])  # fmt: skip
def test_optimizer_state_round_trip(tmp_path, save_at, load_at):
    """prepare_optimizer: the experts' Adam moments come back bit for bit through dcp
    (get/set_optimizer_state_dict), at the same and at other layouts."""
    path = str(tmp_path / "ckpt")
    world, wrap, dp = save_at
    want = _full_moments(run_distributed(optimizer_save, world, path, wrap, dp))
    for world, wrap, dp in load_at:
        for start, moments in run_distributed(optimizer_load, world, path, wrap, dp):
            for w, m in zip(want, moments, strict=True):
                assert np.array_equal(m, w[start : start + len(m)]), (world, wrap, dp)


def test_load_state_dict_takes_full_local_and_dtensor_experts():
    for got in run_distributed(state_dict_forms, 2):
        assert got["full"] and got["local"] and got["dtensor"]
        assert "size mismatch for experts.w1" in got["wrong shape"]
        assert got["no layer"] == "prepare_optimizer: model has no ExpertParallelMoE layer"
        assert got["partial"] == "state['experts.w2']: expected shape (6, 16, 16), got (2, 16, 16)"
