"""Combine's weighted slot sum (mxfp8_a2a.moe.slot_sum) against its plain-torch reference:
the forward and the rows' gradient bit for bit (bf16 products are exact in fp32, the sums
run in the same order), the weights' gradient against an fp64 sum; rows of many magnitudes
with NaN, inf, zeros, tiny and huge values, odd widths, k of 0 and 1, no tokens."""

from __future__ import annotations

import pytest
import torch
from helpers import KERNEL_DEVICES, assert_sum_within_rounding, fresh_generator
from per_group_data import make_input

from mxfp8_a2a.moe import slot_sum as ss

SHAPES = [(5, 3, 40), (7, 1, 64), (3, 8, 100), (4, 2, 2081), (2, 8, 7168), (9, 4, 17)]


def _on(device, shape):
    """The interpreter's 64-column blocks: 640 columns (ten whole blocks) stand for 7168 on
    CPU, where the time goes with the blocks (2081 has the many blocks and a ragged end)."""
    return (*shape[:2], 640) if device == "cpu" and shape[2] == 7168 else shape


def _case(t, k, h, device, g, special=True):
    rows = make_input((t * k, h), torch.bfloat16, device, g) if special else None
    if rows is None:
        rows = (torch.randn(t * k, h, generator=g) * 4).to(torch.bfloat16).to(device)
    pos = torch.randperm(t * k, generator=g).view(t, k).to(device)
    weights = torch.rand(t, k, generator=g)
    weights[0, 0] = 0.0  # a zero weight on the NaN / inf row
    return rows, pos, weights.to(device)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_reference(device, shape):
    shape = _on(device, shape)
    rows, pos, weights = _case(*shape, device, fresh_generator())
    got = ss.slot_sum(rows, pos, weights)
    want = ss.slot_sum_reference(rows, pos, weights)
    assert got.dtype == torch.bfloat16 and got.shape == (shape[0], shape[2])
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_backward_matches_reference(device, shape, weights_dtype):
    t, k, h = _on(device, shape)
    g = fresh_generator()
    rows, pos, weights = _case(t, k, h, device, g, special=False)
    weights = weights.to(weights_dtype)
    grad = torch.randn(t, h, generator=g).to(torch.bfloat16).to(device)
    r, w = rows.clone().requires_grad_(), weights.clone().requires_grad_()
    ss.slot_sum(r, pos, w).backward(grad)
    r_ref = rows.clone().requires_grad_()
    ss.slot_sum_reference(r_ref, pos, weights).backward(grad)
    torch.testing.assert_close(r.grad, r_ref.grad, rtol=0, atol=0)
    # grad_w[t, j] = <grad[t], rows[pos[t, j]]>, in fp32 by the kernel: against fp64
    prods = grad.double()[:, None, :] * rows.double()[pos]
    want = prods.sum(-1)
    assert w.grad.dtype == weights_dtype
    # h - 1 fp32 roundings in any order of the sum of magnitudes (the products are exact),
    # then for bf16 weights one rounding of the result
    tol = max(h - 1, 0) * 2**-24 * prods.abs().sum(-1)
    if weights_dtype != torch.float32:
        tol = tol * (1 + 2**-8) + 2**-8 * want.abs()
    assert ((w.grad.double() - want).abs() <= tol).all(), (w.grad, want)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_edge_shapes(device):
    """No tokens, k = 0 (zeros, and zero gradients), width 1."""
    g = fresh_generator()
    rows = torch.zeros(0, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    empty_pos = torch.zeros(0, 2, dtype=torch.int64, device=device)
    out = ss.slot_sum(rows, empty_pos, torch.zeros(0, 2, device=device))
    assert out.shape == (0, 64)
    w = torch.rand(3, 0, device=device, requires_grad=True)
    out = ss.slot_sum(rows, torch.zeros(3, 0, dtype=torch.int64, device=device), w)
    assert out.shape == (3, 64) and not out.any()
    out.sum().backward()
    assert rows.grad.shape == (0, 64) and w.grad.shape == (3, 0)
    rows, pos, weights = _case(6, 2, 1, device, g, special=False)
    torch.testing.assert_close(
        ss.slot_sum(rows, pos, weights), ss.slot_sum_reference(rows, pos, weights), rtol=0, atol=0
    )


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_which_path(device, monkeypatch):
    """bf16 rows with fp32 / bf16 / fp16 weights take the kernels, other dtypes the reference."""
    taken = []
    forward = ss._forward
    monkeypatch.setattr(ss, "_forward", lambda *a: taken.append("kernel") or forward(*a))
    rows, pos, weights = _case(4, 2, 32, device, fresh_generator(), special=False)
    for r, w in ((rows, weights), (rows, weights.half()), (rows.float(), weights)):
        ss.slot_sum(r, pos, w)
    ss.slot_sum(rows, pos, weights.double())
    assert taken == ["kernel", "kernel"]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_ops_pass_opcheck(device):
    rows, pos, weights = _case(4, 3, 48, device, fresh_generator(), special=False)
    torch.library.opcheck(ss._slot_sum_op, (rows, pos, weights))
    grad = torch.randn(4, 48).to(torch.bfloat16).to(device)
    torch.library.opcheck(ss._slot_sum_backward_op, (grad, rows, pos, weights))
    torch.library.opcheck(ss._row_sums_op, (rows, pos))


def test_reference_without_kernels():
    """Rows other than bf16 (here fp32 and fp64, on CPU): the reference, differentiable."""
    g = fresh_generator()
    rows = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    pos = torch.randperm(6, generator=g).view(3, 2)
    w = torch.rand(3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(ss.slot_sum, (rows, pos, w))
    empty = torch.zeros(0, 5, dtype=torch.float64, requires_grad=True)
    w0 = torch.zeros(3, 0, dtype=torch.float64, requires_grad=True)
    out = ss.slot_sum(empty, pos[:, :0], w0)  # k = 0: zeros that backward reaches
    assert out.shape == (3, 5) and not out.any() and out.requires_grad
    out.sum().backward()
    assert empty.grad.shape == (0, 5) and w0.grad.shape == (3, 0)
    out = ss.slot_sum(rows.float(), pos, w.float())
    want = (w.float()[:, :, None] * rows.float()[pos]).sum(1)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("shape", [(5, 3, 40), (3, 8, 100), (4, 2, 2081), (6, 0, 16), (0, 2, 8)])
def test_row_sums_match_reference(device, shape):
    """row_sums: the unit-weight kernel, bit for bit a sum over j in order in fp32."""
    t, k, h = shape
    g = fresh_generator()
    rows = make_input((t * k, h), torch.bfloat16, device, g) if t * k and h >= 9 else None
    if rows is None:
        rows = torch.randn(t * k, h, generator=g).to(torch.bfloat16).to(device)
    pos = torch.randperm(t * k, generator=g).view(t, k).to(device)
    want = torch.zeros(t, h, dtype=torch.float32, device=device)
    for j in range(k):
        want = want + rows[pos[:, j]].float()
    got = ss.row_sums(rows, pos)
    assert got.dtype == torch.bfloat16 and got.shape == (t, h)
    torch.testing.assert_close(got, want.to(torch.bfloat16), rtol=0, atol=0, equal_nan=True)
    # fp32 rows take index_select and a sum, in torch's order
    assert_sum_within_rounding(ss.row_sums(rows.float(), pos), rows.float()[pos])


def test_bad_arguments_raise():
    rows = torch.zeros(6, 4, dtype=torch.bfloat16)
    pos, w = torch.arange(6).view(3, 2), torch.ones(3, 2)
    for args, match in (
        ((rows, pos.int(), w), "int64"),
        ((rows[:5], pos, w), "one index per row"),
        ((rows, pos, w[:2]), "weights must be"),
        ((rows, pos, w.long()), "weights must be"),
        ((rows[0], pos, w), "rows must be"),
    ):
        with pytest.raises(ValueError, match=match):
            ss.slot_sum(*args)
    with pytest.raises(ValueError, match="one index per row"):
        ss.row_sums(rows, pos[:2])


def _fwd_bwd(fn, rows, pos, weights, grad):
    rows, weights = rows.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    out = fn(rows, pos, weights)
    out.backward(grad)
    return out, rows.grad, weights.grad


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_row_sums_op_matches_its_implementation(device):
    rows, pos, _ = _case(5, 3, 80, device, fresh_generator(), special=False)
    torch.testing.assert_close(ss._row_sums_impl(rows, pos), ss._row_sums_op(rows, pos))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_tracers_meet_the_ops(device):
    """Under a torch dispatch mode (make_fx, selective checkpointing policies) and in the
    backward that compiled autograd traces with fake tensors, the custom ops run. Not twice
    differentiable."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    rows, pos, weights = _case(4, 2, 32, device, fresh_generator(), special=False)
    with Seen() as seen:
        ss.slot_sum(rows, pos, weights)
    assert any("mxfp8_a2a.slot_sum" in op for op in seen.ops), seen.ops
    w = weights.clone().requires_grad_(True)
    out = ss.slot_sum(rows, pos, w)
    (gw,) = torch.autograd.grad(out.float().square().sum(), w, create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):  # the backward op's
        gw.sum().backward()
    ca = pytest.importorskip("torch._dynamo.compiled_autograd")
    if not hasattr(ca, "_enable"):
        pytest.skip("no compiled autograd in this torch")
    r = rows.clone().requires_grad_(True)
    out = ss.slot_sum(r, pos, weights)
    with ca._enable(torch.compile(backend="eager")):
        out.float().square().sum().backward()
    grad = (2 * out.detach().float()).to(out.dtype)
    want = _fwd_bwd(ss._slot_sum_op, rows, pos, weights, grad)[1]
    torch.testing.assert_close(r.grad, want, rtol=0, atol=0)
