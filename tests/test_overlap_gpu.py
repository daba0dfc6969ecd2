"""The overlapped layer on one GPU (a group of one rank over NCCL), where the exchange runs
on its own stream and races could show: shared experts and chunks, eager and replayed from
a CUDA graph, bit-equal to the same layer on one stream (``overlap_streams = False``) for
100 fresh inputs; a kernel timeline where the exchange's kernels (at one rank: the row
kernels that encode and decode the wire rows; NCCL moves nothing) run while GEMMs do; and
torch.compile(fullgraph=True) of the static layer with both options."""

from __future__ import annotations

import copy
import json
import os
import re
import tempfile

import pytest
import torch
from dist_utils import run_distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOKENS, HIDDEN, FFN, EXPERTS, TOP_K, SHARED = 512, 512, 256, 8, 2, 2048
# the profiler's: at the small sizes the host (dispatch's Python) is slower than the GPU,
# which then runs one kernel at a time (H100, 2026-12-08: no kernels side by side at the
# small sizes, 20-29 pairs at these)
BIG = dict(tokens=8192, hidden=4096, ffn=1024, shared=16384)


def _layers(static: bool, n: int, tokens=TOKENS, hidden=HIDDEN, ffn=FFN, shared=SHARED):
    """(overlapped layer, the same layer on one stream), bf16 on the GPU."""
    from mxfp8_a2a.moe.layer import ExpertParallelMoE

    extra = dict(capacity_factor=1.5, max_tokens=tokens) if static else {}
    layer = ExpertParallelMoE(hidden, ffn, EXPERTS, TOP_K, seed=5, shared_ffn=shared,
                              overlap_chunks=n, **extra)  # fmt: skip
    layer = layer.to(device="cuda", dtype=torch.bfloat16)
    serial = copy.deepcopy(layer)
    serial.overlap_streams = False
    return layer, serial


def _step(layer, x, grad):
    out = layer(x)
    (out.float() * grad.float()).sum().backward()
    return out


def _state(layer, x) -> list[torch.Tensor]:
    return [x.grad] + [p.grad for p in layer.parameters()]


def _fresh(i: int, tokens: int, hidden: int = HIDDEN):
    scale = 2.0 ** (i % 7 - 3)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) * scale
    return x, torch.randn_like(x)


def eager_equals_serial(rank, world, static, n, inputs):
    layer, serial = _layers(static, n)
    for i in range(inputs):
        x, grad = _fresh(i, TOKENS - (i % 5) * 7)  # (token counts vary: allocations move)
        for m in (layer, serial):
            m.zero_grad(set_to_none=True)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        out, ref = _step(layer, xa, grad), _step(serial, xb, grad)
        assert torch.equal(out, ref), i
        for j, (a, b) in enumerate(zip(_state(layer, xa), _state(serial, xb), strict=True)):
            assert torch.equal(a, b), (i, j)
    return True


def graph_equals_serial(rank, world, n, replays):
    layer, serial = _layers(True, n)
    x = torch.zeros(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.zeros_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture
        for i in range(2):
            with torch.no_grad():
                x.copy_(_fresh(i, TOKENS)[0])
            _step(layer, x, grad)
    torch.cuda.current_stream().wait_stream(side)
    layer.zero_grad(set_to_none=True)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _step(layer, x, grad)
    for i in range(replays):
        fresh, g = _fresh(i, TOKENS)
        with torch.no_grad():
            x.copy_(fresh)
            grad.copy_(g)
        graph.replay()
        xe = fresh.clone().requires_grad_(True)
        serial.zero_grad(set_to_none=True)
        ref = _step(serial, xe, grad)
        assert torch.equal(out, ref), i
        for j, (a, b) in enumerate(zip(_state(layer, x), _state(serial, xe), strict=True)):
            assert torch.equal(a, b), (i, j)
    return True


GEMM = re.compile(r"gemm|nvjet|cutlass|xmma|wgmma", re.IGNORECASE)


def exchange_beside_gemm(rank, world, static, n):
    """A torch.profiler trace of forward + backward: some kernel on another stream than a
    GEMM's, not itself a GEMM, runs while that GEMM does. Returns the pair's names."""
    layer, _ = _layers(static, n, **BIG)
    x, grad = _fresh(0, BIG["tokens"], BIG["hidden"])
    x.requires_grad_(True)
    for _ in range(3):  # warm-up (autotuning, the comm stream)
        _step(layer, x, grad)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            _step(layer, x, grad)
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    gemms = [e for e in events if GEMM.search(e["name"])]
    others = [e for e in events if not GEMM.search(e["name"])]
    for g in gemms:
        for e in others:
            apart = e["args"].get("stream") != g["args"].get("stream")
            if apart and e["ts"] < g["ts"] + g["dur"] and g["ts"] < e["ts"] + e["dur"]:
                return [g["name"][:60], e["name"][:60]]
    raise AssertionError(f"no kernel beside a GEMM on another stream ({len(gemms)} GEMMs, "
                         f"{len(others)} others)")  # fmt: skip


def compiles_fullgraph(rank, world, n):
    layer, serial = _layers(True, n)
    compiled = torch.compile(layer, fullgraph=True)
    x, grad = _fresh(1, TOKENS)
    xc, xe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out, ref = _step(compiled, xc, grad), _step(serial, xe, grad)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(_state(layer, xc), _state(serial, xe), strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    return True


@pytest.mark.parametrize("static, n", [(False, 1), (False, 3), (True, 1), (True, 2)])
def test_overlapped_eager_equals_serial(static, n):
    assert run_distributed(eager_equals_serial, 1, static, n, 100, backend="nccl",
                           timeout=600) == [True]  # fmt: skip


@pytest.mark.parametrize("n", [1, 3])
def test_overlapped_graph_replays_equal_serial(n):
    assert run_distributed(graph_equals_serial, 1, n, 100, backend="nccl",
                           timeout=600) == [True]  # fmt: skip


@pytest.mark.parametrize("static, n", [(False, 1), (True, 2)])
def test_exchange_kernels_run_beside_gemms(static, n):
    pair = run_distributed(exchange_beside_gemm, 1, static, n, backend="nccl", timeout=600)
    print("overlapping kernels:", pair)


def test_overlapped_static_layer_compiles_fullgraph():
    assert run_distributed(compiles_fullgraph, 1, 2, backend="nccl", timeout=600) == [True]
