"""The row gathers of dispatch and combine, with a backward that knows the inverse.

``x[index]`` differentiates through index_put_(accumulate=True): a zero fill, a sort of the
index and a scatter-add. Dispatch and combine gather by permutations whose inverses they
already hold, so here the backward is one more gather; where every row was taken
``repeats`` times, a gather and a sum over the copies in one kernel (slot_sum.row_sums).
Combine's last gather and its weighted sum over the top-k slots are one kernel too
(slot_sum.py).
"""

from __future__ import annotations

import torch

from .slot_sum import row_sums


class _TakeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index, inverse, repeats):
        ctx.save_for_backward(inverse)
        ctx.rows, ctx.repeats = x.shape[0], repeats
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        if ctx.repeats == 1:
            return grad.index_select(0, inverse), None, None, None
        return row_sums(grad, inverse.view(ctx.rows, ctx.repeats)), None, None, None


def take_rows(
    x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, repeats: int = 1
) -> torch.Tensor:
    """x[index], differentiable in x, for ``index`` = perm // repeats with perm a permutation
    of range(x.shape[0] * repeats) and ``inverse`` its inverse (repeats 1: index is the
    permutation itself).

    x: [R, H]; index, inverse: int64 [R * repeats] on x's device. Returns [R * repeats, H] in
    x's dtype. Backward: grad_x[r] = sum over j < repeats of grad[inverse[r * repeats + j]].
    """
    return _TakeRows.apply(x, index, inverse, repeats)
