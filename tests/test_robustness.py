"""Bad input on one rank, ranks that disagree, hangs: every case on a gloo group of 2-4
ranks (NCCL too where there are 2 GPUs), each with a short hang timeout, so that a hang
fails the test instead of blocking the run."""

from __future__ import annotations

import random

import pytest
import torch
from dist_utils import BACKENDS, run_distributed
from moe_robustness_workers import combine_bad_rows_on_one_rank, moe_errors, uneven_tokens
from robustness_workers import (
    compiled_and_eager_ranks,
    double_backward,
    exchange_errors,
    validate_on_one_rank,
)

from mxfp8_a2a.exchange import checks

HANG = 90  # seconds: far above what these runs take (under 15 s each on 2 CPU cores)


def _seed() -> int:
    return random.SystemRandom().randrange(2**20)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_on_one_rank_raises_alike_on_every_rank(backend):
    world = 3 if backend == "gloo" else torch.cuda.device_count()
    if world < 3:
        pytest.skip("needs 3 ranks (a rank outside a two-rank group)")
    run_distributed(exchange_errors, world, backend, backend=backend, timeout=HANG)


def test_double_backward_matches_all_to_all_single_autograd():
    run_distributed(double_backward, 3, _seed(), timeout=HANG)


def test_validate_env_is_read_once_at_import(monkeypatch):
    monkeypatch.setenv(checks.VALIDATE_ENV, "1")
    assert checks.validating(False) is checks.VALIDATE_FROM_ENV  # unchanged by the setenv
    assert checks.validating(True)


def test_validate_on_one_rank_only_ends_in_the_group_timeout():
    """The contract is that every rank passes the same validate; one that does not gets a
    bounded failure on every rank (the process group's timeout, 10 s here), not garbage."""
    outcomes = run_distributed(validate_on_one_rank, 2, timeout=HANG, pg_timeout=10, finish=False)
    for status, message, seconds in outcomes:  # a rank times out, its peer then loses it
        assert status == "RuntimeError" and seconds < 60, outcomes
        assert "Timed out" in message or "Connection closed" in message, outcomes
    assert any("Timed out" in message for _, message, _ in outcomes), outcomes


@pytest.mark.parametrize(
    "cases",
    [
        [([4, 6], 0), ([0, 0], 2), ([0, 9], 1)],  # top_k = 0; no tokens anywhere; one rank
        [([0, 5, 12], 2)],
        [([7, 0, 0, 3], 1)],
    ],
    ids=["2-ranks", "3-ranks", "4-ranks"],
)
def test_moe_uneven_tokens_match_reference(cases):
    """Ranks with no tokens in a step (normal in MoE training), and top_k = 0."""
    run_distributed(uneven_tokens, len(cases[0][0]), _seed(), cases, timeout=HANG)


def test_moe_bad_input_raises_alike_on_every_rank():
    run_distributed(moe_errors, 3, timeout=HANG)


def test_combine_with_bad_rows_on_one_rank_fails_fast():
    outcomes = run_distributed(combine_bad_rows_on_one_rank, 2, timeout=HANG, finish=False)
    (status0, message0, _), (status1, message1, seconds1) = outcomes
    assert status0 == "ValueError" and "expert_y must be" in message0, outcomes
    assert status1 == "RuntimeError" and seconds1 < 30, outcomes


def test_splits_lists_accept_only_integers():
    cases = [[1.0, 2.0], [True, 1], "12", [None], 3]
    for bad in cases:
        with pytest.raises(TypeError, match="input_splits"):
            checks.splits_list(bad, "input_splits", None)
    assert checks.splits_list(torch.tensor([1, 2]), "s", None) == [1, 2]
    assert checks.splits_list((v for v in (3, 4)), "s", None) == [3, 4]
    assert checks.splits_list([torch.tensor(5)], "s", None) == [5]
    with pytest.raises(ValueError, match=r"input_splits\[1\] = -2"):
        checks.check_counts([1, -2], "input_splits", 2)


def test_compiled_and_eager_ranks_move_the_same_bytes():
    run_distributed(compiled_and_eager_ranks, 2, backend="gloo", timeout=180)


def test_dispatch_tells_every_transport_apart():
    """dispatch's agreement word differs between the NCCL and copy-engine transports at every
    setting (a 4-bit code once gave both the same, so a rank on each passed the check)."""
    import mxfp8_a2a as mx
    from mxfp8_a2a.exchange import agreement
    from mxfp8_a2a.exchange.nccl import NCCL
    from mxfp8_a2a.moe.terms import DISPATCH

    def word(exchange, transport):
        args = dict(x=torch.zeros(2, 64), topk_ids=torch.zeros(2, 2), num_experts=4,
                               exchange=exchange, transport=transport, topology=None)  # fmt: skip
        return agreement.word(agreement.FINE, agreement.terms_of(DISPATCH, args))

    group = object()  # the transport's group is not used by its terms
    codes = [word("mxfp8", NCCL), word("mxfp8", mx.CopyEngineTransport(group))]
    codes += [word("mxfp8", mx.CopyEngineTransport(group, s)) for s in range(1, 65)]
    assert len(set(codes)) == len(codes)
    assert word("bf16", NCCL) == word("bf16", mx.CopyEngineTransport(group))


def test_nccl_transport_rejects_cpu_tensors_on_an_nccl_group(monkeypatch):
    """A CPU x on an NCCL group is a bad argument of its rank (gathered by validate=True),
    not a failure inside the collective that leaves the other ranks waiting."""
    from mxfp8_a2a import _common
    from mxfp8_a2a.exchange import nccl

    monkeypatch.setattr(_common, "capability", lambda device: (9, 0))  # a GPU with e4m3
    monkeypatch.setattr(checks.dist, "is_initialized", lambda: True)  # (an NCCL group)
    monkeypatch.setattr(checks.dist, "get_backend", lambda group: "nccl")
    with pytest.raises(ValueError, match=r"the group's backend \(NCCL\) takes CUDA tensors"):
        nccl.NCCL.check(torch.device("cpu"), None)
    nccl.NCCL.check(torch.device("cuda", 0), None)
    monkeypatch.setattr(checks.dist, "get_backend", lambda group: "cpu:gloo,cuda:nccl")
    nccl.NCCL.check(torch.device("cpu"), None)


@pytest.mark.parametrize("cap, fails", [((8, 0), True), ((8, 6), True), ((8, 9), False)])
def test_gpus_without_e4m3_get_a_clear_error(monkeypatch, cap, fails):
    """Before sm_89 (A100: sm_80) Triton has no e4m3: the FP8 kernels' launchers and the MXFP8
    transports' checks (run before any collective) say so and name the bf16 alternatives,
    instead of a Triton compile error from inside the exchange."""
    from mxfp8_a2a import _common
    from mxfp8_a2a.exchange.nccl import NCCL

    monkeypatch.setattr(_common, "capability", lambda device: cap)
    gpu = torch.device("cuda", 0)  # (not touched: the capability is the patched one)
    if not fails:
        _common.check_e4m3_gpu(gpu)
        NCCL.check(gpu, None)
        return
    with pytest.raises(RuntimeError, match=r"8\.9 or newer.*sm_8\d.*exchange='bf16'"):
        _common.check_e4m3_gpu(gpu)
    with pytest.raises(ValueError, match=r"8\.9 or newer"):
        NCCL.check(gpu, None)
    _common.check_e4m3_gpu(torch.device("cpu"))  # the interpreter and references: any machine
