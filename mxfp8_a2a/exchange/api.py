"""The MXFP8 all-to-all: the public function and its autograd Function.

Layers: the transport's ``exchange`` (nccl.py, copy_engine.py) -> ``_MXFP8AllToAll``
(autograd: the backward is the same exchange with the splits swapped) ->
``to_mxfp8_a2a_dequant`` (checks in checks.py, then the Function). Under torch.compile the
exchange is traced as quantize_packed -> functional all_to_all_single -> dequantize_packed
(same results; the kept rows then go over the wire too).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .._common import check_float_input, check_scaling_mode
from ..formats.dequantize import dequantize_packed
from ..formats.quantize import quantize_packed
from . import checks
from .checks import Splits
from .nccl import NcclTransport
from .transport import Transport, resolve


def compute_output_splits(
    input_splits: Splits, group: dist.ProcessGroup | None = None
) -> list[int]:
    """Exchange row counts so that each rank learns how many rows it receives from each rank.

    Args:
        input_splits: rows this rank sends to each rank of ``group`` (length = group size,
            each in [0, 2**62)).
        group: process group (default: the world).
    Returns:
        output_splits: list of ints, rows this rank receives from each rank.
    One all_to_all_single of group-size int64 values, then a host sync to read them. Bad
    counts raise on this rank before the collective (the others then wait for it: check
    counts that come from data before calling).
    """
    _, world = checks.group_rank_and_size(group)
    splits = checks.splits_list(input_splits, "input_splits", torch.device("cpu"))
    checks.check_counts(splits, "input_splits", world)
    dev = checks.comm_device(group)
    send = torch.tensor(splits, dtype=torch.int64, device=dev)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist()


def _exchange(x, output_splits, input_splits, group, scaling_mode, transport: Transport):
    if not torch.compiler.is_compiling():
        return transport.exchange(x, output_splits, input_splits, group, scaling_mode)
    packed = quantize_packed(x, scaling_mode=scaling_mode)
    recv = funcol.all_to_all_single(packed, output_splits, input_splits, group or dist.group.WORLD)
    return dequantize_packed(funcol.wait_tensor(recv), out_dtype=x.dtype)


def _apply(x, output_splits, input_splits, group, scaling_mode, transport) -> torch.Tensor:
    """The exchange, through the autograd Function only when a graph is recorded."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _MXFP8AllToAll.apply(x, output_splits, input_splits, group, scaling_mode, transport)
    return _exchange(x, output_splits, input_splits, group, scaling_mode, transport)


class _MXFP8AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, scaling_mode, transport):
        ctx.args = (input_splits, output_splits, group, scaling_mode, transport)
        return _exchange(x, output_splits, input_splits, group, scaling_mode, transport)

    @staticmethod
    def backward(ctx, grad):
        # the exchange is linear: its backward is the swapped exchange, itself differentiable
        # (under create_graph=True the gradient carries a graph, as all_to_all_single's does)
        return _apply(grad.contiguous(), *ctx.args), None, None, None, None, None


def to_mxfp8_a2a_dequant(
    x: torch.Tensor,
    output_splits: Splits,
    input_splits: Splits,
    group: dist.ProcessGroup | None = None,
    *,
    scaling_mode: str = "rceil",
    validate: bool = False,
    transport: str | Transport = "nccl",
) -> torch.Tensor:
    """All-to-all of ``x``'s rows sent as MXFP8 and dequantized on arrival; differentiable.

    Args:
        x: [tokens, K] bfloat16 or float32 (CUDA over NCCL, CPU over gloo), K % 32 == 0,
            rows grouped by destination rank; any strides.
        output_splits: rows received from each rank of ``group`` (list of ints or 1-D
            integer tensor; a device tensor costs a host sync).
        input_splits: rows sent to each rank; must sum to tokens.
        group: process group (default: the world).
        scaling_mode: "rceil" (default) or "floor".
        validate: check, with one all_gather of 2 * group-size + 6 int64 values and a host
            sync, that the splits agree across ranks and that K, dtype, scaling_mode and
            transport are the same on every rank; every rank then raises the same error
            instead of hanging or returning garbage. Also on when the environment variable
            MXFP8_A2A_VALIDATE=1. Every rank must pass the same ``validate`` (a rank that
            validates waits in the all_gather for the others).
        transport: "nccl" (default; any group): quantize, one all_to_all_single of packed
            rows, dequantize; the rows a rank sends itself skip the wire. Or a Transport
            object, e.g. :class:`mxfp8_a2a.CopyEngineTransport` (two ranks on GPUs with
            peer access; faster for large exchanges on NVLink). Every rank must pass the
            same kind.
    Returns:
        [sum(output_splits), K] in x's dtype, rows in source-rank order. Each row equals
        dequantize(quantize(row sent)) bit for bit; a block holding NaN arrives as NaN, a
        block holding inf keeps +-448 * 2^127 (inf) there and loses its small values.
    Backward: the gradient is quantized, exchanged with the splits swapped, dequantized.

    Without ``validate`` the splits are trusted: if rank a's input_splits[b] differs from
    rank b's output_splits[a], the collective fails or hangs, or (with NCCL) the receiver's
    surplus rows are undefined.

    CUDA graphs: with fixed shapes and splits the call (forward and backward) can be captured
    with torch.cuda.graph; replays give the eager results bit for bit and skip the host work
    that dominates small exchanges. Capture with splits as lists of ints and validate=False
    (anything that would synchronize raises a ValueError under capture).
    """
    error: Exception | None = None
    out_splits: list[int] = []
    in_splits: list[int] = []
    how = (0, 0, 0, 0, 0)
    rank, world = checks.group_rank_and_size(group)
    compiling = torch.compiler.is_compiling()
    capturing = (
        not compiling
        and isinstance(x, torch.Tensor)
        and x.is_cuda
        and torch.cuda.is_current_stream_capturing()
    )
    try:
        chosen = resolve(transport)
        k = check_float_input(x)
        check_scaling_mode(scaling_mode)
        if x.dim() != 2:
            raise ValueError(f"x must be 2-D [tokens, K], got shape {tuple(x.shape)}; flatten it")
        chosen.check(x.device, group)
        if compiling and not isinstance(chosen, NcclTransport):
            raise ValueError(f"torch.compile traces transport='nccl' only, got {chosen.name!r}")
        if capturing:
            checks.check_capturable(output_splits, input_splits, validate, chosen)
        out_splits = checks.splits_list(output_splits, "output_splits", x.device)
        in_splits = checks.splits_list(input_splits, "input_splits", x.device)
        checks.check_splits(x.shape[0], out_splits, in_splits, world, rank)
        how = checks.how_code(k, x.dtype, scaling_mode, chosen)
    except (TypeError, ValueError) as e:
        error = e
    if checks.validating(validate) and not capturing:
        checks.check_all_ranks(error, out_splits, in_splits, group, world, how)
    if error is not None:
        raise error
    return _apply(x, out_splits, in_splits, group, scaling_mode, chosen)
