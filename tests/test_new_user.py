"""What a new user meets first: the clear errors, the version, checkpoints of compiled models
(one process, gloo)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import mxfp8_a2a as mx


def test_version():
    assert isinstance(mx.__version__, str) and mx.__version__


def test_layer_without_a_process_group_says_what_to_call():
    code = textwrap.dedent("""
        import mxfp8_a2a as mx
        try:
            mx.ExpertParallelMoE(64, 32, 4, 2)
        except RuntimeError as e:
            print(e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "init_process_group" in out.stdout, out.stdout + out.stderr


def test_wrong_width_names_the_last_dimension(group_of_one):
    layer = mx.ExpertParallelMoE(64, 32, 4, 2)
    with pytest.raises(ValueError, match=r"x must be a \[\.\.\., 64\] tensor \(hidden size last\)"):
        layer(torch.randn(2, 3, 48))


def test_fullgraph_compile_of_the_synced_layer_says_use_the_static_one(group_of_one):
    layer = mx.ExpertParallelMoE(64, 32, 4, 2)
    x = torch.randn(8, 64)
    with pytest.raises(Exception, match="static dispatch") as err:
        torch.compile(layer, fullgraph=True)(x)
    assert "host-synced dispatch" in str(err.value)
    torch._dynamo.reset()  # fullgraph=False: the dispatch runs eagerly between graphs
    torch.testing.assert_close(torch.compile(layer)(x), layer(x), rtol=1e-5, atol=1e-6)


def test_full_state_dict_of_a_compiled_model_has_the_plain_keys(group_of_one):
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), mx.ExpertParallelMoE(64, 32, 4, 2))
    plain = mx.full_state_dict(net)
    assert mx.full_state_dict(torch.compile(net)).keys() == plain.keys()
    net[1] = torch.compile(net[1])  # a compiled submodule
    assert mx.full_state_dict(net).keys() == plain.keys()


def _switch_loss(h, router, top_k):
    """The load-balancing loss recomputed from scratch (what examples/train_lm.py did)."""
    probs = torch.softmax((h @ router.to(h.dtype)).float(), dim=-1)
    ids = probs.topk(top_k, dim=-1).indices.flatten()
    share = torch.zeros_like(probs[0]).scatter_add_(0, ids, torch.ones_like(ids, dtype=probs.dtype))
    return probs.shape[1] * (share / ids.numel() * probs.mean(0)).sum()


@pytest.mark.parametrize("static", [False, True])
def test_balance_loss_after_a_forward(group_of_one, static):
    kw = dict(max_tokens=32, capacity_factor=2.0) if static else {}
    layer = mx.ExpertParallelMoE(64, 32, 8, 2, exchange="bf16", **kw)
    with pytest.raises(RuntimeError, match="call the layer first"):
        layer.balance_loss()
    x = torch.randn(32, 64)
    layer(x)
    aux = layer.balance_loss()
    torch.testing.assert_close(aux, _switch_loss(x, layer.router, 2), rtol=1e-6, atol=1e-6)
    aux.backward()
    assert layer.router.grad is not None and layer.router.grad.abs().sum() > 0
    balanced = torch.full((8, 8), 1 / 8)  # uniform probabilities, every expert chosen twice
    assert mx.moe.routing.balance_loss(balanced, torch.arange(16).view(8, 2) % 8).item() == 1.0


def test_balance_loss_in_a_fullgraph_compiled_step(group_of_one):
    layer = mx.ExpertParallelMoE(64, 32, 8, 2, max_tokens=32, capacity_factor=2.0)
    x = torch.randn(32, 64)

    def step(x):
        return layer(x).square().mean() + 0.01 * layer.balance_loss()

    eager = step(x)
    compiled = torch.compile(step, fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)


def _swiglu_reference(x, weights, top_k, ffn):
    """Each token through its top-k experts one by one, fp32: the layer's definition."""
    probs = torch.softmax(x @ weights["router"], dim=-1)
    w, ids = probs.topk(top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(top_k):
            a = x[t] @ weights["w1"][ids[t, j]]
            h = torch.nn.functional.silu(a[:ffn]) * a[ffn:]
            out[t] += w[t, j] * (h @ weights["w2"][ids[t, j]])
    return out


@pytest.mark.parametrize("static", [False, True])
def test_swiglu_experts_match_their_definition(group_of_one, static):
    from mxfp8_a2a.moe.layer import init_moe_weights

    kw = dict(max_tokens=16, capacity_factor=4.0) if static else {}
    layer = mx.ExpertParallelMoE(64, 32, 4, 2, exchange="bf16", activation="swiglu", seed=3, **kw)
    assert layer.w1.shape == (4, 64, 64) and layer.w2.shape == (4, 32, 64)
    weights = init_moe_weights(64, 32, 4, 3, "swiglu")
    assert torch.equal(layer.w1.detach(), weights["w1"])
    x = torch.randn(16, 64)
    torch.testing.assert_close(layer(x), _swiglu_reference(x, weights, 2, 32), rtol=1e-4, atol=1e-5)
    fp8 = mx.ExpertParallelMoE(64, 32, 4, 2, exchange="bf16", activation="swiglu", seed=3,
                               precision="fp8_rowwise", **kw)  # fmt: skip
    y, ref = fp8(x), layer(x)
    assert 10 * torch.log10(ref.square().sum() / (y - ref).square().sum()) > 20  # FP8 GEMMs
    y.sum().backward()
    assert fp8.w1.grad is not None and fp8.w1.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="activation must be one of"):
        mx.ExpertParallelMoE(64, 32, 4, 2, activation="relu")


