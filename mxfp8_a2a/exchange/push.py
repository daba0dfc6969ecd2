"""Rows pushed into their destination's receive buffer: the building blocks of a
device-driven exchange (no host read of the splits).

Every rank holds the same counts matrix ``counts`` int [W, W] on its device: counts[s, d]
rows go from rank s to rank d (on GPUs of one node, each rank writes its row of it into
every peer's symmetric memory; in tests, W emulated ranks share one). Rank d's receive
buffer is uint8 [capacity, wire_row(K)] (rows.py's wire rows), holding source s's rows at
rows [start[s, d], start[s, d] + counts[s, d]), start[s, d] = the sum of counts[s', d] over
s' < s: source-major, the order of all_to_all_single's output.

- :func:`receive_plan`: start, rows received and overflow flags from ``counts``, on the
  device.
- :func:`push_rows`: one kernel reads each row of a rank's x once, MXFP8-quantizes it (the
  bits of quantize_packed) and stores the wire row straight into its destination's buffer,
  addressed through a table of the W buffers' addresses. Rows that would land at or past
  ``capacity`` are not written (the plan's overflow flag says so; nothing is corrupted).
- :func:`unpack_received`: a buffer's rows in x's dtype, rows from the received count on
  zero (never the buffer's unwritten bytes), and that count clipped to the capacity.

What a transport adds on GPUs is the ordering between them: the pushes' stores must be
visible to the receiver before it reads (a system-scope release after a rank's last store,
an acquire before the receiver's first read, e.g. a symmetric-memory barrier), and a buffer
may be written again only after its receiver has read it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _config
from .._common import (
    BLOCK,
    block_count,
    cdiv,
    check_e4m3_gpu,
    check_scaling_mode,
    hw_e8m0,
    next_pow2,
)
from ..formats.bits import block_tile, mx_quantize_blocks, to_fp32
from ..formats.packing import pack
from ..formats.quantize import quantize_reference
from .rows import dequantize_into, wire_row


def receive_plan(
    counts: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From counts int [W, W] (counts[s, d]: rows rank s sends to rank d), on its device,
    without a host read: start int64 [W, W] (where source s's rows begin in rank d's
    buffer), received int64 [W] (rows rank d receives, unclipped) and overflow bool [W]
    (received > capacity)."""
    if counts.dim() != 2 or counts.shape[0] != counts.shape[1]:
        raise ValueError(f"counts must be a square [W, W] tensor, got shape {tuple(counts.shape)}")
    if counts.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"counts must be int32 or int64, got {counts.dtype}")
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    c = counts.to(torch.int64)
    received = c.sum(0)
    return c.cumsum(0) - c, received, received > capacity


@triton.jit
def _push_kernel(
    x_ptr,  # bf16/fp32 [M, K], strides (stride_xm, stride_xk), rows grouped by destination
    table_ptr,  # int64 [W]: address of each destination's receive buffer
    begin_ptr,  # int64 [W]: first row of x for each destination (exclusive cumsum of count)
    count_ptr,  # int64 [W]: rows of x for each destination
    start_ptr,  # int64 [W]: where they begin in the destination's buffer
    n_groups,  # M * K // 32
    groups_per_row,  # K // 32
    n_dest,  # W
    stride_xm,
    stride_xk,
    row_bytes,  # wire row bytes
    capacity,  # rows per receive buffer
    k,  # K
    RCEIL: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BW: tl.constexpr,  # next power of two >= W
    SOFT: tl.constexpr,
    HW_E8M0: tl.constexpr,
):
    """Each program: BLOCK_G blocks of 32 of x, quantized and stored at their row's place in
    its destination's buffer (int64 offsets there: a buffer may pass 2**31 bytes)."""
    tile = tl.program_id(0)
    gmask, row, cg = block_tile(tile, BLOCK_G, n_groups, groups_per_row)
    row = row.to(tl.int64)
    # destination of each row: the last one whose segment begins at or before it (empty
    # segments begin where the next one does, so the last is the one that holds the row)
    wi = tl.arange(0, BW)
    begins = tl.load(begin_ptr + wi, mask=wi < n_dest, other=0)
    at_or_before = (begins[None, :] <= row[:, None]) & (wi < n_dest)[None, :]
    d = tl.sum(at_or_before.to(tl.int32), axis=1) - 1
    d = tl.maximum(d, 0)
    local = row - tl.load(begin_ptr + d, mask=gmask, other=0)
    dest_row = tl.load(start_ptr + d, mask=gmask, other=0) + local
    # (the bounds also hold for bad counts, e.g. negative ones: nothing lands outside a buffer)
    in_segment = (local >= 0) & (local < tl.load(count_ptr + d, mask=gmask, other=0))
    ok = gmask & in_segment & (dest_row >= 0) & (dest_row < capacity)
    col = cg[:, None] * 32 + tl.arange(0, 32)[None, :]
    x_at = row[:, None] * stride_xm + col.to(tl.int64) * stride_xk  # may pass 2**31
    x = tl.load(x_ptr + x_at, mask=gmask[:, None])
    q, b = mx_quantize_blocks(to_fp32(x, SOFT), RCEIL, HW_E8M0, SOFT)
    base = tl.load(table_ptr + d, mask=ok, other=0).to(tl.pointer_type(tl.uint8))
    # buffers and wire rows are 16-byte aligned (rows.py): say so, so that stores are vectors
    dest = tl.multiple_of(base + dest_row * row_bytes, 16)
    tl.store(dest[:, None] + col, q, mask=ok[:, None])
    tl.store(dest + k + cg, b.to(tl.uint8), mask=ok)


