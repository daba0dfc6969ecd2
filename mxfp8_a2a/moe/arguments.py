"""Argument checks and the dispatch marks that both dispatch front ends share
(dispatch_synced.py, dispatch_static.py): what is wrong with one rank's arguments (shapes,
dtypes, devices; no data read), and which dispatch a tensor of rows came from."""

from __future__ import annotations

import itertools

import torch

from ..exchange.transport import device_error
from ..exchange.wires import check_leg_pair, combine_default, leg_pair

_dispatch_ids = itertools.count(1)
_OWNER = "_mxfp8_a2a_dispatch_id"


def mark_output(out: torch.Tensor) -> int:
    """A new dispatch id, also set on ``out`` (the dispatch's output rows) as an attribute, so
    that combine can tell when it is given another dispatch's rows (:func:`check_owner`).
    0 (no mark) under torch.compile, where tensors take no attributes."""
    if torch.compiler.is_compiling():
        return 0
    dispatch_id = next(_dispatch_ids)
    setattr(out, _OWNER, dispatch_id)
    return dispatch_id


def check_owner(expert_y: torch.Tensor, dispatch_id: int, what: str) -> None:
    """A ValueError if ``expert_y`` is the output of a dispatch other than the handle's.
    Rows computed from a dispatch's output carry no mark (an attribute does not follow
    through operations): only a dispatch's own output tensor is told apart. Host-only (no
    sync, nothing under CUDA graph capture); skipped under torch.compile."""
    if torch.compiler.is_compiling():
        return
    owner = getattr(expert_y, _OWNER, None)
    if owner is not None and dispatch_id and owner != dispatch_id:
        raise ValueError(
            f"expert_y is the output of another {what} (number {owner} in this process) than "
            f"the handle's (number {dispatch_id}); pass the handle returned with these rows"
        )


def argument_error(x, topk_ids, num_experts, world, exchange, group) -> str | None:
    """What is wrong with this rank's arguments (shapes and types only, no data read)."""
    if (problem := check_leg_pair(exchange)) is not None:
        return problem
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        return f"x must be a 2-D [tokens, hidden] tensor, got {getattr(x, 'shape', type(x))}"
    if (problem := device_error(x.device, group)) is not None:
        return problem
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        return f"topk_ids must be a 2-D [tokens, k] tensor, got {getattr(topk_ids, 'shape', '?')}"
    if topk_ids.shape[0] != x.shape[0]:
        return f"topk_ids must be [tokens, k] with tokens = {x.shape[0]}, got {topk_ids.shape}"
    dt = topk_ids.dtype
    if dt.is_floating_point or dt.is_complex or dt == torch.bool:
        return f"topk_ids must be an integer tensor, got {topk_ids.dtype}"
    if topk_ids.device != x.device:
        return f"topk_ids ({topk_ids.device}) must be on x's device ({x.device})"
    if type(num_experts) is not int or num_experts < 1 or num_experts % world:
        return f"num_experts ({num_experts!r}) must be a positive multiple of the group size"
    mxfp8 = "mxfp8" in leg_pair(exchange, "dispatch") + combine_default(exchange)
    if mxfp8 and x.dtype not in (torch.bfloat16, torch.float32):
        return f"x must be bfloat16 or float32 for an MXFP8 wire ({exchange!r}), got {x.dtype}"
    if mxfp8 and x.shape[1] % 32:
        return (
            f"x.shape[1] (hidden={x.shape[1]}) must be a multiple of 32 for an MXFP8 wire "
            f"({exchange!r}); pad it or use exchange='bf16'"
        )
    return None


def mxfp8_rows_error(y: torch.Tensor, exchange) -> str | None:
    """What stops combine's rows ``y`` from travelling on ``exchange``'s combine legs."""
    if "mxfp8" not in leg_pair(exchange, "combine"):
        return None
    if y.dtype not in (torch.bfloat16, torch.float32) or y.shape[1] % 32:
        return (f"expert_y must be bfloat16 or float32 with a multiple of 32 columns for an "
                f"MXFP8 combine leg ({exchange!r}), got {y.dtype} {tuple(y.shape)}")  # fmt: skip
    return None
