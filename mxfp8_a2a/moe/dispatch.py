"""Expert-parallel MoE dispatch and combine on the MXFP8 exchange.

Experts are spread evenly over the ranks of ``group``: rank r holds experts
[r * L, (r + 1) * L), L = num_experts // world. ``dispatch`` sends each (token, top-k slot)
row to the rank of its expert and returns them grouped by local expert; ``combine`` sends
the expert outputs back and sums them with the router weights in the original token order.
Autograd flows through both (the exchanges' backward is the reverse exchange).

Collectives and host syncs: ``dispatch`` makes one small all-to-all of per-expert counts
and one host sync to read the splits that all_to_all_single needs, then the exchange. With
the counts each rank sends two int64 more: an error flag and what every rank's exchange
must agree on (hidden size, dtype, exchange, transport, whether x records a graph), so that
bad arguments on one rank, or ranks that disagree, raise the same ValueError on every rank
before any exchange (only then a second collective brings the bad rank's message). The
splits come from that all-to-all, so they agree across ranks by construction.
``combine`` has no host sync and no collective besides its exchange.

Every rank of the group must call dispatch and combine alike (and run the backward alike),
with the same ``num_experts`` (it sets the size of the counts all-to-all: a rank with
another one makes that collective fail).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..exchange.api import to_mxfp8_a2a_dequant
from ..exchange.checks import comm_device, device_error, group_rank_and_size, raise_on_every_rank
from ..exchange.plain import all_to_all_rows
from ..exchange.transport import Transport, resolve
from .rows import take_rows
from .slot_sum import slot_sum

EXCHANGES = ("mxfp8", "bf16")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # else code 0


def exchange_rows(
    x: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None,
    exchange: str,
    transport: str | Transport = "nccl",
) -> torch.Tensor:
    """Differentiable all-to-all of x's rows: "mxfp8" (:func:`to_mxfp8_a2a_dequant` over
    ``transport``) or "bf16" (a plain all_to_all_single of x in its own dtype)."""
    if exchange == "mxfp8":
        return to_mxfp8_a2a_dequant(x, output_splits, input_splits, group, transport=transport)
    if exchange == "bf16":
        return all_to_all_rows(x, output_splits, input_splits, group)
    raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")


@dataclass
class DispatchHandle:
    """What combine needs to undo a dispatch. Tensors are on x's device.

    order: int64 [T * k] (token, slot) pairs sorted by expert (stable); inverse_order: its
    inverse. regroup: int64 [N] received rows reordered from (source rank, expert) to
    (expert, source rank); inverse_regroup: its inverse. input_splits / output_splits: rows
    sent to / received from each rank. expert_offsets: int32 [L], end offset of each local
    expert's rows in dispatch's output (what grouped GEMMs take). top_k, num_tokens, hidden:
    for the final sum. exchange, transport: how the rows move.
    """

    order: torch.Tensor
    inverse_order: torch.Tensor
    regroup: torch.Tensor
    inverse_regroup: torch.Tensor
    input_splits: list[int]
    output_splits: list[int]
    expert_offsets: torch.Tensor
    top_k: int
    num_tokens: int
    hidden: int
    group: dist.ProcessGroup | None
    exchange: str
    transport: str | Transport = "nccl"


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def _local_error(x, topk_ids, num_experts, world, exchange, group) -> str | None:
    """What is wrong with this rank's arguments (shapes and types only, no data read)."""
    if exchange not in EXCHANGES:
        return f"exchange must be one of {EXCHANGES}, got {exchange!r}"
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
    if exchange == "mxfp8" and x.dtype not in (torch.bfloat16, torch.float32):
        return f"x must be bfloat16 or float32 for exchange='mxfp8', got {x.dtype}"
    if exchange == "mxfp8" and x.shape[1] % 32:
        return f"x.shape[1] (hidden={x.shape[1]}) must be a multiple of 32 for exchange='mxfp8'"
    return None


