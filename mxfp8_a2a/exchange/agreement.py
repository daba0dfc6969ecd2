"""What the ranks of a group must agree on, and each rank's own error, in one encoding checked
in one place: the exchange's validation (checks.py) and dispatch (moe/dispatch_synced.py) use it.

A rank's *terms* are what its collectives' sizes depend on (or whether a backward exchange
follows), as name=value pairs written as one text (:func:`terms_text`). Two encodings of
the same thing:

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

import torch
import torch.distributed as dist

from .plain import HAS_FUNCOL, funcol

FINE, BAD_VALUES, BAD_ARGUMENTS, BAD_TYPES = range(4)
TEXT_WORDS = 128  # 1 KB of text per rank: the first ~1000 bytes of a message
_SEP = "\x1f"  # between the terms of a text

# the fix to name when a term differs between ranks
_SAME = "every rank must pass the same"
FIXES = {
    "num_experts": f"{_SAME} num_experts",
    "top_k": f"{_SAME} top-k (topk_ids.shape[1], the experts of each token)",
    "LOCAL_WORLD_SIZE": "start every rank with the same LOCAL_WORLD_SIZE (nodes of one size), "
    "or pass ranks_per_node or a mesh to NodeTopology",
    "process groups made before": "make the same process groups, in the same order, on every "
    "rank of the group before its NodeTopology (new_group names a sub-group by this count)",
    "x.shape[1]": f"{_SAME} x.shape[1] (K, the hidden size)",
    "x.dtype": f"pass x in the same dtype on every rank ({_SAME} x.dtype)",
    "exchange": f"{_SAME} exchange",
    "scaling_mode": f"{_SAME} scaling_mode",
    "transport": f"{_SAME} kind of transport",
    "transport setting": f"{_SAME} transport setting (e.g. CopyEngineTransport row_ranges)",
    "topology": "pass the same NodeTopology (or none) on every rank",
    "ranks_per_node": f"{_SAME} ranks_per_node (or mesh) to NodeTopology",
    "x.requires_grad": (
        "make x require grad on every rank or on none (the backward exchange waits for "
        "every rank, and a rank that recorded no graph never joins it)"
    ),
}

# torch >= 2.13 renames all_gather_into_tensor to all_gather_single
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def terms_text(terms: dict[str, object]) -> str:
    """The terms (name -> value, in FIXES' names) as one text: name=str(value) pairs."""
    return _SEP.join(f"{name}={value}" for name, value in terms.items())


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
    names = list(dict.fromkeys(name for t in terms for name in t))
    for name in names:
        values = [t.get(name, "-") for t in terms]
        if len(set(values)) > 1:
            fix = FIXES.get(name, f"{_SAME} {name}")
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
    check_extra=None,
) -> None:
    """Eagerly: gather every rank's row, raise (the same on every rank) what is wrong."""
    rows = gather_rows(row(status, text, extra), group)
    check_rows(what, rows, len(extra), check_extra)


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

_CHECK_EXTRA: dict = {}  # what -> its check of the extra ints (registered by the callers)


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
