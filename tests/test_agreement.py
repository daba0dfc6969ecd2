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
)
from dist_utils import run_distributed

from mxfp8_a2a.exchange import checks

HANG = 120  # seconds: far above what these runs take on 2 CPU cores (compiling included)


@pytest.mark.parametrize("from_env", [True, False], ids=["env", "validate-arg"])
def test_compiled_and_eager_ranks_validate_alike(monkeypatch, from_env):
    """Cases 1-2: validation on every rank, one compiled: no hang, the same errors."""
    if from_env:  # read by the workers when they import the package
        monkeypatch.setenv(checks.VALIDATE_ENV, "1")
    run_distributed(compiled_and_eager_validate, 2, from_env, timeout=HANG)


def test_static_dispatch_compiled_and_eager_ranks(monkeypatch):
    monkeypatch.setenv(checks.VALIDATE_ENV, "1")
    run_distributed(static_compiled_and_eager, 2, random.randrange(2**20), timeout=HANG)


def test_num_experts_that_differs_raises_alike():
    """Case 3: the counts message has one size whatever num_experts is."""
    run_distributed(num_experts_differ, 2, timeout=HANG)


def test_static_dispatch_with_num_experts_that_differs():
    run_distributed(static_num_experts_differ, 3, timeout=HANG)


@pytest.mark.parametrize("static", [False, True], ids=["synced", "static"])
def test_combine_refuses_the_rows_of_another_dispatch(static):
    """Case 4: a handle knows which dispatch it belongs to."""
    run_distributed(handle_of_another_dispatch, 2, static, timeout=HANG)
