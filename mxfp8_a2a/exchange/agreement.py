"""What the ranks of a group must agree on, and each rank's own error, in one encoding checked
in one place, with one error format: every front end (the exchange, checks.py; the MoE front
ends and NodeTopology, moe/terms.py and moe/checks.py) uses it.

A front end's *terms* are what its collectives' sizes depend on (or whether a backward
exchange follows), declared once in a table (:func:`table`: one :class:`Term` each, its
name, how to read it from the arguments, its fix, whether the ranks compare it); a rank's
values are name=value pairs written as one text (:func:`terms_of`). :func:`check` is the
one cross-rank check (this rank's terms or error, one all_gather, the same error on every
rank); dispatch and the static dispatch send the same text their own way (below, and
moe/checks.py's agree_static). Two encodings of the same thing:

- the word, one int64: status + 4 * a 60-bit digest of the terms text. Status: FINE,
  BAD_VALUES (found on the device, e.g. ids out of range), BAD_ARGUMENTS (a ValueError)
  or BAD_TYPES (a TypeError). Dispatch sends it beside its counts (no extra collective).
- the row: [word, *extra ints, *TEXT_WORDS int64 holding the terms text, or the rank's
  error message, in utf-8]. One all_gather of every rank's row (:func:`gather_rows`) gives
  every rank all of them, and :func:`check_rows` raises the same error on every rank:
  the bad ranks' messages, else the first term that differs with its value on each rank.

Dispatch gathers rows only when the words it received are not all FINE and equal (the
error path); the exchange's validation gathers them on every validated call. Under
torch.compile the row is built and checked in custom ops that run at run time, around the
traced gather: a compiled rank joins the same collective as an eager one.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .plain import HAS_FUNCOL, funcol

FINE, BAD_VALUES, BAD_ARGUMENTS, BAD_TYPES = range(4)
TEXT_WORDS = 128  # 1 KB of text per rank: the first ~1000 bytes of a message
_SEP = "\x1f"  # between the terms of a text

SAME = "every rank must pass the same"


@dataclass(frozen=True)
class Term:
    """One thing a front end's collectives depend on.

    name: as errors name it; read: its value, from the front end's arguments (a dict,
    which torch.compile traces; None: not part of this call); fix: what a rank whose value
    differs should do; agree:
    whether the ranks' values are compared (False: every rank must still hold the same,
    but nothing compares them, as in combine, where it would cost a collective)."""

    name: str
    read: Callable[[Any], object]
    fix: str
    agree: bool = True


TABLES: dict[str, tuple[Term, ...]] = {}  # front end -> its terms, in the order checked
_CHECK_EXTRA: dict[str, Callable] = {}  # front end -> its check of the rows' extra ints


def table(what: str, *terms: Term, check_extra: Callable | None = None) -> str:
    """Declare front end ``what``'s terms (and its check of the rows' extra ints, given
    every rank's rows); returns ``what``."""
    TABLES[what] = terms
    if check_extra is not None:
        _CHECK_EXTRA[what] = check_extra
    return what


def terms_of(what: str, args: Any) -> str:
    """The compared terms of front end ``what`` read from ``args``, as one text."""
    read = ((t.name, t.read(args)) for t in TABLES[what] if t.agree)
    return terms_text({name: value for name, value in read if value is not None})


def _fix(what: str, name: str) -> str:
    return next((t.fix for t in TABLES.get(what, ()) if t.name == name), f"{SAME} {name}")


# torch >= 2.13 renames all_gather_into_tensor to all_gather_single
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def terms_text(terms: dict[str, object]) -> str:
    """The terms (name -> value) as one text: name=str(value) pairs. A symbolic size (under
    torch.compile with dynamic shapes) is read as its value: the compiled code then guards on
    it, as the text is fixed at trace time."""
    return _SEP.join(f"{name}={_plain(value)}" for name, value in terms.items())


def _plain(value: object) -> object:
    """A size as a plain int (under torch.compile an int that changed between compiles is
    symbolic and cannot be formatted: int() specializes it, with a guard)."""
    if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
        return int(value)
    return value


@functools.lru_cache(maxsize=256)
def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 4


def word(status: int, text: str) -> int:
    """The word of a rank: ``status`` + 4 * the digest of its terms ``text`` (in [0, 2**62))."""
    return status + 4 * _digest(text)


def status_of(error: BaseException) -> int:
    return BAD_TYPES if isinstance(error, TypeError) else BAD_ARGUMENTS


def row(status: int, text: str, extra: list[int]) -> torch.Tensor:
    """int64 [1 + len(extra) + TEXT_WORDS] on the CPU: the word, ``extra``, then ``text`` (the
    terms, or the error message when status is not FINE) in utf-8, cut to TEXT_WORDS * 8
    bytes."""
    data = text.encode()[: 8 * TEXT_WORDS]
    data = bytearray(data + bytes(8 * TEXT_WORDS - len(data)))
    head = torch.tensor([word(status, text), *extra], dtype=torch.int64)
    return torch.cat([head, torch.frombuffer(data, dtype=torch.int64)])


def _text(words: list[int]) -> str:
    data = b"".join(w.to_bytes(8, "little", signed=True) for w in words)
    return data.rstrip(b"\0").decode(errors="replace")