def test_balance_bias_steers_the_choice_not_the_weights(group_of_one):
    layer = mx.ExpertParallelMoE(64, 32, 4, 2, exchange="bf16", balance_bias=True)
    assert "expert_bias" in layer.state_dict() and "expert_load" not in layer.state_dict()
    x = torch.randn(32, 64)
    plain = mx.moe.routing.route(x @ layer.router.detach(), 2)
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([-10.0, -10.0, 0.0, 0.0]))  # never experts 0, 1
    weights, ids, _ = mx.moe.routing._route(x @ layer.router.detach(), 2, layer.expert_bias)
    assert set(ids.flatten().tolist()) == {2, 3}
    probs = torch.softmax(x @ layer.router.detach(), -1)[:, 2:]
    torch.testing.assert_close(weights.sort(-1).values, (probs / probs.sum(-1, keepdim=True))
                               .sort(-1).values)  # fmt: skip
    layer.expert_bias.zero_()
    layer(x)  # counts the rows per expert
    torch.testing.assert_close(layer.expert_load, torch.bincount(plain[1].flatten(), minlength=4)
                               .float())  # fmt: skip
    load = layer.expert_load.clone()
    layer.update_balance_bias(0.01)
    assert torch.equal(layer.expert_bias, 0.01 * torch.sign(load.mean() - load))
    assert layer.expert_load.sum() == 0
    with pytest.raises(RuntimeError, match="balance_bias=True"):
        mx.ExpertParallelMoE(64, 32, 4, 2).update_balance_bias()


def test_node_limited_routing(group_of_one):
    from mxfp8_a2a.moe.routing import _route

    logits = torch.randn(64, 16)
    _, free, _ = _route(logits, 4)
    _, same, _ = _route(logits, 4, groups=(4, 4))  # every group allowed: plain routing
    assert torch.equal(free.sort(-1).values, same.sort(-1).values)
    for m in (1, 2):
        w, ids, probs = _route(logits, 4, groups=(4, m))
        assert ((ids // 4).sort(-1).values.diff(dim=-1) != 0).sum(-1).le(m - 1).all()  # <= m groups
        torch.testing.assert_close(w.sum(-1), torch.ones(64))
    layer = mx.ExpertParallelMoE(64, 32, 16, 4, exchange="bf16", route_groups=(4, 1))
    layer(torch.randn(8, 64))
    assert (layer._routing[1] // 4).eq(layer._routing[1][:, :1] // 4).all()  # one group each
    with pytest.raises(ValueError, match="groups dividing num_experts"):
        mx.ExpertParallelMoE(64, 32, 16, 4, route_groups=(3, 1))
    with pytest.raises(ValueError, match="must hold top_k=4"):
        mx.ExpertParallelMoE(64, 32, 16, 4, route_groups=(8, 1))


@pytest.mark.parametrize("layer", [False, True])
def test_static_path_compiles_with_dynamic_shapes_and_grad(group_of_one, layer):
    """fullgraph=True, dynamic=True, MXFP8 wire, x requiring grad, on CPU tensors (the
    plain-torch paths inside the ops): the eager results (Dynamo once failed inside the
    quantize reference's bit cast)."""
    torch.manual_seed(0)
    ids, w = torch.randint(0, 2, (10, 2)), torch.rand(10, 2)

    def f(x):
        ex, _, handle = mx.dispatch_static(x, ids, 2, 12, exchange="mxfp8")
        return mx.combine_static(ex * 2, w, handle)

    if layer:
        f = mx.ExpertParallelMoE(64, 32, 2, 2, capacity=12, exchange="mxfp8")

    x = torch.randn(10, 64, requires_grad=True)
    want = f(x)
    want.sum().backward()
    grad, x.grad = x.grad, None
    got = torch.compile(f, fullgraph=True, dynamic=True)(x)
    got.sum().backward()
    if layer:  # (inductor fuses the experts' fp32 arithmetic its own way)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x.grad, grad, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(got, want) and torch.equal(x.grad, grad)
