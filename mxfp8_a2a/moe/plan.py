"""The dispatch plan of both front ends: where every (token, slot) row goes, on the device.

- :func:`send_plan`: from topk_ids [T, k], each row's send-buffer slot (-1: dropped), the
  rows kept per (destination rank, local expert), and the drop counts.
- :func:`receive_plan`: from the counts received [W, L], each receive-buffer row's output
  row, each output row's receive-buffer row, and the experts' aligned end offsets.

Two layouts of the wire buffers. Fixed slots (``capacity`` an int, the sync-free
dispatch_static): destination d's rows at [d * capacity, ...) of the send buffer, source s's
at [s * capacity, ...) of the receive buffer, rows past a pair's ``capacity`` dropped.
Packed (``capacity=None``, the host-synced dispatch, which has read the counts): no drops,
the pairs' rows back to back in rank order (what all_to_all_single with splits sends and
receives), so the buffers hold exactly the rows that travel.

The ``*_reference`` functions are the plain-torch definitions (stable sorts and binary
searches, about 40 small ops); on CUDA (and on CPU under TRITON_INTERPRET=1) the public
functions run the Triton kernels of plan_kernels.py instead, the same values exactly.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._common import kernels_run_on
from .plan_kernels import _rank_kernel, _segments_kernel, receive_plan_kernels, send_plan_kernels


def capacity_for(num_tokens: int, top_k: int, world: int, capacity_factor: float) -> int:
    """Rows per rank pair for a capacity factor: ceil(factor * T * top_k / W) (1.0: room for
    a perfectly balanced routing)."""
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor!r}")
    return math.ceil(capacity_factor * num_tokens * top_k / world)


def static_rows(capacity: int, world: int, num_local: int, align: int) -> int:
    """Rows of static dispatch's output: the most that W * capacity received rows take once
    each of the L experts' blocks is rounded up to ``align``."""
    return (world * capacity + num_local * (align - 1)) // align * align


# ---------------------------------------------------------------------------- references


def _rank_in_bucket(key: torch.Tensor, buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(position of each element among the elements of its bucket, in index order; count of
    each bucket) for key int64 [N] in [0, buckets). A stable sort of int32 keys (half the
    radix passes of int64) and bucket bounds by binary search."""
    sorted_keys, order = torch.sort(key.to(torch.int32), stable=True)
    edges = torch.arange(buckets + 1, dtype=torch.int32, device=key.device)
    bounds = torch.searchsorted(sorted_keys, edges)  # first element of each bucket
    rank_sorted = torch.arange(key.numel(), device=key.device) - bounds[sorted_keys]
    return torch.empty_like(key).scatter_(0, order, rank_sorted), bounds.diff()


def send_plan_reference(
    topk_ids: Tensor, num_experts: int, world: int, capacity: int | None
) -> tuple[Tensor, Tensor, Tensor]:
    """From topk_ids [T, k]: rows_of int64 [T, k] (send-buffer row, -1 if dropped), sent
    int64 [W, L] (rows kept per destination rank and local expert), stats int64 [3]
    (StaticHandle.stats). The send buffer holds destination d's rows at [d * capacity,
    d * capacity + sum(sent[d])) (capacity None: at sum(sent[:d]), none dropped but invalid
    ids), grouped by local expert, token-major within."""
    t, k = topk_ids.shape
    local = num_experts // world
    flat = topk_ids.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < num_experts)
    dest = torch.where(valid, flat // local, world)  # bucket W: invalid ids
    pos, per_dest = _rank_in_bucket(dest, world + 1)
    kept = valid & (pos < capacity) if capacity is not None else valid
    key = torch.where(kept, flat, num_experts)  # bucket E: not sent
    rank_in_expert, per_expert = _rank_in_bucket(key, num_experts + 1)
    start = per_expert.cumsum(0) - per_expert  # kept rows of experts before e, this rank
    first = torch.arange(num_experts, device=flat.device) // local * local
    in_block = start[:num_experts] - start[first]  # expert e's offset in its rank's block
    e = flat.clamp(0, num_experts - 1)
    if capacity is None:  # destinations back to back
        row = start[e] + rank_in_expert
    else:
        row = dest.clamp(max=world - 1) * capacity + in_block[e] + rank_in_expert
    rows_of = torch.where(kept, row, -1).view(t, k)
    n_kept = per_expert[:num_experts].sum()
    invalid = per_dest[world]
    needed = per_dest[:world].max() if world else per_dest.new_zeros(())
    stats = torch.stack([t * k - invalid - n_kept, needed, invalid])
    return rows_of, per_expert[:num_experts].view(world, local), stats


def _sizes(recv: Tensor, capacity: int | None, align: int, rows) -> tuple[int, int]:
    """(receive-buffer rows, output rows) of a receive plan; packed (capacity None): the
    ``rows`` the caller counted on the host."""
    if capacity is not None:
        return recv.shape[0] * capacity, static_rows(capacity, *recv.shape, align)
    if rows is None:
        raise ValueError("a packed receive plan (capacity=None) needs rows=(n_recv, n_out)")
    return rows


def receive_plan_reference(
    recv: Tensor, capacity: int | None, align: int, rows: tuple[int, int] | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """From recv int64 [W, L] (rows from source s for local expert l): src_row int64 [N] (the
    receive-buffer row of each output row, -1 for padding), out_row int64 [R] (the output
    row of each receive-buffer row, -1 if unused) and the int32 [L] aligned end offsets.
    Fixed slots: R = W * capacity, N = static_rows(capacity, W, L, align); packed (capacity
    None): (R, N) = ``rows``, sum(recv) and the sum over l of round_up(sum_s recv[s, l],
    align), source s's rows at sum(recv[:s]) of the receive buffer."""
    world, local = recv.shape
    n_recv, n_out = _sizes(recv, capacity, align, rows)
    per_expert = recv.sum(0)
    padded = (per_expert + align - 1) // align * align
    ends = padded.cumsum(0)
    block = ends - padded  # where expert l's block starts
    from_src = recv.cumsum(0) - recv  # rows of l from sources before s
    in_src = recv.cumsum(1)  # inclusive: end of expert l's rows in source s's rows
    if capacity is None:  # the (s, l) segment of each receive row by the segments' ends
        per_src = in_src[:, -1]
        src_start = per_src.cumsum(0) - per_src
        i = torch.arange(n_recv, device=recv.device)
        seg = torch.searchsorted((src_start[:, None] + in_src).reshape(-1), i, right=True)
        s, lc = seg // local, seg % local
        q = i - src_start[s]
        used = torch.ones_like(q, dtype=torch.bool)
    else:  # (as [W, capacity]: no index division, which inductor's CPU loop split of torch
        # 2.11 fails to compile)
        q = torch.arange(capacity, device=recv.device).expand(world, capacity).contiguous()
        lid = torch.searchsorted(in_src, q, right=True)  # local expert of each received row
        used = lid < local
        lc = lid.clamp(max=local - 1)
        s = torch.arange(world, device=recv.device)[:, None]
    out = block[lc] + from_src[s, lc] + q - (in_src[s, lc] - recv[s, lc])
    out_row = torch.where(used, out, -1).reshape(-1)
    i = torch.arange(n_recv, device=recv.device)
    # unused receive rows land in slots of their own past n_out (stores to one shared slot
    # would pile up on one address)
    src = torch.full((n_out + n_recv,), -1, dtype=torch.int64, device=recv.device)
    src.scatter_(0, torch.where(out_row < 0, n_out + i, out_row), i)
    return src[:n_out], out_row, ends.to(torch.int32)


