"""The MXFP8 exchange on spawned process groups: gloo on CPU (CI), NCCL on the GPUs.

NCCL runs one rank per GPU; the tests in ANY_GPUS and the CUDA graph test also run on a
single GPU (a group of one rank exchanging with itself: the same kernels, plans and
collective calls), the rest need 2.
"""

from __future__ import annotations

import random

import pytest
import torch
from a2a_call_workers import (
    bad_input,
    compiled,
    edge_cases,
    graph_capture,
    memory_flat,
    public_fallbacks,
)
from a2a_workers import (
    exact_forward_backward,
    exact_large,
    plain_exchange,
    repeated_calls,
    routing,
    sqnr_vs_bf16,
)
from dist_utils import BACKENDS, run_distributed

import mxfp8_a2a as mx
from mxfp8_a2a.exchange.rows import wire_row

GLOO_WORLDS = [2, 3, 4]
ANY_GPUS = [
    BACKENDS[0],
    pytest.param(
        "nccl",
        id="nccl",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ),
]


def _worlds(backend: str) -> list[int]:
    return GLOO_WORLDS if backend == "gloo" else [torch.cuda.device_count()]


def _seed() -> int:
    return random.SystemRandom().randrange(2**31)


@pytest.mark.parametrize("k", [32, 96, 5120, 7168])
def test_wire_rows_are_16_byte_aligned(k):
    row = wire_row(k)
    assert row % 16 == 0 and 0 <= row - mx.packed_row_bytes(k) < 16


@pytest.mark.parametrize("backend", ANY_GPUS)
def test_exact_forward_backward(backend):
    for world in _worlds(backend):
        for dtype, mode in [(torch.bfloat16, "rceil"), (torch.float32, "floor")]:
            seed = _seed()
            run_distributed(
                exact_forward_backward, world, backend, seed, 96, dtype, mode, backend=backend
            )


@pytest.mark.parametrize("backend", ANY_GPUS)
def test_public_fallbacks_give_the_same_bits(backend):
    world = 2 if backend == "gloo" else torch.cuda.device_count()
    run_distributed(public_fallbacks, world, backend, backend=backend)


@pytest.mark.parametrize("backend", ANY_GPUS)
def test_plain_exchange_exact(backend):
    for world in _worlds(backend):
        run_distributed(plain_exchange, world, backend, _seed(), backend=backend)


@pytest.mark.parametrize("backend", ANY_GPUS[1:])
def test_exact_large_messages(backend):
    run_distributed(exact_large, _worlds(backend)[0], backend, _seed(), backend=backend)


@pytest.mark.parametrize("backend", ANY_GPUS)
def test_repeated_calls_exact(backend):
    run_distributed(repeated_calls, _worlds(backend)[0], backend, _seed(), backend=backend)


@pytest.mark.parametrize("backend", ANY_GPUS)
def test_routing(backend):
    worlds = _worlds(backend) + ([8] if backend == "gloo" else [])
    for world in worlds:
        run_distributed(routing, world, backend, _seed(), backend=backend)


@pytest.mark.parametrize("backend", ANY_GPUS)
def test_sqnr_vs_bf16_exchange(backend):
    world = _worlds(backend)[0]
    for fwd, grad in run_distributed(sqnr_vs_bf16, world, backend, _seed(), backend=backend):
        assert fwd >= 30.0 and grad >= 28.0, (fwd, grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_edge_cases(backend):
    for world in _worlds(backend)[:2]:
        run_distributed(edge_cases, world, backend, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_raises_on_every_rank(backend):
    world = _worlds(backend)[-1]
    run_distributed(bad_input, world, backend, backend=backend)


def test_memory_flat_over_3000_calls():
    # at most 2 KiB a call (x is 2 KiB); a fresh group's ranks grew by under 2 MiB here
    growth = run_distributed(memory_flat, 2, "gloo", 3000)
    assert max(growth) < 6 * 1024, f"max RSS grew by {growth} KiB over 3000 calls"


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph(backend):
    run_distributed(compiled, 2, backend, backend=backend)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (one rank per GPU)")
def test_cuda_graph_capture():
    run_distributed(graph_capture, torch.cuda.device_count(), "nccl", _seed(), backend="nccl")


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(validate=True), "validate=False"),
        (dict(output_splits=torch.tensor([1, 1], device="meta")), "list of ints"),
        (dict(transport=mx.CopyEngineTransport.__new__(mx.CopyEngineTransport)), "captured"),
    ],
)
def test_capture_check_names_what_would_synchronize(bad, match):
    """What to_mxfp8_a2a_dequant checks under CUDA graph capture (the CUDA path itself runs
    in test_cuda_graph_capture)."""
    from mxfp8_a2a.exchange.checks import check_capturable
    from mxfp8_a2a.exchange.nccl import NCCL

    args = dict(output_splits=[1, 1], input_splits=[1, 1], validate=False, transport=NCCL)
    with pytest.raises(ValueError, match=match):
        check_capturable(**(args | bad))
    check_capturable([1, 1], torch.tensor([1, 1]), False, NCCL)  # CPU splits pass


def test_capture_check_sees_the_validate_environment(monkeypatch):
    from mxfp8_a2a.exchange import checks
    from mxfp8_a2a.exchange.nccl import NCCL

    monkeypatch.setattr(checks, "VALIDATE_FROM_ENV", True)  # as if set before the import
    with pytest.raises(ValueError, match=checks.VALIDATE_ENV):
        checks.check_capturable([1, 1], [1, 1], False, NCCL)


def test_copy_engine_row_ranges():
    from mxfp8_a2a.exchange.copy_engine import row_ranges

    assert row_ranges(7, 3) == [(0, 2), (2, 4), (4, 7)]
    assert row_ranges(1, 3) == [(0, 0), (0, 0), (0, 1)]
    assert row_ranges(0, 2) == [(0, 0), (0, 0)]


def test_copy_engine_auto_row_ranges(monkeypatch):
    from mxfp8_a2a import _config
    from mxfp8_a2a.exchange.copy_engine import auto_row_ranges

    monkeypatch.setattr(_config, "COPY_ENGINE_RANGE_BYTES", 1000)
    monkeypatch.setattr(_config, "COPY_ENGINE_MAX_RANGES", 3)
    # 144-byte rows (128 columns + 4 scale bytes, padded to 16): 1000 bytes per range
    assert [auto_row_ranges(r, 128) for r in (0, 6, 7, 13, 14, 21, 10**6)] == [1, 1, 1, 1, 2, 3, 3]


def test_copy_engine_row_ranges_argument():
    with pytest.raises(ValueError, match="row_ranges must be None or a positive int"):
        mx.CopyEngineTransport(row_ranges=0)
