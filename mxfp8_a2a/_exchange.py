"""How the MXFP8 exchange moves rows: one all_to_all_single per column piece.

Only the rows that leave the rank go on the wire, packed (uint8 rows [w e4m3 bytes | w/32
scale bytes | padding to 16 bytes] for a piece of w columns); the rows a rank keeps go
through the round-trip kernel straight into their place in the output while the others are
on the wire. Results are bit for bit dequantize(quantize(row)) for every row, whatever the
number of pieces.

With several pieces the collective of piece i runs while piece i + 1 is quantized and piece
i - 1 dequantized. On CPU (gloo) the same steps run with the torch references in place of
the kernels.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from . import _config
from ._common import BLOCK, sm_count
from ._fast_launch import Replay, hooks_active, recording
from .dequantize import _launch as _dequantize_launch
from .dequantize import dequantize_reference
from .packing import pack, packed_row_bytes, unpack
from .quantize import _launch as _quantize_launch
from .quantize import quantize_reference
from .roundtrip import _launch as _roundtrip_launch
from .roundtrip import quantize_dequantize_reference

# ---------------------------------------------------------------------------- casts


def _beside(programs: int | None) -> tuple[int | None, int | None]:
    """(block_g, num_warps) of a cast capped at ``programs`` beside a collective (None: the
    casts' own configuration)."""
    if programs is None:
        return None, None
    return _config.BESIDE_COMM_BLOCK_G, _config.BESIDE_COMM_NUM_WARPS


def _quantize_into(x, buf, mode, gap=(0, 0), programs=None) -> None:
    """buf (uint8 [M - gap[1], >= K + K/32]) <- packed rows of x [M, K], rows [at, at + n) cut;
    programs: None, or the grid cap of a cast beside a collective."""
    k = x.shape[1]
    if x.device.type == "cuda":
        row = buf.stride(0)
        _quantize_launch(x, buf, buf[:, k:], row, row, mode, gap, programs, *_beside(programs))
        return
    at, n = gap
    rows = torch.cat([x[:at], x[at + n :]]) if n else x
    buf[:, : packed_row_bytes(k)].copy_(pack(*quantize_reference(rows, mode)))


def _dequantize_into(buf, out, gap=(0, 0), programs=None) -> None:
    """out [M, K] rows outside [at, at + n) <- dequantized packed rows buf, in order."""
    if out.device.type == "cuda":
        row, k = buf.stride(0), out.shape[1]
        _dequantize_launch(buf, buf[:, k:], row, row, out, gap, programs, *_beside(programs))
        return
    at, n = gap
    y = dequantize_reference(*unpack(buf[:, : packed_row_bytes(out.shape[1])]), out.dtype)
    out[:at] = y[:at]
    out[at + n :] = y[at:]


def _roundtrip_into(x, out, mode, programs=None) -> None:
    """out [n, K] <- dequantize(quantize(x [n, K])) in out's dtype (x's), with the launch
    configuration for casts beside a collective (BESIDE_COMM_* in _config.py)."""
    if x.device.type == "cuda":
        _roundtrip_launch(x, out, mode, programs, *_beside(programs))
    else:
        out.copy_(quantize_dequantize_reference(x, mode))


def _cast_programs(device: torch.device) -> int | None:
    """Grid cap for casts that run beside communication kernels (None: no cap)."""
    if device.type != "cuda":
        return None
    return max(sm_count(device) - _config.BESIDE_COMM_FREE_SMS, 1)


def _all_to_all(out, inp, out_splits, in_splits, group, async_op: bool) -> dist.Work | None:
    """all_to_all_single through the process group itself: the Python wrapper (argument
    checks, logging) costs host time that small exchanges cannot spare.

    async_op=True returns the Work to wait on (NCCL runs it on its own stream, so casts can
    run beside it); False returns None, the collective ordered on the caller's stream (NCCL
    in torch >= 2.8 then launches it there, skipping two cross-stream events and the
    tensors' stashing: less host and GPU latency when nothing runs beside it)."""
    pg = group if group is not None else dist.group.WORLD
    opts = dist.AllToAllOptions()
    opts.asyncOp = async_op
    work = pg.alltoall_base(out, inp, out_splits, in_splits, opts)
    if async_op:
        return work
    if work is not None:  # what all_to_all_single does for a synchronous call
        work.wait()
    return None


def keeps_local(n: int, k: int, device: torch.device) -> bool:
    """Whether the n rows a rank sends itself skip the wire (always on CPU; on CUDA when
    there are enough of them to repay the extra kernel launch)."""
    return n > 0 and (device.type != "cuda" or n * k >= _config.KEEP_LOCAL_MIN_ELEMENTS)


def _wire_row(w: int) -> int:
    """Bytes of a packed row of w columns on the wire, padded to 16 so that every row starts
    16-byte aligned (the kernels then move 16 bytes per access)."""
    return -(-packed_row_bytes(w) // 16) * 16


def auto_chunks(peak_rows: int, k: int) -> int:
    """Column pieces for an exchange whose busiest rank sends or receives peak_rows rows of
    K columns: about PIPELINE_CHUNK_BYTES of wire bytes per piece, at most
    PIPELINE_MAX_CHUNKS, 1 for small messages. Every rank must use the same count."""
    wire = peak_rows * packed_row_bytes(k)
    return max(1, min(_config.PIPELINE_MAX_CHUNKS, wire // _config.PIPELINE_CHUNK_BYTES))


# ---------------------------------------------------------------------------- collectives


def column_cuts(k: int, chunks: int) -> list[tuple[int, int]]:
    """min(chunks, K/32) (first column, columns) pieces of K columns, widths multiples of 32
    (a scale block never straddles two pieces)."""
    nb = k // BLOCK
    c = max(1, min(chunks, nb))
    return [(BLOCK * (nb * i // c), BLOCK * (nb * (i + 1) // c - nb * i // c)) for i in range(c)]


class _Plan:
    """A one-piece CUDA exchange for one (shape, splits, rank) recorded once and replayed:
    the buffer shapes, the wire splits, and the launches before the collective (quantize),
    beside it (the kept rows' round trip) and after it (dequantize), as Replays on the
    bases (x, out, send, recv)."""

    def __init__(self, shapes, splits, phases, async_op: bool) -> None:
        self.shapes, self.splits, self.phases, self.async_op = shapes, splits, phases, async_op

    def __call__(self, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor | None:
        """The exchange of x, or None (nothing launched) when a fresh buffer is not 16-byte
        aligned as recorded."""
        out_shape, send_shape, recv_shape = self.shapes
        out = x.new_empty(out_shape)
        send = torch.empty(send_shape, dtype=torch.uint8, device=x.device)
        recv = torch.empty(recv_shape, dtype=torch.uint8, device=x.device)
        addresses = (x.data_ptr(), out.data_ptr(), send.data_ptr(), recv.data_ptr())
        if (addresses[1] | addresses[2] | addresses[3]) % 16:
            return None
        quantize, beside, dequantize = self.phases
        index = x.device.index
        quantize(addresses, index)
        work = _all_to_all(recv, send, *self.splits, group, self.async_op)
        beside(addresses, index)
        if work is not None:
            work.wait()
        dequantize(addresses, index)
        return out


# (shape, strides, dtype, address % 16, device, splits, rank, mode) -> _Plan; keys seen once
_PLANS: dict[tuple, _Plan] = {}
_SEEN: set[tuple] = set()


def _plan_key(x, output_splits, input_splits, rank, mode) -> tuple | None:
    """The key of a one-piece CUDA exchange's plan (None: no plan: CPU, or launch hooks)."""
    if x.device.type != "cuda" or hooks_active():
        return None
    return (
        x.shape, x.stride(), x.dtype, x.data_ptr() % 16, x.device.index,
        tuple(output_splits), tuple(input_splits), rank, mode,
    )  # fmt: skip


def exchange_columns(
    x: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None,
    mode: str,
    chunks: int = 1,
) -> torch.Tensor:
    """x [T, K] -> [sum(output_splits), K]: one all_to_all_single of the outgoing rows per
    column piece (:func:`column_cuts`).

    Each piece is quantized (packed rows of its own width), sent with the rank's splits and
    dequantized into its columns; the collective of piece i runs while piece i + 1 is
    quantized and piece i - 1 dequantized (casts beside a collective leave SMs free for it,
    see _config.py). The kept rows' round trip runs after the last quantize, beside the
    collectives. Every rank must pass the same ``chunks`` (one collective per piece).

    On CUDA with one piece, the second call with the same shape, strides, splits and rank
    records its launches and later ones replay them (:class:`_Plan`): the same kernels with
    the same arguments on the new tensors, at a fraction of the host time.
    """
    rank = dist.get_rank(group)
    key = _plan_key(x, output_splits, input_splits, rank, mode) if chunks == 1 else None
    plan = _PLANS.get(key) if key is not None else None
    if plan is not None:
        out = plan(x, group)
        if out is not None:
            return out
    record = False
    if key is not None and plan is None:
        record = key in _SEEN  # the second call with a key records its launches
        if not record:
            if len(_SEEN) >= _config.PLAN_CACHE_SIZE * 4:
                _SEEN.clear()
            _SEEN.add(key)
    x_at, o_at = sum(input_splits[:rank]), sum(output_splits[:rank])
    n = input_splits[rank] if keeps_local(input_splits[rank], x.shape[1], x.device) else 0
    out = x.new_empty((sum(output_splits), x.shape[1]))
    n_send, n_recv = x.shape[0] - n, out.shape[0] - n
    send_splits, recv_splits = list(input_splits), list(output_splits)
    send_splits[rank] -= n
    recv_splits[rank] -= n
    cuts = column_cuts(x.shape[1], chunks)
    wire = sum(_wire_row(w) for _, w in cuts)
    # one piece: the buffers are its [rows, wire] tensors (fewer views, less host time)
    send = torch.empty((n_send, wire), dtype=torch.uint8, device=x.device)
    recv = torch.empty((n_recv, wire), dtype=torch.uint8, device=x.device)
    beside = _cast_programs(x.device)
    # the collective runs asynchronously only when casts run beside it
    async_op = len(cuts) > 1 or n > 0

    def columns(t: torch.Tensor, c0: int, w: int) -> torch.Tensor:
        return t if w == t.shape[1] else t[:, c0 : c0 + w]

    def piece(buf: torch.Tensor, at: int, rows: int, row: int) -> torch.Tensor:
        if row == wire:
            return buf
        return buf.view(-1)[at : at + rows * row].view(rows, row)

    def phase():
        return recording() if record else contextlib.nullcontext([])

    pieces, at_s, at_r = [], 0, 0
    with phase() as quantized:
        for i, (c0, w) in enumerate(cuts):
            row = _wire_row(w)
            s, r = piece(send, at_s, n_send, row), piece(recv, at_r, n_recv, row)
            at_s, at_r = at_s + n_send * row, at_r + n_recv * row
            _quantize_into(columns(x, c0, w), s, mode, (x_at, n), None if i == 0 else beside)
            work = _all_to_all(r, s, recv_splits, send_splits, group, async_op)
            pieces.append((work, r, c0, w))
    with phase() as kept:
        if n:
            _roundtrip_into(x[x_at : x_at + n], out[o_at : o_at + n], mode, beside)
    with phase() as dequantized:
        for i, (work, r, c0, w) in enumerate(pieces):
            if work is not None:
                work.wait()
            last = i == len(pieces) - 1
            _dequantize_into(r, columns(out, c0, w), (o_at, n), None if last else beside)
    if record:
        bases = (x, out, send, recv)
        phases = [Replay.build(launches, bases) for launches in (quantized, kept, dequantized)]
        if None not in phases:
            if len(_PLANS) >= _config.PLAN_CACHE_SIZE:
                _PLANS.clear()
            shapes = (tuple(out.shape), tuple(send.shape), tuple(recv.shape))
            _PLANS[key] = _Plan(shapes, (recv_splits, send_splits), phases, async_op)
    return out
