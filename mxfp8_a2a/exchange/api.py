"""The MXFP8 all-to-all: the public function and its autograd Function.

Layers: the transport's ``exchange`` (nccl.py, copy_engine.py) -> ``_LegsAllToAll``
(autograd: the backward is the same exchange with the splits swapped, on its own wire,
MXFP8 or the rows unquantized) -> ``to_mxfp8_a2a_dequant`` (checks in checks.py, then the
Function); ``exchange_legs`` is the Function's entry. Under
torch.compile the MXFP8 exchange is traced as quantize_packed -> functional
all_to_all_single -> dequantize_packed (same results; the kept rows then go over the wire
too), where torch has the functional collectives (plain.HAS_FUNCOL; else the eager
transport runs, a graph break).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .._common import check_float_input, check_scaling_mode
from ..formats.dequantize import dequantize_packed
from ..formats.packing import packed_row_bytes
from ..formats.quantize import quantize_packed
from . import agreement, checks
from .checks import Splits
from .nccl import NcclTransport, resolve
from .plain import HAS_FUNCOL, funcol
from .plain import exchange as plain_exchange
from .rows import wire_row
from .transport import Transport


def compute_output_splits(
    input_splits: Splits, group: dist.ProcessGroup | None = None
) -> list[int]:
    """Exchange row counts so that each rank learns how many rows it receives from each rank.

    Args:
        input_splits: rows this rank sends to each rank of ``group`` (length = group size,
            each an int in [0, 2**62); a list, an iterable or a 1-D integer tensor on any
            device).
        group: process group (default: the world); call it on every rank of the group.
    Returns:
        output_splits: list of ints, rows this rank receives from each rank.
    One all_to_all_single of group-size int64 values, then a host sync to read them. Bad
    counts on any rank raise the same ValueError/TypeError on every rank (the bad rank
    sends -1s in place of its counts; only then a second collective brings its message).
    """
    _, world = checks.group_rank_and_size(group)
    error: Exception | None = None
    try:
        splits = checks.splits_list(input_splits, "input_splits", None)
        checks.check_counts(splits, "input_splits", world)
    except (TypeError, ValueError) as e:
        error, splits = e, [-1] * world
    dev = checks.comm_device(group)
    send = torch.tensor(splits, dtype=torch.int64, device=dev)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    out = recv.tolist()
    if error is not None or min(out, default=0) < 0:  # every rank sees every bad rank's -1
        status = agreement.FINE if error is None else agreement.status_of(error)
        agreement.agree("compute_output_splits", status, str(error or ""), [], group)
    return out


@torch.compiler.disable
def _eager_exchange(x, output_splits, input_splits, group, scaling_mode, transport: Transport):
    """The transport's exchange, run eagerly where the compiler meets it (a graph break)."""
    return transport.exchange(x, output_splits, input_splits, group, scaling_mode)


def _exchange(x, output_splits, input_splits, group, scaling_mode, transport: Transport):
    if not torch.compiler.is_compiling():
        return transport.exchange(x, output_splits, input_splits, group, scaling_mode)
    if not HAS_FUNCOL:
        return _eager_exchange(x, output_splits, input_splits, group, scaling_mode, transport)
    # the eager transport's wire rows (padded to 16 bytes), so that a rank that runs eager
    # (a graph break, a recompile limit) and one that runs compiled move the same bytes
    row = packed_row_bytes(x.shape[1])
    packed = F.pad(quantize_packed(x, scaling_mode=scaling_mode), (0, wire_row(x.shape[1]) - row))
    recv = funcol.all_to_all_single(packed, output_splits, input_splits, group or dist.group.WORLD)
    return dequantize_packed(funcol.wait_tensor(recv)[:, :row], out_dtype=x.dtype)


def _plain(x, output_splits, input_splits, group) -> torch.Tensor:
    """all_to_all_single of x's rows in their own dtype (a traced functional collective under
    torch.compile, where torch has it)."""
    if torch.compiler.is_compiling() and HAS_FUNCOL:
        out = funcol.all_to_all_single(
            x.contiguous(), output_splits, input_splits, group or dist.group.WORLD
        )
        return funcol.wait_tensor(out)
    return plain_exchange(x, output_splits, input_splits, group)


