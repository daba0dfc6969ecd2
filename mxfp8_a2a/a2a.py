"""The MXFP8 all-to-all: quantize, one exchange of packed rows, dequantize; and its backward.

Layers: ``_exchange`` (eager: _exchange.exchange_columns, one collective per column piece;
traced by torch.compile: quantize_packed -> functional all_to_all_single ->
dequantize_packed) -> ``_MXFP8AllToAll`` (autograd) -> ``to_mxfp8_a2a_dequant``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ._common import check_float_input, check_scaling_mode
from ._copy_exchange import auto_ranges, copy_exchange
from ._exchange import auto_chunks, exchange_columns
from .dequantize import dequantize_packed
from .quantize import quantize_packed

Splits = Sequence[int] | torch.Tensor

VALIDATE_ENV = "MXFP8_A2A_VALIDATE"
TRANSPORTS = ("nccl", "copy_engine")

# torch >= 2.13 renames all_gather_into_tensor to all_gather_single
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _splits_list(splits: Splits, name: str, device: torch.device) -> list[int]:
    if isinstance(splits, torch.Tensor):
        if splits.dim() != 1 or splits.dtype.is_floating_point or splits.dtype.is_complex:
            raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints")
        if splits.device.type != "cpu" and splits.device != device:
            raise ValueError(
                f"{name} is on {splits.device} but x is on {device}; keep the splits on the "
                "CPU or on x's device"
            )
        return [int(v) for v in splits.tolist()]  # a host sync for device tensors
    if type(splits) is list and all(type(v) is int for v in splits):
        return list(splits)  # the common case; a copy, kept for the backward
    try:
        out = [int(v) for v in splits]
    except TypeError:
        raise TypeError(f"{name} must be a list of ints or a 1-D integer tensor") from None
    if any(o != v for o, v in zip(out, splits, strict=True)):
        raise TypeError(f"{name} must hold integers, got {list(splits)}")
    return out


def _validating(validate: bool) -> bool:
    """Whether the call validates its splits: ``validate``, or VALIDATE_ENV=1."""
    return validate or os.environ.get(VALIDATE_ENV, "0") == "1"


def _check_capturable(
    output_splits, input_splits, chunks, validate, transport: str = "nccl"
) -> None:
    """Under CUDA graph capture nothing may wait for the GPU: no piece count agreed at run
    time, no validation round, no splits read back from the GPU; and only the NCCL
    transport (the copy-engine one grows its buffer with a synchronizing rendezvous and has
    not been run under capture)."""
    if transport != "nccl":
        raise ValueError(
            f"transport={transport!r} cannot be captured in a CUDA graph (its buffer grows "
            "with a synchronizing rendezvous; capture is untested); capture with "
            "transport='nccl'"
        )
    for name, value in (("output_splits", output_splits), ("input_splits", input_splits)):
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            raise ValueError(
                f"{name} is a {value.device} tensor; under CUDA graph capture pass the splits "
                "as a list of ints (reading them back would synchronize)"
            )
    if chunks is None or _validating(validate):
        raise ValueError(
            "under CUDA graph capture pass chunks=<int> (chunks=None agrees on a count at run "
            f"time) and validate=False (and leave {VALIDATE_ENV} unset): both synchronize"
        )


def check_transport(transport: str, device: torch.device, world: int) -> None:
    """Raise a ValueError unless ``transport`` is known and can serve tensors on ``device``
    in a group of ``world`` ranks ("copy_engine": CUDA, two ranks)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if transport == "copy_engine" and (device.type != "cuda" or world != 2):
        raise ValueError(
            "transport='copy_engine' needs CUDA tensors (GPUs with peer access) and a group "
            f"of two ranks; got tensors on {device} and {world} ranks: use transport='nccl' "
            "(the default)"
        )


def _comm_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device the collectives of ``group`` take tensors on (CUDA for NCCL)."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def compute_output_splits(
    input_splits: Splits, group: dist.ProcessGroup | None = None
) -> list[int]:
    """Exchange row counts so that each rank learns how many rows it receives from each rank.

    Args:
        input_splits: rows this rank sends to each rank of ``group`` (length = group size).
        group: process group (default: the world).
    Returns:
        output_splits: list of ints, rows this rank receives from each rank.
    One all_to_all_single of group-size int64 values, then a host sync to read them.
    """
    world = dist.get_world_size(group)
    splits = _splits_list(input_splits, "input_splits", torch.device("cpu"))
    if len(splits) != world:
        raise ValueError(f"input_splits has {len(splits)} entries; the group has {world} ranks")
    dev = _comm_device(group)
    send = torch.tensor(splits, dtype=torch.int64, device=dev)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist()


def _check_splits(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], world: int, rank: int
) -> None:
    for name, s in (("input_splits", input_splits), ("output_splits", output_splits)):
        if len(s) != world:
            raise ValueError(
                f"{name} has {len(s)} entries but the group has {world} ranks; give one "
                "count per rank"
            )
        if any(v < 0 for v in s):
            raise ValueError(f"{name} must be non-negative, got {s}")
    if sum(input_splits) != x.shape[0]:
        raise ValueError(
            f"input_splits sum to {sum(input_splits)} but x has {x.shape[0]} rows; they must "
            "sum to x.shape[0]"
        )
    if input_splits[rank] != output_splits[rank]:
        raise ValueError(
            f"input_splits[{rank}] = {input_splits[rank]} rows to itself but output_splits"
            f"[{rank}] = {output_splits[rank]} from itself on rank {rank}; they must agree"
        )


