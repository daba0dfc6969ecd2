"""Argument checks of the exchange, local and across ranks, in one place.

Local checks raise a TypeError/ValueError naming the argument before any collective. What
one rank cannot see alone (splits that disagree between ranks, a K, dtype, scaling mode,
transport or requires_grad that differs) needs ``validate=True`` on every rank: one
all_gather of 2 * world + 7 int64 values and a host sync, after which every rank raises the
same error (when some rank's arguments are bad, a second collective, all_gather_object,
brings that rank's message to every rank: on the error path only).

MXFP8_A2A_VALIDATE=1 is read once, when this module is imported (so a rank cannot switch it
on for itself in the middle of a run): every rank must be started with the same value.
"""

from __future__ import annotations

import operator
import os
import zlib
from collections.abc import Iterable

import torch
import torch.distributed as dist

from .._common import SCALING_MODES
from .transport import Transport

Splits = Iterable[int] | torch.Tensor

VALIDATE_ENV = "MXFP8_A2A_VALIDATE"
VALIDATE_FROM_ENV = os.environ.get(VALIDATE_ENV, "0") == "1"  # read once, at import
MAX_ROWS = 2**62  # any split at or above it is an error (int64 arithmetic stays exact)
_DTYPES = (torch.bfloat16, torch.float32)

# torch >= 2.13 renames all_gather_into_tensor to all_gather_single
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def comm_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device the collectives of ``group`` take tensors on (CUDA for NCCL)."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device_error(device: torch.device, group: dist.ProcessGroup | None) -> str | None:
    """What is wrong with exchanging tensors of ``device`` over ``group``, or None: a tensor
    off CUDA on a group whose only backend is NCCL (a group made with "cpu:gloo,cuda:nccl"
    exchanges CPU tensors over gloo)."""
    if device.type == "cuda":
        return None
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "cpu:" not in backend and "gloo" not in backend:
        return (
            f"x is on {device}, and the group's backend (NCCL) takes CUDA tensors; move x to "
            "its GPU or pass a gloo group"
        )
    return None


