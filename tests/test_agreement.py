"""Ranks that differ in how they run (compiled or eager with validation, num_experts, a
handle from another dispatch, a weight changed in place on one rank): each case on a
spawned gloo group with a hang timeout, so that a hang fails the test."""

from __future__ import annotations

import random

import pytest
from agreement_workers import (
    compiled_and_eager_validate,
    handle_of_another_dispatch,
    num_experts_differ,
    static_compiled_and_eager,
    static_num_experts_differ,
    weight_changed_on_one_rank,
)
from dist_utils import run_distributed

from mxfp8_a2a.exchange import checks

HANG = 120  # seconds: far above what these runs take on 2 CPU cores (compiling included)


@pytest.mark.parametrize("from_env", [True, False], ids=["env", "validate-arg"])
def test_compiled_and_eager_ranks_validate_alike(monkeypatch, from_env):
    """Cases 1-2: validation on every rank, one compiled: no hang, the same errors."""
    if from_env:  # read by the workers when they import the package
        monkeypatch.setenv(checks.VALIDATE_ENV, "1")
    # fresh: the environment is read when the package is imported
    run_distributed(compiled_and_eager_validate, 2, from_env, timeout=HANG, fresh=from_env)


def test_static_dispatch_compiled_and_eager_ranks(monkeypatch):
    monkeypatch.setenv(checks.VALIDATE_ENV, "1")
    seed = random.randrange(2**20)
    run_distributed(static_compiled_and_eager, 2, seed, timeout=HANG, fresh=True)


def test_num_experts_that_differs_raises_alike():
    """Case 3: the counts message has one size whatever num_experts is."""
    run_distributed(num_experts_differ, 2, timeout=HANG)


def test_static_dispatch_with_num_experts_that_differs():
    run_distributed(static_num_experts_differ, 3, timeout=HANG)


@pytest.mark.parametrize("static", [False, True], ids=["synced", "static"])
def test_combine_refuses_the_rows_of_another_dispatch(static):
    """Case 4: a handle knows which dispatch it belongs to."""
    run_distributed(handle_of_another_dispatch, 2, static, timeout=HANG)


def test_weight_changed_in_place_on_one_rank_raises_before_dispatch():
    """Case 5, synced dispatch: the same error on every rank, no rank left waiting."""
    run_distributed(weight_changed_on_one_rank, 2, False, timeout=HANG, fresh=True)  # (patches)


def test_weight_changed_in_place_on_one_rank_static():
    """Case 5, static dispatch (no sync to tell the peers): rank 1 raises before any
    collective of the call; rank 0 fails as soon as rank 1's process ends."""
    outcomes = run_distributed(weight_changed_on_one_rank, 2, True, timeout=HANG, finish=False)
    (status0, _, seconds0), (status1, message1, _) = outcomes
    assert status1 == "ValueError" and "w1 changed" in message1, outcomes
    assert status0 == "RuntimeError" and seconds0 < 30, outcomes
