"""take_rows (dispatch's and combine's row gathers) against x[index] and its autograd: the
forward bit for bit, the backward (a gather by the inverse, and a sum over a token's copies)
to the rounding of the sums; gradcheck in fp64; repeats 0, 1 and k."""

from __future__ import annotations

import pytest
import torch
from helpers import KERNEL_DEVICES, assert_sum_within_rounding, fresh_generator

from mxfp8_a2a.moe.permute import take_rows


def _perm(n, g, device):
    perm = torch.randperm(n, generator=g).to(device)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(n, device=device)
    return perm, inv


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "tokens, repeats, hidden", [(7, 1, 40), (5, 3, 64), (4, 8, 130), (3, 0, 16)]
)
def test_take_rows_matches_indexing(device, dtype, tokens, repeats, hidden):
    g = fresh_generator()
    x = (torch.randn(tokens, hidden, generator=g) * 8).to(dtype).to(device)
    perm, inv = _perm(tokens * repeats, g, device)
    index = perm // max(repeats, 1)
    grad = torch.randn(tokens * repeats, hidden, generator=g).to(dtype).to(device)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = take_rows(a, index, inv, repeats), b[index]
    assert torch.equal(got, want)
    got.backward(grad)
    want.backward(grad)
    # a sum over each token's copies, rounded in its own order
    copies = torch.zeros(tokens, max(repeats, 1), hidden, dtype=dtype, device=device)
    copies.view(-1, hidden)[perm] = grad
    assert_sum_within_rounding(a.grad, copies if repeats else copies[:, :0])


def test_take_rows_gradcheck():
    g = fresh_generator()
    x = torch.randn(5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    for repeats in (1, 3):
        perm, inv = _perm(5 * repeats, g, "cpu")
        torch.autograd.gradcheck(take_rows, (x, perm // repeats, inv, repeats))