# what every rank's exchange must agree on, sent beside the counts in two int64 columns:
# _agreement's packed word (fields from the least significant: name, width, fix when it
# differs between ranks) and a 32-bit code of the transport's class and setting
_AGREE = (
    ("x.requires_grad", 2, "make x require grad on every rank or on none (else the "
     "backward exchange waits for ranks that recorded no graph)"),
    ("exchange", 2, "pass the same exchange on every rank"),
    ("x.dtype", 8, "pass x in the same dtype on every rank"),
    ("x.shape[1] (hidden)", None, "pass the same hidden size on every rank"),
)  # fmt: skip


def _agreement(x: torch.Tensor, exchange: str, transport: Transport) -> tuple[int, int]:
    """(hidden / dtype / exchange / grad packed in one word, the transport's code): the crc32
    of its module, class name and setting; 0 for "bf16", which takes no transport."""
    dtype = _DTYPES.index(x.dtype) + 1 if x.dtype in _DTYPES else 0
    grad = int(torch.is_grad_enabled() and x.requires_grad)
    word = ((x.shape[1] * 8 + dtype) * 2 + EXCHANGES.index(exchange)) * 2 + grad
    if exchange != "mxfp8":
        return word, 0
    cls = type(transport)
    kind = f"{cls.__module__}.{cls.__qualname__}:{transport.setting()!r}"
    return word, zlib.crc32(kind.encode())


def _fields(value: int) -> list[int]:
    out = []
    for _, width, _ in _AGREE:
        out.append(value % width if width else value)
        value //= width or 1
    return out


def _check_agreement(values: list[tuple[int, int]]) -> None:
    """Raise if the ranks' _agreement values differ (every rank sees them all)."""
    if len(set(values)) == 1:
        return
    per_rank = [_fields(v[0]) for v in values]
    for i, (what, _, fix) in reversed(list(enumerate(_AGREE))):  # hidden size first
        got = [f[i] for f in per_rank]
        if len(set(got)) > 1:
            if what == "x.dtype":
                got = [str(_DTYPES[v - 1]) if v else "other" for v in got]
            elif what == "exchange":
                got = [EXCHANGES[v] for v in got]
            elif what == "x.requires_grad":
                got = [bool(v) for v in got]
            raise ValueError(f"dispatch: {what} differs between ranks ({got} by rank); {fix}")
    raise ValueError(
        "dispatch: the transport (its class or settings) differs between ranks (codes by rank: "
        f"{[v[1] for v in values]}); pass the same kind of transport, with the same "
        "settings, on every rank"
    )


def dispatch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
    *,
    exchange: str = "mxfp8",
    transport: str | Transport = "nccl",
) -> tuple[torch.Tensor, list[int], DispatchHandle]:
    """Send each token to the ranks of its top-k experts.

    Args:
        x: [T, H] bf16 or fp32 tokens (H % 32 == 0 for "mxfp8"); T may be 0.
        topk_ids: [T, k] integer expert ids in [0, num_experts); k may be 0.
        num_experts: total experts, a multiple of the group size.
        exchange: "mxfp8" or "bf16" (plain all-to-all in x's dtype).
        transport: of the MXFP8 exchanges, "nccl" (default) or a Transport object (see
            :func:`mxfp8_a2a.to_mxfp8_a2a_dequant`).
    Returns:
        expert_x: [N, H] rows received, grouped by local expert (expert 0 first), within an
            expert by source rank; tokens_per_expert: list of L ints, rows per local expert
            (read in the same host sync as the splits); handle for :func:`combine`
            (handle.expert_offsets holds the same counts as int32 end offsets on x's device).
    Bad arguments on any rank (shapes, types, ids out of range) and ranks that disagree
    (hidden size, dtype, exchange, transport, x.requires_grad) raise the same ValueError on
    every rank, naming the rank and the argument; the group stays usable. Every rank must
    call it, with the same num_experts.
    """
    return dispatch_reporting(x, topk_ids, num_experts, group, exchange, transport, None)


