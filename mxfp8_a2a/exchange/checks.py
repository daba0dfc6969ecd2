"""Argument checks of the exchange, local and across ranks, in one place (its terms: the
table at WHAT below; the MoE front ends' are in moe/terms.py).

Local checks raise a TypeError/ValueError naming the argument before any collective. What
one rank cannot see alone (splits that disagree between ranks, a K, dtype, scaling mode,
transport or requires_grad that differs) needs ``validate=True`` on every rank: one
all_gather of every rank's agreement row (agreement.py: the splits, what the exchange's
sizes depend on, or the rank's error message) and a host sync, after which every rank
raises the same error. Under torch.compile the compiled rank joins the same all_gather.

MXFP8_A2A_VALIDATE=1 is read once, when this module is imported (so a rank cannot switch it
on for itself in the middle of a run): every rank must be started with the same value.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist

from . import agreement
from .agreement import _all_gather, comm_device  # noqa: F401 (used from here too)
from .transport import Transport, device_error  # noqa: F401 (used from here too)

Splits = Iterable[int] | torch.Tensor

VALIDATE_ENV = "MXFP8_A2A_VALIDATE"
VALIDATE_FROM_ENV = os.environ.get(VALIDATE_ENV, "0") == "1"  # read once, at import
MAX_ROWS = 2**62  # any split at or above it is an error (int64 arithmetic stays exact)


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


def transport_name(transport: Transport) -> str:
    """A transport's kind, as the agreement compares it: its class."""
    cls = type(transport)
    return f"{cls.__module__}.{cls.__qualname__}"


def transport_setting(transport: Transport) -> int:
    """A transport's setting (an int in [0, 2**62), else a ValueError)."""
    setting = transport.setting()
    if type(setting) is not int or not 0 <= setting < MAX_ROWS:
        raise ValueError(
            f"transport.setting() of {type(transport).__name__} must be an int in [0, 2**62), "
            f"got {setting!r}"
        )
    return setting


def _grad(a) -> bool:
    return torch.is_grad_enabled() and a["x"].requires_grad


TRANSPORT_FIX = f"{agreement.SAME} kind of transport"
SETTING_FIX = f"{agreement.SAME} transport setting (e.g. CopyEngineTransport row_ranges)"
GRAD_FIX = (
    "make x require grad on every rank or on none (the backward exchange waits for every "
    "rank, and a rank that recorded no graph never joins it)"
)
WHAT = "to_mxfp8_a2a_dequant"


def _splits_agree(rows: list[list[int]]) -> None:
    """Every rank's [word, *input_splits, *output_splits, ...] rows: rank a sends rank b as
    many rows as b expects from a."""
    world = len(rows)
    for src in range(world):
        for dst in range(world):
            sent, expected = rows[src][1 + dst], rows[dst][1 + world + src]
            if sent != expected:
                raise ValueError(
                    f"{WHAT}: splits disagree: rank {src} sends {sent} rows to rank {dst} "
                    f"(input_splits[{dst}] on rank {src}) but rank {dst} expects {expected} "
                    f"(output_splits[{src}] on rank {dst}); compute output_splits with "
                    "compute_output_splits(input_splits)"
                )


# to_mxfp8_a2a_dequant's terms: what its byte counts (and whether a backward exchange
# follows) depend on; read from dict(x, scaling_mode, transport, backward)
agreement.table(
    WHAT,
    agreement.Term("x.shape[1]", lambda a: a["x"].shape[1], f"{agreement.SAME} x.shape[1] (K)"),
    agreement.Term("x.dtype", lambda a: a["x"].dtype, f"{agreement.SAME} x.dtype"),
    agreement.Term("scaling_mode", lambda a: a["scaling_mode"], f"{agreement.SAME} scaling_mode"),
    agreement.Term("backward", lambda a: a["backward"], f"{agreement.SAME} backward wire"),
    agreement.Term("transport", lambda a: transport_name(a["transport"]), TRANSPORT_FIX),
    agreement.Term("transport setting", lambda a: transport_setting(a["transport"]), SETTING_FIX),
    agreement.Term("x.requires_grad", _grad, GRAD_FIX),
    check_extra=_splits_agree,
)
agreement.table("compute_output_splits")  # (no terms: only each rank's own errors)


def check_all_ranks(
    error: Exception | None,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None,
    world: int,
    terms: str,
    x: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Validation: one all_gather of every rank's agreement row (the splits beside its
    terms, or its error); every rank raises alike. Every rank must call it. Under
    torch.compile (``x`` given) the traced gather and a checking op: returns x through
    that op, to be exchanged."""
    if error is None:
        status, text, extra = agreement.FINE, terms, [*input_splits, *output_splits]
    else:
        status, text, extra = agreement.status_of(error), str(error), [0] * (2 * world)
    if x is not None:
        return agreement.agree_compiled(WHAT, status, text, extra, group, x)
    agreement.agree(WHAT, status, text, extra, group)
    return None
