"""Worker bodies for the MoE tests: the expert-parallel layer against a single-process
reference that holds every expert, on data every rank can rebuild from the seed."""

from __future__ import annotations

import torch
import torch.distributed as dist
from a2a_workers import device_for
from helpers import sqnr_db
from moe_reference import moe_reference

import mxfp8_a2a as mx
from mxfp8_a2a.moe.layer import ExpertParallelMoE, init_moe_weights
from mxfp8_a2a.moe.routing import route

HIDDEN, FFN, TOKENS = 64, 32, 12


def _inputs(
    src: int, seed: int, dev, routing: str, tokens: int = TOKENS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens of rank ``src`` and the output gradient. For the biased routings the features
    are made positive, so that the router bias pushes every token the same way."""
    g = torch.Generator().manual_seed(seed * 100 + src)
    x = torch.randn(tokens, HIDDEN, generator=g)
    if routing != "normal":
        x = x.abs()
    return x.to(dev), torch.randn(tokens, HIDDEN, generator=g).to(dev)


def _bias_router(router: torch.Tensor, routing: str) -> None:
    # Logits are x @ router (no bias term); with positive features, +-50 on a column moves
    # every token's logit for that expert by 50 * sum(x), about +-2500.
    if routing == "one_expert":  # every token's first choice is expert 0
        router[:, 0] += 50.0
    elif routing == "empty_experts":  # the last two experts never win
        router[:, -2:] -= 50.0


def _layer(world, rank_dev, seed, top_k, exchange, routing, experts):
    layer = ExpertParallelMoE(HIDDEN, FFN, experts, top_k, exchange=exchange, seed=seed).to(
        rank_dev
    )
    with torch.no_grad():
        _bias_router(layer.router, routing)
    return layer


def matches_reference(rank, world, backend, seed, top_k, routing):
    """Plain ("bf16") exchange: forward and every gradient match the reference."""
    dev = device_for(backend)
    experts = 2 * world
    layer = _layer(world, dev, seed, top_k, "bf16", routing, experts)
    x, g = _inputs(rank, seed, dev, routing)
    _, ids = route(x @ layer.router.detach(), top_k)
    if routing == "one_expert":
        assert (ids[:, 0] == 0).all()
    elif routing == "empty_experts":
        assert (ids < experts - 2).all()
    x.requires_grad_(True)
    out = layer(x)
    (out * g).sum().backward()
    router_grad = layer.router.grad.clone()
    dist.all_reduce(router_grad)  # the router is replicated: its gradient is the sum over ranks

    ref_w = {
        k: v.to(dev).requires_grad_(True)
        for k, v in init_moe_weights(HIDDEN, FFN, experts, seed).items()
    }
    with torch.no_grad():
        _bias_router(ref_w["router"], routing)
    xs, gs = zip(*(_inputs(r, seed, dev, routing) for r in range(world)), strict=True)
    x_all = torch.cat(xs).requires_grad_(True)
    ref = moe_reference(x_all, ref_w, top_k)
    (ref * torch.cat(gs)).sum().backward()
    rows = slice(rank * TOKENS, (rank + 1) * TOKENS)
    assert_matches_reference(out, x, router_grad, layer, ref, x_all, ref_w, rows, rank, world)


def assert_matches_reference(out, x, router_grad, layer, ref, x_all, ref_w, rows, rank, world):
    """This rank's output and gradients (x, the summed router, its local experts' w1 and w2)
    against the single-process reference's, ``rows`` being this rank's tokens in it."""
    experts = ref_w["w1"].shape[0]
    local = slice(rank * experts // world, (rank + 1) * experts // world)
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, ref[rows], **tol)
    torch.testing.assert_close(x.grad, x_all.grad[rows], **tol)
    torch.testing.assert_close(router_grad, ref_w["router"].grad, **tol)
    torch.testing.assert_close(layer.w1.grad, ref_w["w1"].grad[local], **tol)
    torch.testing.assert_close(layer.w2.grad, ref_w["w2"].grad[local], **tol)


def mxfp8_vs_bf16(rank, world, backend, seed, top_k, routing, tokens):
    """SQNR of the MXFP8-exchange layer against the plain-exchange layer: output, grad x,
    over ``tokens`` tokens per rank."""
    dev = device_for(backend)
    results = []
    for exchange in ("bf16", "mxfp8"):
        layer = _layer(world, dev, seed, top_k, exchange, routing, 2 * world)
        x, g = _inputs(rank, seed, dev, routing, tokens)
        x = x.to(torch.bfloat16).requires_grad_(True)
        layer = layer.to(torch.bfloat16)
        out = layer(x)
        (out.float() * g).sum().backward()
        results.append((out.detach().double(), x.grad.double()))
    (ref_out, ref_grad), (out, grad) = results

    return sqnr_db(ref_out, out), sqnr_db(ref_grad, grad)


def copy_engine_matches_nccl(rank, world, backend, seed, top_k, routing, tokens):
    """The MXFP8 layer through the copy engines against the same layer through NCCL (fp32,
    two ranks): the same output bit for bit (both exchanges give dequantize(quantize(row)));
    gradients equal up to the order of the atomic adds that gather x's rows."""
    dev = device_for(backend)
    results = []
    for transport in ("nccl", mx.CopyEngineTransport()):
        layer = ExpertParallelMoE(
            HIDDEN, FFN, 2 * world, top_k, exchange="mxfp8", transport=transport, seed=seed
        ).to(dev)
        with torch.no_grad():
            _bias_router(layer.router, routing)
        x, g = _inputs(rank, seed, dev, routing, tokens)
        x.requires_grad_(True)
        out = layer(x)
        (out * g).sum().backward()
        results.append((out.detach(), x.grad, layer.w1.grad, layer.w2.grad, layer.router.grad))
    (out_n, *grads_n), (out_c, *grads_c) = results
    assert torch.equal(out_n, out_c), (out_n - out_c).abs().max()
    for a, b in zip(grads_n, grads_c, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def copy_engine_needs_cuda_pair(rank, world, backend):
    """A CopyEngineTransport on CPU tensors: dispatch raises a ValueError naming the
    transport on every rank."""
    layer = ExpertParallelMoE(HIDDEN, FFN, 2 * world, 1, transport=mx.CopyEngineTransport(), seed=0)
    x, _ = _inputs(rank, 0, torch.device("cpu"), "normal")
    try:
        layer(x)
    except ValueError as e:
        assert "CopyEngineTransport needs CUDA tensors" in str(e), e
        return True
    raise AssertionError("no ValueError for a CopyEngineTransport on CPU tensors")
