"""The static dispatch's promises on one GPU (a group of one rank over NCCL): the whole
layer's forward + backward captured in one CUDA graph and replayed with fresh inputs equals
the eager static path bit for bit, and torch.compile(fullgraph=True) traces the layer."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_utils import run_distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPE = dict(hidden=256, ffn=128, experts=8, top_k=2, tokens=384)


def _layer(exchange, precision):
    from mxfp8_a2a.moe.layer import ExpertParallelMoE

    s = SHAPE
    layer = ExpertParallelMoE(s["hidden"], s["ffn"], s["experts"], s["top_k"], exchange=exchange,
                              precision=precision, capacity_factor=1.5, max_tokens=s["tokens"],
                              seed=3)  # fmt: skip
    return layer.cuda().to(torch.bfloat16)


def _grads(layer, x):
    return [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]


def graph_replays_equal_eager(rank, world, exchange, precision, replays):
    torch.manual_seed(0)
    layer = _layer(exchange, precision)
    eager = copy.deepcopy(layer)
    x = torch.randn(SHAPE["tokens"], SHAPE["hidden"], device="cuda", dtype=torch.bfloat16)
    x.requires_grad_(True)
    grad = torch.randn_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            layer(x).backward(grad)
    torch.cuda.current_stream().wait_stream(side)
    layer.zero_grad(set_to_none=True)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
        out.backward(grad)
    for i in range(replays):
        scale = 2.0 ** (i % 7 - 3)  # fresh tokens (so fresh routing) and gradients, many scales
        with torch.no_grad():
            x.copy_(torch.randn_like(x) * scale)
            grad.copy_(torch.randn_like(grad))
        graph.replay()
        xe = x.detach().clone().requires_grad_(True)
        eager.zero_grad(set_to_none=True)
        ref = eager(xe)
        ref.backward(grad)
        assert torch.equal(out, ref), i
        for a, b in zip(_grads(layer, x), _grads(eager, xe), strict=True):
            assert torch.equal(a, b), i
    return True


def compiled_layer_matches_eager(rank, world, exchange):
    torch.manual_seed(0)
    layer = _layer(exchange, "bf16")
    eager = copy.deepcopy(layer)
    x = torch.randn(SHAPE["tokens"], SHAPE["hidden"], device="cuda", dtype=torch.bfloat16)
    xc, xe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    compiled = torch.compile(layer, fullgraph=True)
    grad = torch.randn_like(x)
    compiled(xc).backward(grad)
    eager(xe).backward(grad)
    for a, b in zip(_grads(layer, xc), _grads(eager, xe), strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    return True


@pytest.mark.parametrize("precision", ["bf16", "fp8_rowwise"])
@pytest.mark.parametrize("exchange", ["mxfp8", "bf16", "mxfp8_to_experts"])
def test_layer_graph_replays_equal_eager(exchange, precision):
    assert run_distributed(graph_replays_equal_eager, 1, exchange, precision, 100,
                           backend="nccl", timeout=600) == [True]  # fmt: skip


@pytest.mark.parametrize("exchange", ["mxfp8", "bf16", "mxfp8_to_experts"])
def test_layer_compiles_fullgraph(exchange):
    assert run_distributed(compiled_layer_matches_eager, 1, exchange, backend="nccl",
                           timeout=600) == [True]  # fmt: skip