def _check_all_ranks(
    error: Exception | None,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None,
    chunks: int | None = 1,
    transport: str = "nccl",
) -> None:
    """One all_gather of [error flag, input_splits, output_splits, chunks, transport]; every
    rank raises alike."""
    world = dist.get_world_size(group)
    n = 3 + 2 * world
    how = [-1 if chunks is None else chunks, TRANSPORTS.index(transport)]
    payload = [0, *input_splits, *output_splits, *how] if error is None else [1] + [0] * (n - 1)
    mine = torch.tensor(payload, dtype=torch.int64, device=_comm_device(group))
    table = torch.empty(world * n, dtype=torch.int64, device=mine.device)
    _all_gather(table, mine, group=group)
    rows = table.view(world, n).tolist()
    bad = [r for r in range(world) if rows[r][0]]
    if error is not None:
        raise error
    if bad:
        raise ValueError(f"to_mxfp8_a2a_dequant: bad arguments on rank(s) {bad} of the group")
    for src in range(world):
        for dst in range(world):
            sent = rows[src][1 + dst]
            expected = rows[dst][1 + world + src]
            if sent != expected:
                raise ValueError(
                    f"splits disagree: rank {src} sends {sent} rows to rank {dst} "
                    f"(input_splits[{dst}] on rank {src}) but rank {dst} expects {expected} "
                    f"(output_splits[{src}] on rank {dst}); compute output_splits with "
                    "compute_output_splits(input_splits)"
                )
    hows = [tuple(r[-2:]) for r in rows]
    if len(set(hows)) > 1:
        seen = [(None if c == -1 else c, TRANSPORTS[t]) for c, t in hows]
        raise ValueError(
            f"chunks and transport differ between ranks: (chunks, transport) per rank {seen}; "
            "every rank must pass the same"
        )


def _exchange(
    x: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None,
    scaling_mode: str,
    chunks: int,
    transport: str = "nccl",
) -> torch.Tensor:
    """Eager: exchange_columns (one collective per column piece) or copy_exchange (copy
    engines write into the receivers' symmetric-memory buffers). Under torch.compile:
    quantize_packed -> one functional all_to_all_single of uint8 rows -> dequantize_packed
    (the kept rows go through the wire too, one piece; same results)."""
    if not torch.compiler.is_compiling():
        if transport == "copy_engine":
            return copy_exchange(x, output_splits, input_splits, group, scaling_mode, chunks)
        return exchange_columns(x, output_splits, input_splits, group, scaling_mode, chunks)
    packed = quantize_packed(x, scaling_mode=scaling_mode)
    recv = funcol.all_to_all_single(packed, output_splits, input_splits, group or dist.group.WORLD)
    return dequantize_packed(funcol.wait_tensor(recv), out_dtype=x.dtype)


def agreed_chunks(
    rows: int, k: int, group: dist.ProcessGroup | None = None, device: torch.device | None = None
) -> int:
    """The automatic piece count (:func:`auto_chunks`) for the busiest rank of ``group``:
    ``rows`` is the most rows this rank sends or receives. One all_reduce (MAX) of one
    int and a host sync, so that every rank gets the same count."""
    if dist.get_world_size(group) == 1:
        return auto_chunks(rows, k)
    t = torch.tensor([rows], dtype=torch.int64, device=device or _comm_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return auto_chunks(int(t.item()), k)


def _copy_engine_ranges(
    output_splits: list[int], input_splits: list[int], k: int, group: dist.ProcessGroup | None
) -> int:
    """The automatic row-range count of transport="copy_engine" (two ranks): from the one
    pair's counts, which both ranks know."""
    peer = 1 - dist.get_rank(group)
    return auto_ranges(max(input_splits[peer], output_splits[peer]), k)


class _MXFP8AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, scaling_mode, chunks, transport):
        ctx.output_splits, ctx.input_splits = output_splits, input_splits
        ctx.group, ctx.scaling_mode, ctx.chunks = group, scaling_mode, chunks
        ctx.transport = transport
        return _exchange(x, output_splits, input_splits, group, scaling_mode, chunks, transport)

    @staticmethod
    def backward(ctx, grad):
        grad_x = _exchange(
            grad, ctx.input_splits, ctx.output_splits, ctx.group, ctx.scaling_mode, ctx.chunks,
            ctx.transport,
        )  # fmt: skip
        return grad_x, None, None, None, None, None, None