def _check_push(x: torch.Tensor, table: torch.Tensor, count: torch.Tensor, start: torch.Tensor):
    if x.dim() != 2 or x.shape[1] % BLOCK != 0:
        raise ValueError(f"x must be [M, K] with K a multiple of {BLOCK}, got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"x must be bfloat16 or float32, got {x.dtype}")
    w = table.numel()
    for name, t in (("table", table), ("count", count), ("start", start)):
        if t.shape != (w,) or t.dtype != torch.int64 or t.device != x.device:
            raise ValueError(
                f"{name} must be an int64 [W={w}] tensor on {x.device}, got "
                f"{t.dtype} {tuple(t.shape)} on {t.device}"
            )


def push_rows(
    x: torch.Tensor,
    table: torch.Tensor,
    count: torch.Tensor,
    start: torch.Tensor,
    capacity: int,
    scaling_mode: str = "rceil",
) -> None:
    """Quantize the rows of x and store them into the receive buffers.

    x: bf16/fp32 [M, K] (K % 32 == 0), rows grouped by destination, any strides; table:
    int64 [W], the address of each destination's buffer (uint8 [capacity, wire_row(K)],
    16-byte aligned: the kernel stores 16 bytes at a time); count: int64 [W], this rank's
    row of the counts matrix; start: int64 [W], its row of receive_plan's start. All on
    x's device; nothing is read on the host. Rows past sum(count) and rows that would land
    at or past ``capacity`` are not written. Returns once the kernel is queued on the
    current stream.
    """
    check_scaling_mode(scaling_mode)
    _check_push(x, table, count, start)
    m, k = x.shape
    n_groups = block_count(m, k, "x")
    if n_groups == 0 or table.numel() == 0:
        return
    check_e4m3_gpu(x.device)
    soft = x.device.type == "cpu"
    block_g = _config.INTERPRET_BLOCK_G if soft else _config.QUANTIZE_BLOCK_G
    begin = count.cumsum(0) - count
    _push_kernel[(cdiv(n_groups, block_g),)](
        x, table, begin, count, start, n_groups, k // BLOCK, table.numel(),
        x.stride(0), x.stride(1), wire_row(k), capacity, k,
        RCEIL=scaling_mode == "rceil", BLOCK_G=block_g,
        BW=max(2, next_pow2(table.numel())), SOFT=soft,
        HW_E8M0=hw_e8m0(x.device),
        num_warps=_config.QUANTIZE_NUM_WARPS,
    )  # fmt: skip


def unpack_received(
    buf: torch.Tensor, received: torch.Tensor, k: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """buf: uint8 [capacity, wire_row(k)], a receive buffer; received: int64 [] (rows sent
    to it, receive_plan's entry). Returns (rows [capacity, k] in ``dtype``, zeros from the
    received count on; n int64 [] = min(received, capacity)), without a host read."""
    capacity = buf.shape[0]
    if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] < wire_row(k):
        raise ValueError(
            f"buf must be uint8 [capacity, >= {wire_row(k)}], got {buf.dtype} {tuple(buf.shape)}"
        )
    out = torch.empty((capacity, k), dtype=dtype, device=buf.device)
    if capacity:
        dequantize_into(buf, out)
    n = received.clamp(max=capacity)
    unwritten = torch.arange(capacity, device=buf.device) >= n
    return out.masked_fill_(unwritten[:, None], 0), n


def push_reference(
    xs: list[torch.Tensor], counts: torch.Tensor, capacity: int, scaling_mode: str = "rceil"
) -> list[torch.Tensor]:
    """What rank d's buffer holds after every rank s pushed xs[s] (rows grouped by
    destination as counts[s] says): packed rows uint8 [min(received, capacity),
    packed_row_bytes(K)], source-major, for each d (plain torch)."""
    c = counts.to(torch.int64).cpu()
    w = c.shape[0]
    segments: list[list[torch.Tensor]] = [[] for _ in range(w)]
    for s, x in enumerate(xs):
        begin = 0
        for d in range(w):
            n = int(c[s, d])
            segments[d].append(x[begin : begin + n])
            begin += n
    out = []
    for d in range(w):
        rows = torch.cat(segments[d])[:capacity] if segments[d] else xs[0][:0]
        out.append(pack(*quantize_reference(rows, scaling_mode)))
    return out
