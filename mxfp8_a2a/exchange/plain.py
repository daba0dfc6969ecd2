"""The plain all-to-all of rows in their own dtype, differentiable: the exchange's "bf16"
backward leg, and the baseline the benchmarks compare MXFP8 with.

Eager: an autograd Function around all_to_all_single (the backward is the same exchange
with the splits swapped, itself differentiable). Under torch.compile, torch's functional
collective (``torch.distributed._functional_collectives``, private: ``HAS_FUNCOL`` says
whether this torch has it), which the compiler traces; without it the eager Function runs
(a graph break).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

try:
    import torch.distributed._functional_collectives as funcol

    HAS_FUNCOL = hasattr(funcol, "all_to_all_single_autograd")
except ImportError:  # a torch without it
    funcol, HAS_FUNCOL = None, False


def all_to_all_rows(
    x: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """x [sum(input_splits), H] (rows grouped by destination rank) -> [sum(output_splits), H]
    in x's dtype, on x's device: rank r's rows for this rank in rank order. Differentiable.
    A collective: every rank of ``group`` calls it with splits that agree."""
    if not torch.compiler.is_compiling():
        return _apply(x, output_splits, input_splits, group)
    if not HAS_FUNCOL:
        return _eager_apply(x, output_splits, input_splits, group)
    out = funcol.all_to_all_single_autograd(
        x, output_splits, input_splits, group or dist.group.WORLD
    )
    return funcol.wait_tensor(out)


@torch.compiler.disable
def _eager_apply(x, output_splits, input_splits, group) -> torch.Tensor:
    """_apply, run eagerly where the compiler meets it (a graph break)."""
    return _apply(x, output_splits, input_splits, group)


def _apply(x, output_splits, input_splits, group) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return _AllToAll.apply(x, output_splits, input_splits, group)
    return exchange(x, output_splits, input_splits, group)


def exchange(x, output_splits, input_splits, group) -> torch.Tensor:
    """all_to_all_single of x's rows in their own dtype, eagerly (not differentiable)."""
    x = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, list(output_splits), list(input_splits), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.args = (input_splits, output_splits, group)
        return exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _apply(grad.contiguous(), *ctx.args), None, None, None