def _leg(x, output_splits, input_splits, group, scaling_mode, transport, wire) -> torch.Tensor:
    if wire == "mxfp8":
        return _exchange(x, output_splits, input_splits, group, scaling_mode, transport)
    return _plain(x, output_splits, input_splits, group)


def exchange_legs(
    x: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None,
    scaling_mode: str,
    transport: Transport,
    forward: str,
    backward: str,
) -> torch.Tensor:
    """The exchange of x's rows with its own wire each way (no checks: callers check): the
    forward sends ``forward`` rows ("mxfp8": quantize_packed's bits over ``transport``;
    "bf16": the rows in x's dtype), the backward sends the gradient as ``backward`` rows,
    with the splits swapped. Through the autograd Function only when a graph is recorded."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _LegsAllToAll.apply(
            x, output_splits, input_splits, group, scaling_mode, transport, forward, backward
        )
    return _leg(x, output_splits, input_splits, group, scaling_mode, transport, forward)


class _LegsAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, scaling_mode, transport, fwd, bwd):
        ctx.args = (input_splits, output_splits, group, scaling_mode, transport, bwd, fwd)
        return _leg(x, output_splits, input_splits, group, scaling_mode, transport, fwd)

    @staticmethod
    def backward(ctx, grad):
        # the exchange is linear: its backward is the swapped exchange, itself differentiable
        # (under create_graph=True the gradient carries a graph, as all_to_all_single's does)
        return exchange_legs(grad.contiguous(), *ctx.args), None, None, None, None, None, None, None


def to_mxfp8_a2a_dequant(
    x: torch.Tensor,
    output_splits: Splits,
    input_splits: Splits,
    group: dist.ProcessGroup | None = None,
    *,
    scaling_mode: str = "rceil",
    validate: bool = False,
    transport: str | Transport = "nccl",
    backward: str = "mxfp8",
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
        validate: check, with one all_gather of 2 * group-size + 129 int64 values and a
            host sync, that the splits agree across ranks and that K, dtype, scaling_mode,
            transport (kind and setting) and whether x records a graph are the same on
            every rank, and gather every rank's local errors: every rank then raises the
            same error (naming the rank and the argument) instead of hanging or returning
            garbage. Also on when MXFP8_A2A_VALIDATE=1 was set when mxfp8_a2a was
            imported (read once, then). Compiled and eager ranks validate alike (under
            torch.compile the gather is traced and checked at run time, so ranks may mix
            compiled and eager calls); under CUDA graph capture it raises. **Every rank
            must pass the same** ``validate`` and be started with the same
            MXFP8_A2A_VALIDATE: a rank that validates waits in an all_gather the others
            never join (they are in the exchange), which ends only in the process group's
            timeout (gloo raises after it, 30 min by default; NCCL's watchdog aborts) or
            worse; nothing can detect it.
        transport: "nccl" (default; any group): quantize, one all_to_all_single of packed
            rows, dequantize; the rows a rank sends itself skip the wire. Or a Transport
            object, e.g. :class:`mxfp8_a2a.CopyEngineTransport` (two ranks on GPUs with
            peer access; faster for large exchanges on NVLink). Every rank must pass the
            same kind.
        backward: the wire of the backward exchange: "mxfp8" (default) or "bf16" (the
            gradient's rows unquantized, in their own dtype: torchao's ``*_fwd_hp_bwd``
            split). Every rank must pass the same.
    Returns:
        [sum(output_splits), K] in x's dtype, rows in source-rank order. Each row equals
        dequantize(quantize(row sent)) bit for bit; a block holding NaN arrives as NaN, a
        block holding inf keeps +-448 * 2^127 (inf) there and loses its small values.
    Backward: the gradient is quantized, exchanged with the splits swapped, dequantized (with
    ``backward="bf16"``: exchanged as it is).

    Without ``validate`` nothing is compared across ranks (no extra collective, no host
    sync). A bad argument raises on its own rank before any collective; the other ranks
    then wait in the exchange until that rank's process ends (gloo and NCCL then fail them)
    or the process group's timeout. Splits that disagree between ranks (rank a's
    input_splits[b] != rank b's output_splits[a]) are undefined behaviour, not detected: a
    receiver that expects more rows than were sent gets undefined rows (gloo: uninitialized
    memory, with no error; NCCL may also hang), a sender that sends more makes gloo abort
    the receiving process (NCCL: undefined). Derive output_splits with :func:`compute_output_splits`
    (or with validate=True, or MXFP8_A2A_VALIDATE=1, while developing);
    :func:`mxfp8_a2a.dispatch` and :func:`mxfp8_a2a.combine` derive theirs consistently.

    Double backward (create_graph=True): the backward is the same differentiable exchange
    with the splits swapped, so gradients of gradients flow as through
    all_to_all_single_autograd (each pass quantized).

    CUDA graphs: with fixed shapes and splits the call (forward and backward) can be captured
    with torch.cuda.graph; replays give the eager results bit for bit and skip the host work
    that dominates small exchanges. Capture with splits as lists of ints and validate=False
    (anything that would synchronize raises a ValueError under capture).
    """
    error: Exception | None = None
    out_splits: list[int] = []
    in_splits: list[int] = []
    terms = ""
    rank, world = checks.group_rank_and_size(group)
    compiling = torch.compiler.is_compiling()
    capturing = (
        not compiling
        and isinstance(x, torch.Tensor)
        and x.is_cuda
        and torch.cuda.is_current_stream_capturing()
    )
    # compiled or eager, a rank that validates takes part in the same all_gather (so that
    # compiled and eager ranks can be mixed); under CUDA graph capture validation raises
    validating = checks.validating(validate) and not capturing
    chosen: Transport | None = None
    try:
        chosen = resolve(transport)
        check_float_input(x)
        check_scaling_mode(scaling_mode)
        if backward not in ("mxfp8", "bf16"):
            raise ValueError(f"backward must be 'mxfp8' or 'bf16', got {backward!r}")
        if x.dim() != 2:
            raise ValueError(f"x must be 2-D [tokens, K], got shape {tuple(x.shape)}; flatten it")
        chosen.check(x.device, group)
        if compiling and not isinstance(chosen, NcclTransport):
            raise ValueError(f"torch.compile traces transport='nccl' only, got {chosen.name!r}")
        splits_tensor = isinstance(output_splits, torch.Tensor) or isinstance(
            input_splits, torch.Tensor
        )
        if compiling and splits_tensor:
            raise ValueError(
                "under torch.compile pass the splits as lists of ints (reading tensors would "
                "synchronize)"
            )
        if capturing:
            checks.check_capturable(output_splits, input_splits, validate, chosen)
        out_splits = checks.splits_list(output_splits, "output_splits", x.device)
        in_splits = checks.splits_list(input_splits, "input_splits", x.device)
        checks.check_splits(x.shape[0], out_splits, in_splits, world, rank)
        if validating:
            args = dict(x=x, scaling_mode=scaling_mode, transport=chosen,
                                   backward=backward)  # fmt: skip
            terms = agreement.terms_of(checks.WHAT, args)
    except Exception as e:  # any local error: with validate, every rank learns of it
        error = e
    if validating and compiling and isinstance(x, torch.Tensor):
        # the check runs in the graph, at run time: a local error raises there, on every rank
        x = checks.check_all_ranks(error, out_splits, in_splits, group, world, terms, x)
        if error is not None:
            return x  # (not reached: the check raises)
    elif validating:
        checks.check_all_ranks(error, out_splits, in_splits, group, world, terms)
    if error is not None:
        raise error
    return exchange_legs(x, out_splits, in_splits, group, scaling_mode, chosen, "mxfp8", backward)