def dispatch_reporting(
    x: torch.Tensor,
    topk_ids: torch.Tensor | None,
    num_experts: int,
    group: dist.ProcessGroup | None,
    exchange: str,
    transport: str | Transport,
    problem: str | None,
) -> tuple[torch.Tensor, list[int], DispatchHandle]:
    """:func:`dispatch`, with ``problem`` (what the caller found wrong with this rank's
    arguments, or None) raised like dispatch's own checks: as the same ValueError on every
    rank, so that a layer whose input is bad on one rank does not leave the others waiting
    in the counts all-to-all (topk_ids may then be None)."""
    rank, world = group_rank_and_size(group)
    error: Exception | None = None
    try:
        chosen = resolve(transport)
        problem = problem or _local_error(x, topk_ids, num_experts, world, exchange, group)
        if problem is not None:
            raise ValueError(problem)
        if exchange == "mxfp8":
            chosen.check(x.device, group)
        agree = _agreement(x, exchange, chosen)
    except Exception as e:  # every rank learns of it through the counts all-to-all
        error = e
    # every rank sends world x (local + 2) counts, also a rank whose arguments are bad; the
    # last two columns: 4 * agreement word + flag (0 fine, 1 ids out of range, 2 bad
    # arguments), and the transport's code
    local = max(num_experts // world, 1) if type(num_experts) is int else 1
    dev = comm_device(group)
    if error is None:
        t, k = topk_ids.shape
        flat = topk_ids.reshape(-1).to(torch.int64)
        bad = ((flat < 0) | (flat >= num_experts)).any().reshape(1)
        # scatter_add, not bincount: on CUDA bincount reads the ids' min and max on the host
        counts = flat.new_zeros(num_experts).scatter_add_(
            0, flat.clamp(0, num_experts - 1), torch.ones_like(flat)
        )
        flag = bad.add(4 * agree[0]).expand(world, 1)  # bool + int: int64, one kernel
        code = flag.new_full((world, 1), agree[1])  # a fill: no copy from the host
        sent = torch.cat([counts.view(world, local), flag, code], 1).to(dev)
    else:
        sent = torch.zeros(world, local + 2, dtype=torch.int64, device=dev)
        sent[:, local] = 2
    recv = torch.empty_like(sent)
    dist.all_to_all_single(recv, sent, group=group)  # [src, local expert | flag, code]
    flags_and_sizes = torch.cat(
        [recv[:, local:].reshape(-1), sent[:, :local].sum(1), recv[:, :local].sum(1),
         recv[:, :local].sum(0)]
    )  # fmt: skip
    sizes = flags_and_sizes.tolist()  # the host sync: all_to_all_single needs the splits
    agreed, sizes = sizes[: 2 * world], sizes[2 * world :]
    flags = [v % 4 for v in agreed[::2]]
    if any(flags):  # the same on every rank: every rank received every rank's flag
        if error is None and flags[rank] == 1:
            ids = flat[(flat < 0) | (flat >= num_experts)]
            error = ValueError(
                f"topk_ids holds {ids.numel()} ids outside [0, num_experts={num_experts}) "
                f"(from {ids.min().item()} to {ids.max().item()}); route to existing experts"
            )
        raise_on_every_rank("dispatch", error, group)
    _check_agreement([(w // 4, c) for w, c in zip(agreed[::2], agreed[1::2], strict=True)])
    input_splits, output_splits = sizes[:world], sizes[world : 2 * world]
    per_expert = sizes[2 * world :]
    recv_counts = recv[:, :local].reshape(-1).to(x.device)
    order = torch.sort(flat, stable=True).indices
    # received rows come as (source, expert) segments; regroup to (expert, source)
    seg = torch.repeat_interleave(
        torch.arange(world * local, device=x.device), recv_counts, output_size=sum(output_splits)
    )  # output_size: without it CUDA reads the total on the host
    regroup = torch.sort((seg % local) * world + seg // local, stable=True).indices
    inverse_order, inverse_regroup = _inverse(order), _inverse(regroup)
    rows = exchange_rows(
        take_rows(x, order // max(k, 1), inverse_order, k), output_splits, input_splits,
        group, exchange, chosen,
    )  # fmt: skip
    offsets = recv[:, :local].sum(0).cumsum(0).to(device=x.device, dtype=torch.int32)
    handle = DispatchHandle(
        order, inverse_order, regroup, inverse_regroup, input_splits, output_splits,
        offsets, k, t, x.shape[1], group, exchange, chosen,
    )  # fmt: skip
    return take_rows(rows, regroup, inverse_regroup), per_expert, handle


def _check_combine(expert_y, topk_weights, handle: DispatchHandle, exchange) -> None:
    n, t, k, h = handle.regroup.numel(), handle.num_tokens, handle.top_k, handle.hidden
    if not isinstance(expert_y, torch.Tensor) or expert_y.dim() != 2:
        got = getattr(expert_y, "shape", type(expert_y).__name__)
        raise ValueError(f"expert_y must be a 2-D [{n}, {h}] tensor, got {got}")
    if expert_y.shape != (n, h):
        raise ValueError(
            f"expert_y must be [{n}, {h}] (one row per row dispatch returned, of dispatch's "
            f"hidden size), got {tuple(expert_y.shape)}"
        )
    if expert_y.device != handle.regroup.device:
        raise ValueError(
            f"expert_y is on {expert_y.device}, dispatch's tensors on "
            f"{handle.regroup.device}; keep them on one device"
        )
    if not isinstance(topk_weights, torch.Tensor) or topk_weights.shape != (t, k):
        raise ValueError(
            f"topk_weights must be a [{t}, {k}] tensor (tokens, top-k of the dispatch), got "
            f"{tuple(getattr(topk_weights, 'shape', ())) or type(topk_weights)}"
        )
    if not topk_weights.dtype.is_floating_point or topk_weights.device != expert_y.device:
        raise ValueError(
            f"topk_weights must be a floating tensor on {expert_y.device}, got "
            f"{topk_weights.dtype} on {topk_weights.device}"
        )
    if exchange is not None and exchange not in EXCHANGES:
        raise ValueError(f"exchange must be None or one of {EXCHANGES}, got {exchange!r}")


def combine(
    expert_y: torch.Tensor,
    topk_weights: torch.Tensor,
    handle: DispatchHandle,
    *,
    exchange: str | None = None,
) -> torch.Tensor:
    """Send expert outputs back and sum them with the router weights.

    Args:
        expert_y: [N, H] outputs in the order :func:`dispatch` returned the rows.
        topk_weights: [T, k] router weights of each token's experts.
        handle: from the matching dispatch.
        exchange: "mxfp8" or "bf16"; default: the dispatch's (every rank must pass the
            same).
    Returns:
        [T, H] in expert_y's dtype: out[t] = sum_j topk_weights[t, j] * y(t, expert j).
    Every rank of the group must call combine after its dispatch (it is a collective). A
    bad argument (expert_y with more or fewer rows than dispatch returned, another width,
    topk_weights of the wrong shape, dtype or device) raises a ValueError on this rank
    before any collective; the other ranks then wait in combine's exchange until this
    rank's process ends (gloo and NCCL then fail them) or the process group's timeout:
    there is no cross-rank check here (it would cost a collective).
    """
    _check_combine(expert_y, topk_weights, handle, exchange)
    y = take_rows(expert_y, handle.inverse_regroup, handle.regroup)
    back = exchange_rows(
        y, handle.input_splits, handle.output_splits, handle.group,
        exchange or handle.exchange, handle.transport,
    )  # fmt: skip
    return slot_sum(back, handle.inverse_order.view(handle.num_tokens, handle.top_k), topk_weights)