def gather_rows(mine: torch.Tensor, group: dist.ProcessGroup | None) -> list[list[int]]:
    """Every rank's row (an all_gather on the group's device, then a host sync)."""
    world = dist.get_world_size(group)
    dev = comm_device(group)
    table = torch.empty(world * mine.numel(), dtype=torch.int64, device=dev)
    _all_gather(table, mine.to(dev), group=group)
    return table.view(world, -1).tolist()


def comm_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device the collectives of ``group`` take tensors on (CUDA for NCCL)."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_rows(what: str, rows: list[list[int]], n_extra: int, check_extra=None) -> None:
    """Raise, the same on every rank, what the rows (every rank's, from :func:`row`) say is
    wrong: the bad ranks' messages (a TypeError if each is one), then ``check_extra(rows)``
    (the rows' extra ints), then the first term that differs between ranks."""
    status = [r[0] % 4 for r in rows]
    texts = [_text(r[1 + n_extra :]) for r in rows]
    bad = [rank for rank, s in enumerate(status) if s != FINE]
    if bad:
        text = "; ".join(f"rank {r}: {texts[r]}" for r in bad)
        cls = TypeError if all(status[r] == BAD_TYPES for r in bad) else ValueError
        raise cls(f"{what}: bad arguments on rank(s) {bad} of the group: {text}")
    if check_extra is not None:
        check_extra(rows)
    terms = [dict(t.split("=", 1) for t in text.split(_SEP) if t) for text in texts]
    order = [t.name for t in TABLES.get(what, ())]  # (the table's order, then any other)
    names = sorted(dict.fromkeys(name for t in terms for name in t),
                   key=lambda n: order.index(n) if n in order else len(order))  # fmt: skip
    for name in names:
        values = [t.get(name, "-") for t in terms]
        if len(set(values)) > 1:
            fix = _fix(what, name)
            raise ValueError(
                f"{what}: {name} differs between ranks ([{', '.join(values)}] by rank); {fix}"
            )
    if len({r[0] for r in rows}) > 1:  # texts cut short (never at today's terms)
        raise ValueError(f"{what}: the ranks' arguments differ (words {[r[0] for r in rows]})")


def agree(
    what: str,
    status: int,
    text: str,
    extra: list[int],
    group: dist.ProcessGroup | None,
) -> list[list[int]]:
    """Eagerly: gather every rank's row, raise (the same on every rank) what is wrong;
    returns the rows (each rank's [word, *extra, *text])."""
    rows = gather_rows(row(status, text, extra), group)
    check_rows(what, rows, len(extra), _CHECK_EXTRA.get(what))
    return rows


def check(
    what: str,
    args: Any,
    error: Exception | None,
    group: dist.ProcessGroup | None,
    extra: list[int] = (),  # type: ignore[assignment]
) -> list[list[int]]:
    """A front end's one cross-rank check, before its other collectives: this rank's terms
    (TABLES[what] read from ``args``) and ``extra`` ints, or its ``error`` (a ValueError or
    TypeError found checking its own arguments), in one all_gather; every rank raises the
    same error (the bad ranks' messages, else the first term that differs, with each
    rank's value and the term's fix). Returns every rank's rows."""
    if error is None:
        try:
            text = terms_of(what, args)
        except (TypeError, ValueError) as e:  # (reading a term: this rank's error)
            error = e
    if error is None:
        return agree(what, FINE, text, list(extra), group)
    return agree(what, status_of(error), str(error), [0] * len(extra), group)


# Under torch.compile: the row and the check run at run time as custom ops, the gather
# between them is traced (a functional collective), so that the compiled rank takes part
# in the same all_gather as an eager one.
@torch.library.custom_op("mxfp8_a2a::agreement_row", mutates_args=())
def _row_op(status: int, text: str, extra: list[int], device: torch.device) -> torch.Tensor:
    return row(status, text, extra).to(device)


@_row_op.register_fake
def _(status, text, extra, device):
    return torch.empty(1 + len(extra) + TEXT_WORDS, dtype=torch.int64, device=device)


@torch.library.custom_op("mxfp8_a2a::agreement_check", mutates_args=())
def _check_op(table: torch.Tensor, x: torch.Tensor, what: str, world: int) -> torch.Tensor:
    """Raise what check_rows finds in the gathered ``table``; else a copy of x (kept, so that
    the check stays in the graph, before the exchange that reads it)."""
    rows = table.view(world, -1).tolist()
    check_rows(what, rows, table.numel() // world - 1 - TEXT_WORDS, _CHECK_EXTRA.get(what))
    return x.clone()


@_check_op.register_fake
def _(table, x, what, world):
    return torch.empty_like(x)


_check_op.register_autograd(lambda ctx, grad: (None, grad, None, None))


def agree_compiled(
    what: str,
    status: int,
    text: str,
    extra: list[int],
    group: dist.ProcessGroup | None,
    x: torch.Tensor,
) -> torch.Tensor:
    """:func:`agree` inside torch.compile: returns x, through the check (a copy)."""
    if not HAS_FUNCOL:
        raise ValueError("validation under torch.compile needs torch's functional collectives")
    world = dist.get_world_size(group)
    mine = _row_op(status, text, extra, comm_device(group))
    table = funcol.wait_tensor(funcol.all_gather_tensor(mine, 0, group or dist.group.WORLD))
    return _check_op(table, x, what, world)
