"""The static dispatch's agreement: the host-known sizes its collectives depend on (capacity,
hidden, exchange, x's dtype where the wire depends on it, num_experts past the inline
counts, the transport's kind, the scaling mode) checked across the ranks ONCE PER NEW
CONFIGURATION, with one small all_gather (exchange/agreement.py's rows), not per step.

Each configuration the ranks agreed on is kept (a bounded cache of its terms text): per
PushBuffer for calls over one, else per process group. A call whose configuration is in
the cache runs no collective; a new one gathers every rank's row, and a rank's own argument
error travels in its row, so the same ValueError is raised on every rank instead of a hang
or an abort in the rows' all-to-all. ``validate=True`` (or MXFP8_A2A_VALIDATE=1, read at
import) gathers on every call.

Limits: every rank meets a new configuration at the same call (the ranks run the same
calls); a configuration that changes on one rank only after the ranks agreed on the old one
(or a bad argument on one rank after the first call) is caught on that rank alone, the
others then wait in the exchange: run with validate to catch it. Under torch.compile the
check runs only with validate, through agreement.agree_compiled (traced gather, checks at
run time, every call); under CUDA graph capture it is skipped (validate raises there).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist

from .. import _config
from ..exchange import agreement
from ..exchange.checks import validating
from ..exchange.push import PushBuffer

WHAT = "dispatch_static"
MAX_KEYS = 64  # configurations kept per group or buffer (oldest forgotten first)
_GROUPS: dict[str, OrderedDict] = {}  # process group name -> agreed terms texts

agreement.FIXES.setdefault(
    "capacity",
    "every rank must pass the same capacity (a layer: the same capacity, or capacity_factor "
    "and max_tokens)",
)


def terms(hidden: int, dtype: torch.dtype, num_experts: int, world: int, capacity: int,
          wires: tuple[str, ...], scaling_mode: str, push: PushBuffer | None) -> str:  # fmt: skip
    """What the static dispatch's collectives' sizes depend on, as agreement.py's terms;
    ``wires``: dispatch's (forward, backward) wires, then combine's default ones."""
    out = {"capacity": capacity, "x.shape[1]": hidden, "exchange": "/".join(wires)}
    if "bf16" in wires:  # (rows in x's dtype on a leg)
        out["x.dtype"] = dtype
    if num_experts // world > _config.DISPATCH_INLINE_COUNTS:  # (its own message size)
        out["num_experts"] = num_experts
    out |= {"scaling_mode": scaling_mode, "transport": "nccl" if push is None else "PushBuffer"}
    return agreement.terms_text(out)


def _cache(group: dist.ProcessGroup | None, push: PushBuffer | None) -> OrderedDict:
    if push is not None:
        return push.__dict__.setdefault("_agreed_configs", OrderedDict())
    name = (group or dist.group.WORLD).group_name
    return _GROUPS.setdefault(name, OrderedDict())


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (nothing may synchronize)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def agree_static(
    text: str,
    error: Exception | None,
    group: dist.ProcessGroup | None,
    push: PushBuffer | None,
    world: int,
    validate: bool,
    x: torch.Tensor,
) -> torch.Tensor:
    """Check this call's configuration ``text`` (or this rank's ``error``) across the ranks
    as the module docstring says; returns x (under torch.compile with validate: x through
    the traced check). Raises the same ValueError/TypeError on every rank that joined."""
    check = validating(validate)
    if torch.compiler.is_compiling():
        if error is not None:
            raise error
        if check and world > 1:
            return agreement.agree_compiled(WHAT, agreement.FINE, text, [], group, x)
        return x
    if capturing():
        if check:
            raise ValueError(
                "under CUDA graph capture pass validate=False (and start without "
                "MXFP8_A2A_VALIDATE=1): validation synchronizes"
            )
        if error is not None:
            raise error
        return x
    if world == 1 or (push is not None and push._handle is None):  # (emulated: one process)
        if error is not None:
            raise error
        return x
    cache = _cache(group, push)
    join = check or (text not in cache if error is None else not cache)
    if not join:  # (agreed before: a lone error is this rank's only)
        if error is not None:
            raise error
        return x
    if error is None:
        status, message = agreement.FINE, text
    else:
        status, message = agreement.status_of(error), str(error)
    agreement.agree(WHAT, status, message, [], group)
    cache[text] = True
    cache.move_to_end(text)
    while len(cache) > MAX_KEYS:
        cache.popitem(last=False)
    return x


def report(problem: str, group: dist.ProcessGroup | None, push: PushBuffer | None) -> None:
    """A layer's error with x before its static dispatch: raised on every rank where the
    ranks would agree at this call (the first call, or validate), else on this rank."""
    world = dist.get_world_size(group) if push is None else push.world
    agree_static("", ValueError(problem), group, push, world, False, torch.empty(0))
