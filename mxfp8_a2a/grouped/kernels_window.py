"""The colwise per-group FP8 scaling in one launch that reads x from HBM about once: the amax
tiles and the cast tiles of kernels_colwise.py, run by persistent programs in an order that
keeps the second read of x in L2. See per_group_scales.py for the launcher and reference.py
for the definition it matches.

x is seen as [batch, other, group] through strides, as in kernels_colwise.py. The other axis
is cut into strips of BO indices, WS strips to a *window* (per batch entry): a window holds
every group-axis index of its WS * BO other-axis indices, so each of its columns' groups is
whole in it. Work items are the amax tiles of a window (BLA group-axis indices of one strip)
and its cast tiles (BLX destination indices of one strip); the amax items of window w + L
(L = ``lookahead``) come between the amax items of window w and its cast items. Items are
handed out in that order by an atomic ticket counter (``grab`` at a time), so the tiles in
flight at any moment are those of about L + 1 windows: with a window of a few MB, window w's
rows are still in L2 when its cast items read them again. A cast item waits (spinning on an
acquire read) until every amax item of its window has counted itself done (release add after
its atomic maxes). No deadlock for any number of programs or any order of scheduling: a
program only takes a ticket once it runs, and only waits for items of smaller tickets, which
running programs hold (the interpreter, running programs one after another, gives program 0
every ticket, each item's dependencies already done).

Bytes: x read once from HBM (and once more from L2), the data written once: 3 per bf16
element, as for one pass, whatever the group sizes (one group of every row too).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernels_colwise import (
    _amax_tile,
    _batch,
    _batch_table,
    _cast_tile,
    _destinations,
    group_bounds,
)

SYNC_LINE = 32  # int32 counters a 128-byte line apart
LINE = tl.constexpr(SYNC_LINE)


@triton.jit
def _window_amax(
    x_ptr, ws_ptr, sync_ptr, w, item, wpb, gi, valid, starts, ends, n_other, extent, n_groups,
    n_strips, sxb, sxo, sxg,
    SOFT: tl.constexpr, INT64: tl.constexpr, BO: tl.constexpr, BLA: tl.constexpr,
    SUB: tl.constexpr, WS: tl.constexpr, ALIGN: tl.constexpr, STAGES: tl.constexpr,
    HINTS: tl.constexpr,
):  # fmt: skip
    """Amax item ``item`` of window w (chunk item // WS, strip item % WS of the window), then
    the window's count of finished amax items up by one (release: after its atomic maxes)."""
    b = w // wpb
    s = w % wpb * WS + item % WS
    if s < n_strips:
        o = s * BO + tl.arange(0, BO)
        lo = item // WS * BLA
        _amax_tile(
            _batch(x_ptr, b, sxb, INT64), _batch_table(ws_ptr, b, n_groups, n_other, INT64),
            o, o < n_other, lo, tl.minimum(lo + BLA, extent), gi, valid, starts, ends, n_other,
            sxo, sxg, SOFT, INT64, BO, SUB, ALIGN, STAGES, HINTS,
        )  # fmt: skip
    tl.debug_barrier()  # every thread's atomic maxes issued before the count goes up
    tl.atomic_add(sync_ptr + LINE * (1 + w), 1, sem="release")


@triton.jit
def _window_cast(
    x_ptr, data_ptr, ws_ptr, scale_ptr, sync_ptr, w, item, wpb, n_amax, x_chunks, gi, valid,
    starts, ends, p, r, n_other, n_groups, dest_extent, n_strips, sxb, sxo, sxg, sdb, sdo, sdg,
    ROUND_POW2: tl.constexpr, SOFT: tl.constexpr, INT64: tl.constexpr, BO: tl.constexpr,
    BLX: tl.constexpr, SUB: tl.constexpr, WS: tl.constexpr, ALIGN: tl.constexpr,
    STAGES: tl.constexpr, INVERSE: tl.constexpr, HINTS: tl.constexpr,
):  # fmt: skip
    """Cast item ``item`` of window w, once its n_amax amax items are done."""
    b = w // wpb
    s = w % wpb * WS + item % WS
    if s < n_strips:
        done = tl.atomic_add(sync_ptr + LINE * (1 + w), 0, sem="acquire")
        while done < n_amax:
            done = tl.atomic_add(sync_ptr + LINE * (1 + w), 0, sem="acquire")
        tl.debug_barrier()  # (the workspace reads below come after the acquire)
        o = s * BO + tl.arange(0, BO)
        _cast_tile(
            _batch(x_ptr, b, sxb, INT64), _batch(data_ptr, b, sdb, INT64),
            _batch_table(ws_ptr, b, n_groups, n_other, INT64),
            _batch_table(scale_ptr, b, n_groups, n_other, INT64), o, o < n_other,
            item // WS, x_chunks, gi, valid, starts, ends, p, r, n_other, dest_extent,
            sxo, sxg, sdo, sdg, ROUND_POW2, SOFT, INT64, BLX, SUB, ALIGN, STAGES, INVERSE,
            HINTS,
        )  # fmt: skip


@triton.jit
def _window_kernel(
    x_ptr, offs_ptr, ws_ptr, sync_ptr, scale_ptr, data_ptr, pad_ptr, n_other, extent,
    n_groups, dest_extent, sxb, sxo, sxg, sdb, sdo, sdg, n_strips, wpb, n_windows, a_chunks,
    x_chunks, lookahead, grab,
    ROUND_POW2: tl.constexpr, SOFT: tl.constexpr, INT64: tl.constexpr, PAD: tl.constexpr,
    BO: tl.constexpr, BLA: tl.constexpr, BLX: tl.constexpr, SUB: tl.constexpr,
    BG: tl.constexpr, WS: tl.constexpr, ALIGN_X: tl.constexpr, ALIGN_D: tl.constexpr,
    STAGES: tl.constexpr, INVERSE: tl.constexpr, HINTS: tl.constexpr,
):  # fmt: skip
    """ws: int32 [batch, n_groups, n_other], zeroed (the amax bits); sync: int32 [LINE * (1 +
    n_windows)], zeroed: the ticket counter at 0, window w's count of finished amax items at
    LINE * (1 + w) (each counter in a 128-byte line of its own, as L2 serializes the atomics
    of a line); data,
    scale, pad as in kernels_colwise._cast_kernel. wpb: windows per batch entry
    (cdiv(n_strips, WS)), n_windows = batch * wpb; a_chunks = cdiv(extent, BLA), x_chunks =
    cdiv(dest_extent, BLX). Any 1-D grid: the programs take tickets until none are left.
    ALIGN_X / ALIGN_D: 16 where the group axis is contiguous in x / in the data. HINTS: L2
    eviction hints (amax reads kept, cast reads and data writes first out)."""
    gi, valid, starts, ends = group_bounds(offs_ptr, n_groups, extent, BG)
    p, r = _destinations(gi, valid, starts, ends, n_groups, dest_extent, PAD)
    if PAD:
        tl.store(pad_ptr + gi, r, mask=gi < tl.where(tl.program_id(0) == 0, n_groups, 0))
    n_amax = a_chunks * WS
    step = n_amax + x_chunks * WS  # the slots of one step: window k's amax, k - L's cast
    n_slots = (n_windows + lookahead) * step
    u = tl.atomic_add(sync_ptr, grab, sem="relaxed")
    while u < n_slots:
        for v in range(u, tl.minimum(u + grab, n_slots)):
            k = v // step
            item = v % step
            if item < n_amax:
                if k < n_windows:
                    _window_amax(
                        x_ptr, ws_ptr, sync_ptr, k, item, wpb, gi, valid, starts, ends,
                        n_other, extent, n_groups, n_strips, sxb, sxo, sxg,
                        SOFT, INT64, BO, BLA, SUB, WS, ALIGN_X, STAGES, HINTS,
                    )  # fmt: skip
            elif k >= lookahead:
                _window_cast(
                    x_ptr, data_ptr, ws_ptr, scale_ptr, sync_ptr, k - lookahead, item - n_amax,
                    wpb, n_amax, x_chunks, gi, valid, starts, ends, p, r, n_other, n_groups,
                    dest_extent, n_strips, sxb, sxo, sxg, sdb, sdo, sdg,
                    ROUND_POW2, SOFT, INT64, BO, BLX, SUB, WS, ALIGN_D, STAGES, INVERSE, HINTS,
                )  # fmt: skip
        u = tl.atomic_add(sync_ptr, grab, sem="relaxed")