def to_mxfp8_a2a_dequant(
    x: torch.Tensor,
    output_splits: Splits,
    input_splits: Splits,
    group: dist.ProcessGroup | None = None,
    *,
    scaling_mode: str = "rceil",
    chunks: int | None = 1,
    validate: bool = False,
    transport: str = "nccl",
) -> torch.Tensor:
    """All-to-all of ``x``'s rows sent as MXFP8 and dequantized on arrival; differentiable.

    Args:
        x: [tokens, K] bfloat16 or float32 (CUDA over NCCL, CPU over gloo), K % 32 == 0,
            rows grouped by destination rank.
        output_splits: rows received from each rank of ``group`` (list of ints or 1-D
            integer tensor; a device tensor costs a host sync).
        input_splits: rows sent to each rank; must sum to tokens.
        group: process group (default: the world).
        scaling_mode: "rceil" (default) or "floor".
        chunks: 1 (default) sends the outgoing rows with one all_to_all_single of packed
            rows. An int c > 1 pipelines the exchange: the columns are cut into
            min(c, K/32) pieces (multiples of 32 columns), each sent with its own
            all_to_all_single while the next piece is quantized and the one before
            dequantized; every rank must pass the same value. None picks the count from
            the busiest rank's wire bytes (about PIPELINE_CHUNK_BYTES per piece, at most
            PIPELINE_MAX_CHUNKS, see _config.py; 1 for small messages), at the cost of one
            small all_reduce and a host sync per call. Either way the rows a rank sends to
            itself skip the wire (on CUDA from KEEP_LOCAL_MIN_ELEMENTS elements up): their
            round trip runs while the others are in flight. torch.compile traces one
            collective of every row whatever ``chunks`` is.
        validate: check, with one all_gather of 2 * group-size + 3 int64 values and a host
            sync, that the splits, chunks and transport agree across ranks; every rank then
            raises the same error instead of hanging. Also on when the environment variable
            MXFP8_A2A_VALIDATE=1.
        transport: "nccl" (default): all_to_all_single. "copy_engine", for a group of two
            ranks on CUDA GPUs with peer access (e.g. NVLink): the GPUs' copy engines write
            the packed rows into the peer's buffer (symmetric memory), leaving the SMs to
            the casts; no host sync. ``chunks`` = c then cuts each direction's rows into c
            row ranges, pipelined (quantize, copy, dequantize overlap); None picks the count
            from the wire bytes (COPY_ENGINE_* in _config.py). Faster than "nccl" for large
            exchanges (BENCHMARKS.md); same results bit for bit; not for CUDA graph capture.
    Returns:
        [sum(output_splits), K] in x's dtype, rows in source-rank order. Each row equals
        dequantize(quantize(row sent)) bit for bit; a block holding NaN arrives as NaN, a
        block holding inf keeps +-448 * 2^127 (inf) there and loses its small values.
    Backward: the gradient is quantized, exchanged with the splits swapped, dequantized.
    On the wire each row is uint8 [K e4m3 bytes | K/32 scale bytes].

    CUDA graphs: with fixed shapes and splits the call (forward and backward) can be captured
    with torch.cuda.graph; replays give the eager results bit for bit and skip the host work
    that dominates small exchanges. Capture with splits as lists of ints, an int ``chunks``
    and validate=False (anything that would synchronize raises a ValueError under capture).
    """
    eager_cuda = not torch.compiler.is_compiling() and isinstance(x, torch.Tensor) and x.is_cuda
    if eager_cuda and torch.cuda.is_current_stream_capturing():
        # raised at once: the validation round would itself synchronize
        _check_capturable(output_splits, input_splits, chunks, validate, transport)
    world = dist.get_world_size(group)
    out_splits: list[int] = []
    in_splits: list[int] = []
    error: Exception | None = None
    try:
        check_float_input(x)
        check_scaling_mode(scaling_mode)
        if x.dim() != 2:
            raise ValueError(f"x must be 2-D [tokens, K], got shape {tuple(x.shape)}; flatten it")
        if chunks is not None and (not isinstance(chunks, int) or chunks < 1):
            raise ValueError(f"chunks must be None or a positive int, got {chunks!r}")
        check_transport(transport, x.device, world)
        if x.device.type not in ("cpu", "cuda"):
            raise ValueError(f"x must be a CPU (gloo) or CUDA (NCCL) tensor, got {x.device}")
        out_splits = _splits_list(output_splits, "output_splits", x.device)
        in_splits = _splits_list(input_splits, "input_splits", x.device)
        _check_splits(x, out_splits, in_splits, world, dist.get_rank(group))
    except (TypeError, ValueError) as e:
        error = e
    if _validating(validate):
        _check_all_ranks(error, out_splits, in_splits, group, chunks, transport)
    elif error is not None:
        raise error
    if chunks is None and transport == "copy_engine":
        chunks = _copy_engine_ranges(out_splits, in_splits, x.shape[1], group)
    if chunks is None:
        rows = max(sum(out_splits), sum(in_splits))
        chunks = 1 if torch.compiler.is_compiling() else agreed_chunks(rows, x.shape[1], group)
    if not (torch.is_grad_enabled() and x.requires_grad):  # no graph to record
        return _exchange(x, out_splits, in_splits, group, scaling_mode, chunks, transport)
    return _MXFP8AllToAll.apply(x, out_splits, in_splits, group, scaling_mode, chunks, transport)