def group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) of this process in ``group``; a ValueError if it is not a member."""
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            "this process is not a member of `group`; call it only on the group's ranks"
        )
    return rank, dist.get_world_size(group)


def splits_list(splits: Splits, name: str, device: torch.device | None) -> list[int]:
    """``splits`` (a 1-D integer tensor, or an iterable of ints) as a list of ints; a device
    tensor is read back (a host sync). ``device``: where a tensor may live besides the CPU
    (None: anywhere)."""
    if isinstance(splits, torch.Tensor):
        if splits.dim() != 1 or splits.dtype.is_floating_point or splits.dtype.is_complex:
            raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints")
        if splits.dtype == torch.bool:
            raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints, not bool")
        if device is not None and splits.device.type != "cpu" and splits.device != device:
            raise ValueError(
                f"{name} is on {splits.device} but x is on {device}; keep the splits on the "
                "CPU or on x's device"
            )
        return [int(v) for v in splits.tolist()]
    if type(splits) is list and all(type(v) is int for v in splits):
        return list(splits)  # the common case; a copy, kept for the backward
    if isinstance(splits, (str, bytes)):
        raise TypeError(f"{name} must be a list of ints or a 1-D integer tensor, got {splits!r}")
    try:
        given = list(splits)
    except TypeError:
        raise TypeError(f"{name} must be a list of ints or a 1-D integer tensor") from None
    try:  # ints and what stands for one (numpy ints, 0-d integer tensors); no floats
        if any(isinstance(v, bool) for v in given):
            raise TypeError
        return [operator.index(v) for v in given]
    except TypeError:
        raise TypeError(f"{name} must hold integers, got {given}") from None


def check_counts(splits: list[int], name: str, world: int) -> None:
    """One count per rank, each in [0, 2**62)."""
    if len(splits) != world:
        raise ValueError(
            f"{name} has {len(splits)} entries but the group has {world} ranks; give one "
            "count per rank"
        )
    for i, v in enumerate(splits):
        if not 0 <= v < MAX_ROWS:
            raise ValueError(f"{name}[{i}] = {v}; row counts must be non-negative and below 2**62")


def check_splits(x_rows: int, output_splits: list[int], input_splits: list[int], world, rank):
    check_counts(input_splits, "input_splits", world)
    check_counts(output_splits, "output_splits", world)
    if sum(input_splits) != x_rows:
        raise ValueError(
            f"input_splits sum to {sum(input_splits)} but x has {x_rows} rows; they must "
            "sum to x.shape[0]"
        )
    if input_splits[rank] != output_splits[rank]:
        raise ValueError(
            f"input_splits[{rank}] = {input_splits[rank]} rows to itself but output_splits"
            f"[{rank}] = {output_splits[rank]} from itself on rank {rank}; they must agree"
        )


def validating(validate: bool) -> bool:
    """Whether the call validates across ranks: ``validate``, or VALIDATE_ENV=1 when the
    package was imported."""
    return bool(validate) or VALIDATE_FROM_ENV


def check_capturable(output_splits, input_splits, validate: bool, transport: Transport) -> None:
    """Under CUDA graph capture nothing may wait for the GPU: no validation round, no splits
    read back from the GPU; and only a capturable transport."""
    if not transport.capturable:
        raise ValueError(
            f"the {transport.name!r} transport cannot be captured in a CUDA graph; capture "
            "with transport='nccl'"
        )
    for name, value in (("output_splits", output_splits), ("input_splits", input_splits)):
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            raise ValueError(
                f"{name} is a {value.device} tensor; under CUDA graph capture pass the splits "
                "as a list of ints (reading them back would synchronize)"
            )
    if validating(validate):
        raise ValueError(
            f"under CUDA graph capture pass validate=False (and start without {VALIDATE_ENV}"
            "=1): validation synchronizes"
        )


def raise_on_every_rank(what: str, error: Exception | None, group) -> None:
    """Raise the same error on every rank of ``group``, naming each bad rank and its
    message. Call it on every rank, once all of them know that some rank's arguments are
    bad (it is a collective: one all_gather_object)."""
    mine = None if error is None else (type(error).__name__, str(error)[:1000])
    world = dist.get_world_size(group)
    msgs: list = [None] * world
    dist.all_gather_object(msgs, mine, group=group)
    bad = [r for r in range(world) if msgs[r] is not None]
    text = "; ".join(f"rank {r}: {msgs[r][1]}" for r in bad)
    cls = TypeError if bad and all(msgs[r][0] == "TypeError" for r in bad) else ValueError
    raise cls(f"{what}: bad arguments on rank(s) {bad} of the group: {text}") from error


def check_all_ranks(
    error: Exception | None,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None,
    world: int,
    how: tuple[int, ...],
    transport_name: str = "",
) -> None:
    """One all_gather of [error flag, input_splits, output_splits, *how] (how_code); every
    rank raises alike. Every rank must call it (validate=True on all of them)."""
    n = 1 + 2 * world + len(HOW)
    if error is None:
        payload = [0, *input_splits, *output_splits, *how]
    else:
        payload = [1] + [0] * (n - 1)
    mine = torch.tensor(payload, dtype=torch.int64, device=comm_device(group))
    table = torch.empty(world * n, dtype=torch.int64, device=mine.device)
    _all_gather(table, mine, group=group)
    rows = table.view(world, n).tolist()
    if any(r[0] for r in rows):  # the same on every rank: all of them call the gather
        raise_on_every_rank("to_mxfp8_a2a_dequant", error, group)
    for src in range(world):
        for dst in range(world):
            sent, expected = rows[src][1 + dst], rows[dst][1 + world + src]
            if sent != expected:
                raise ValueError(
                    f"splits disagree: rank {src} sends {sent} rows to rank {dst} "
                    f"(input_splits[{dst}] on rank {src}) but rank {dst} expects {expected} "
                    f"(output_splits[{src}] on rank {dst}); compute output_splits with "
                    "compute_output_splits(input_splits)"
                )
    hows = [r[1 + 2 * world :] for r in rows]
    for i, (what, fix) in enumerate(HOW.items()):
        values = [h[i] for h in hows]
        if len(set(values)) > 1:
            if what == "transport":  # names for the message (every rank is here)
                values = [None] * world
                dist.all_gather_object(values, transport_name, group=group)
            raise ValueError(
                f"{what} differs between ranks ({_describe(what, values)} by rank); {fix}"
            )


_SAME = "every rank must pass the same"
# what how_code holds, and the fix when it differs between ranks
HOW = {
    "x.shape[1] (K)": _SAME,
    "x.dtype": _SAME,
    "scaling_mode": _SAME,
    "transport": _SAME + " kind of transport",
    "transport setting": _SAME + " transport setting (e.g. CopyEngineTransport row_ranges)",
    "x.requires_grad": (
        "make x require grad on every rank or on none (the backward exchange waits for "
        "every rank, and a rank that recorded no graph never joins it)"
    ),
}


def how_code(k: int, x: torch.Tensor, scaling_mode: str, transport: Transport) -> tuple:
    """What the collective's byte counts (and whether a backward exchange follows) depend
    on, as ints for check_all_ranks: K, dtype, scaling mode, transport class and setting,
    whether a graph is recorded. A setting outside [0, 2**62) is a ValueError."""
    setting = transport.setting()
    if type(setting) is not int or not 0 <= setting < MAX_ROWS:
        raise ValueError(
            f"transport.setting() of {type(transport).__name__} must be an int in [0, 2**62), "
            f"got {setting!r}"
        )
    cls = type(transport)
    kind = zlib.crc32(f"{cls.__module__}.{cls.__qualname__}".encode())
    grad = int(torch.is_grad_enabled() and x.requires_grad)
    return (k, _DTYPES.index(x.dtype), SCALING_MODES.index(scaling_mode), kind, setting, grad)


def _describe(what: str, values: list) -> list:
    if what == "x.dtype":
        return [str(_DTYPES[v]) for v in values]
    if what == "scaling_mode":
        return [SCALING_MODES[v] for v in values]
    if what == "x.requires_grad":
        return [bool(v) for v in values]
    return values
