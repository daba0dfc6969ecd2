"""The static layer's options inside one CUDA graph (a group of one rank over NCCL): SwiGLU
experts, DeepSeek-V3's bias balancing with update_balance_bias() in the captured step, the
balancing loss added to the loss, node-limited routing, FP8 experts with SwiGLU. For each,
forward + backward (+ the bias update) captured once and replayed with fresh tokens equals
the eager step bit for bit (output, every gradient, the bias), and torch.compile(fullgraph=True)
traces the forward with the option on."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_utils import run_distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOKENS, HIDDEN, FFN, EXPERTS, TOP_K = 384, 256, 128, 8, 2
OPTIONS = {  # name: (layer keyword arguments, balancing-loss coefficient, bias update)
    "swiglu": (dict(activation="swiglu"), 0.0, False),
    "balance_bias": (dict(balance_bias=True), 0.0, True),
    "balance_loss": (dict(), 0.01, False),
    "route_groups": (dict(route_groups=(4, 2)), 0.0, False),
    "fp8_swiglu": (dict(activation="swiglu", precision="fp8_rowwise"), 0.0, False),
}


def _layer(options: dict, device: str) -> torch.nn.Module:
    from mxfp8_a2a.moe.layer import ExpertParallelMoE

    layer = ExpertParallelMoE(HIDDEN, FFN, EXPERTS, TOP_K, capacity_factor=1.5,
                              max_tokens=TOKENS, seed=3, **options)  # fmt: skip
    return layer.to(device=device, dtype=torch.bfloat16)


def _step(layer, x, grad, coef: float, update: bool, forward=None) -> torch.Tensor:
    """One training step's layer work: forward (``forward``, default the layer itself), loss
    (+ coef * balance_loss), backward, and the bias update. Returns the output."""
    out = (layer if forward is None else forward)(x)
    loss = (out.float() * grad.float()).sum()
    if coef:
        loss = loss + coef * layer.balance_loss()
    loss.backward()
    if update:
        layer.update_balance_bias(1e-2)
    return out


def _state(layer, x) -> list[torch.Tensor]:
    bias = [] if layer.expert_bias is None else [layer.expert_bias.clone()]
    return [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()] + bias


def graph_replays_equal_eager(rank, world, name, replays, device="cuda"):
    """Capture the step once, replay it with fresh tokens and gradients; each replay against
    an eager copy of the layer stepping on the same inputs. device="cpu" runs the same
    comparison without the graph (a check of the step itself)."""
    options, coef, update = OPTIONS[name]
    torch.manual_seed(0)
    layer = _layer(options, device)
    eager = copy.deepcopy(layer)
    x = torch.randn(TOKENS, HIDDEN, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    step = lambda: _step(layer, x, grad, coef, update)  # noqa: E731
    if device == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture (autotuning, workspaces)
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        eager.load_state_dict(layer.state_dict())  # the bias moved in the warm-up
        layer.zero_grad(set_to_none=True)
        x.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
    for i in range(replays):
        scale = 2.0 ** (i % 7 - 3)  # fresh tokens (so fresh routing) and gradients, many scales
        with torch.no_grad():
            x.copy_(torch.randn_like(x) * scale)
            grad.copy_(torch.randn_like(grad))
        if device == "cuda":
            graph.replay()
        else:
            layer.zero_grad(set_to_none=True)
            x.grad = None
            out = step()
        xe = x.detach().clone().requires_grad_(True)
        eager.zero_grad(set_to_none=True)
        ref = _step(eager, xe, grad, coef, update)
        assert torch.equal(out, ref), (name, i)
        for j, (a, b) in enumerate(zip(_state(layer, x), _state(eager, xe), strict=True)):
            assert torch.equal(a, b), (name, i, j)
    return True


def compiled_matches_eager(rank, world, name, device="cuda"):
    """torch.compile(fullgraph=True) of the forward with the option on; the step's output,
    gradients and bias close to eager's, normwise: Inductor fuses the router's product
    differently, so a few tokens near a tie choose another expert (~1% of the rows)."""
    options, coef, update = OPTIONS[name]
    torch.manual_seed(0)
    layer = _layer(options, device)
    eager = copy.deepcopy(layer)
    compiled = torch.compile(layer, fullgraph=True)
    for _ in range(2):  # the second step sees the first's bias
        x = torch.randn(TOKENS, HIDDEN, device=device, dtype=torch.bfloat16)
        grad = torch.randn_like(x)
        xc, xe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        out = _step(layer, xc, grad, coef, update, forward=compiled)
        ref = _step(eager, xe, grad, coef, update)
        for a, b in zip([out] + _state(layer, xc), [ref] + _state(eager, xe), strict=True):
            diff = (a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)
            assert diff < 0.1, (name, diff.item())
    return True


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_layer_option_graph_replays_equal_eager(name):
    assert run_distributed(graph_replays_equal_eager, 1, name, 30, backend="nccl",
                           timeout=600) == [True]  # fmt: skip


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_layer_option_compiles_fullgraph(name):
    assert run_distributed(compiled_matches_eager, 1, name, backend="nccl",
                           timeout=600) == [True]  # fmt: skip