# ---------------------------------------------------------------------------- ops, public

send_plan_op = torch.library.custom_op(
    "mxfp8_a2a::moe_send_plan", send_plan_kernels, mutates_args=()
)
receive_plan_op = torch.library.custom_op(
    "mxfp8_a2a::moe_receive_plan", receive_plan_kernels, mutates_args=()
)


@send_plan_op.register_fake
def _(topk_ids, num_experts, world, capacity):
    new = topk_ids.new_empty
    i64 = torch.int64
    return (
        new(topk_ids.shape, dtype=i64),
        new((world, num_experts // world), dtype=i64),
        new((3,), dtype=i64),
    )


@receive_plan_op.register_fake
def _(recv, capacity, align, n_recv, n_out):
    new = recv.new_empty
    return new((n_out,)), new((n_recv,)), new((recv.shape[1],), dtype=torch.int32)


def send_plan(
    topk_ids: Tensor, num_experts: int, world: int, capacity: int | None
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`send_plan_reference`'s (rows_of int64 [T, k], sent int64 [W, L], stats int64
    [3]), by the kernels where they run. capacity None: the packed layout."""
    if kernels_run_on(topk_ids.device, _rank_kernel) and not topk_ids.dtype.is_floating_point:
        return send_plan_op(topk_ids, num_experts, world, -1 if capacity is None else capacity)
    return send_plan_reference(topk_ids, num_experts, world, capacity)


def receive_plan(
    recv: Tensor, capacity: int | None, align: int, rows: tuple[int, int] | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`receive_plan_reference`'s (src_row int64 [N], out_row int64 [R], ends int32
    [L]) for recv int64 [W, L], by the kernels where they run. capacity None: the packed
    layout, of ``rows`` = (R, N) rows, counted by the caller."""
    n_recv, n_out = _sizes(recv, capacity, align, rows)
    if kernels_run_on(recv.device, _segments_kernel) and recv.dtype == torch.int64:
        cap = -1 if capacity is None else capacity
        return receive_plan_op(recv, cap, align, n_recv, n_out)
    return receive_plan_reference(recv, capacity, align, rows)
