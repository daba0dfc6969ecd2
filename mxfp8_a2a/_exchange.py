"""How the MXFP8 exchange moves rows: one collective, or a pipeline of point-to-point steps.

Both paths send only the rows that leave the rank, packed (uint8 rows [K e4m3 bytes | K/32
scale bytes]); the rows a rank keeps go through the round-trip kernel straight into their
place in the output while the others are on the wire. Results are bit for bit
dequantize(quantize(row)) for every row, whichever path runs.

- :func:`exchange_single` (chunks=1): quantize the outgoing rows, start one all_to_all_single
  (self split 0), round-trip the kept rows meanwhile, wait, dequantize.
- :func:`exchange_pipelined` (chunks > 1 or None): the outgoing rows of each (sender,
  receiver) pair are cut into chunks; step by step (peers in ring order: send to rank + j,
  receive from rank - j) one chunk is quantized, sent with one batch of isend/irecv, and
  dequantized on a side stream while the next is quantized and sent. Every chunk is a
  contiguous range of rows, so each step is one kernel each way and no tables.

On CPU (gloo) the same steps run with the torch references in place of the kernels.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch
import torch.distributed as dist

from . import _config
from ._common import BLOCK
from .dequantize import _launch as _dequantize_launch
from .dequantize import dequantize_reference
from .packing import pack, packed_row_bytes, unpack
from .quantize import _launch as _quantize_launch
from .quantize import quantize_reference
from .roundtrip import _launch as _roundtrip_launch
from .roundtrip import quantize_dequantize_reference

# ---------------------------------------------------------------------------- casts


def _quantize_into(x, buf, mode, gap=(0, 0), programs=None) -> None:
    """buf (uint8 [M - gap[1], K + K/32]) <- packed rows of x [M, K], rows [at, at + n) cut."""
    k = x.shape[1]
    if x.device.type == "cuda":
        row = buf.stride(0)
        _quantize_launch(x, buf, buf[:, k:], row, row, mode, gap, programs)
        return
    at, n = gap
    rows = torch.cat([x[:at], x[at + n :]]) if n else x
    buf.copy_(pack(*quantize_reference(rows, mode)))


def _dequantize_into(buf, out, gap=(0, 0), programs=None) -> None:
    """out [M, K] rows outside [at, at + n) <- dequantized packed rows buf, in order."""
    if out.device.type == "cuda":
        row = buf.stride(0)
        _dequantize_launch(buf, buf[:, out.shape[1] :], row, row, out, gap, programs)
        return
    at, n = gap
    y = dequantize_reference(*unpack(buf), out.dtype)
    out[:at] = y[:at]
    out[at + n :] = y[at:]


def _roundtrip_into(x, out, mode, programs=None) -> None:
    """out [n, K] <- dequantize(quantize(x [n, K])) in out's dtype (x's), with the launch
    configuration for casts beside a collective (BESIDE_COMM_* in _config.py)."""
    if x.device.type == "cuda":
        block_g, warps = _config.BESIDE_COMM_BLOCK_G, _config.BESIDE_COMM_NUM_WARPS
        _roundtrip_launch(x, out, mode, programs, block_g, warps)
    else:
        out.copy_(quantize_dequantize_reference(x, mode))


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _cast_programs(device: torch.device) -> int | None:
    """Grid cap for casts that run beside communication kernels (None: no cap)."""
    if device.type != "cuda":
        return None
    return max(_sm_count(device) - _config.BESIDE_COMM_FREE_SMS, 1)


def _all_to_all(out, inp, out_splits, in_splits, group) -> dist.Work:
    """Asynchronous all_to_all_single through the process group itself: the Python wrapper
    (argument checks, logging) costs host time that small exchanges cannot spare."""
    pg = group if group is not None else dist.group.WORLD
    opts = dist.AllToAllOptions()
    opts.asyncOp = True
    return pg.alltoall_base(out, inp, out_splits, in_splits, opts)


def keeps_local(n: int, k: int, device: torch.device) -> bool:
    """Whether the n rows a rank sends itself skip the wire (always on CPU; on CUDA when
    there are enough of them to repay the extra kernel launch)."""
    return n > 0 and (device.type != "cuda" or n * k >= _config.KEEP_LOCAL_MIN_ELEMENTS)


def _buffers(x, output_splits, n):
    """out [sum(output_splits), K] in x's dtype, and the packed send and receive buffers
    (uint8 rows): the outgoing (incoming) rows in x (out) order, the n kept ones cut."""
    row = packed_row_bytes(x.shape[1])
    out = x.new_empty((sum(output_splits), x.shape[1]))
    send = torch.empty((x.shape[0] - n, row), dtype=torch.uint8, device=x.device)
    recv = torch.empty((out.shape[0] - n, row), dtype=torch.uint8, device=x.device)
    return out, send, recv


# ---------------------------------------------------------------------------- collectives


def column_cuts(k: int, chunks: int) -> list[tuple[int, int]]:
    """min(chunks, K/32) (first column, columns) pieces of K columns, widths multiples of 32
    (a scale block never straddles two pieces)."""
    nb = k // BLOCK
    c = max(1, min(chunks, nb))
    return [(BLOCK * (nb * i // c), BLOCK * (nb * (i + 1) // c - nb * i // c)) for i in range(c)]


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
    """
    rank = dist.get_rank(group)
    x_at, o_at = sum(input_splits[:rank]), sum(output_splits[:rank])
    n = input_splits[rank] if keeps_local(input_splits[rank], x.shape[1], x.device) else 0
    out, send, recv = _buffers(x, output_splits, n)
    send_splits, recv_splits = list(input_splits), list(output_splits)
    send_splits[rank] -= n
    recv_splits[rank] -= n
    cuts = column_cuts(x.shape[1], chunks)
    beside = _cast_programs(x.device)
    send_flat, recv_flat = send.view(-1), recv.view(-1)
    pieces, at_s, at_r = [], 0, 0
    for i, (c0, w) in enumerate(cuts):
        row = packed_row_bytes(w)
        s = send_flat[at_s : at_s + send.shape[0] * row].view(send.shape[0], row)
        r = recv_flat[at_r : at_r + recv.shape[0] * row].view(recv.shape[0], row)
        at_s, at_r = at_s + s.numel(), at_r + r.numel()
        _quantize_into(x[:, c0 : c0 + w], s, mode, (x_at, n), None if i == 0 else beside)
        pieces.append((_all_to_all(r, s, recv_splits, send_splits, group), r, c0, w))
    if n:
        _roundtrip_into(x[x_at : x_at + n], out[o_at : o_at + n], mode, beside)
    for i, (work, r, c0, w) in enumerate(pieces):
        work.wait()
        last = i == len(pieces) - 1
        _dequantize_into(r, out[:, c0 : c0 + w], (o_at, n), None if last else beside)
    return out


# ---------------------------------------------------------------------------- pipelined


def pair_chunks(rows: int, row_bytes: int, chunks: int | None) -> int:
    """Chunks for a pair exchanging ``rows`` rows; ``chunks`` overrides the automatic count."""
    if rows == 0:
        return 0
    if chunks is None:
        chunks = min(_config.PIPELINE_MAX_CHUNKS, rows * row_bytes // _config.PIPELINE_CHUNK_BYTES)
    return max(1, min(chunks, rows))


def _cuts(start: int, rows: int, c: int) -> list[tuple[int, int]]:
    """c contiguous (first row, rows) pieces of rows [start, start + rows)."""
    return [(start + rows * i // c, rows * (i + 1) // c - rows * i // c) for i in range(c)]


def make_plan(
    in_splits: list[int], out_splits: list[int], rank: int, row_bytes: int, chunks: int | None
) -> list[tuple[tuple[int, int, int] | None, tuple[int, int, int] | None]]:
    """Steps of the pipeline: (send, recv), each None or (peer, first row, rows), rows of x
    for a send and of the output for a receive. Stage j = 1 .. world-1 sends to rank + j and
    receives from rank - j; a pair's rows are cut into pair_chunks pieces, which both ends
    compute from the same count, so every send meets its receive in the same step."""
    world = len(in_splits)
    x_start = [sum(in_splits[:r]) for r in range(world)]
    o_start = [sum(out_splits[:r]) for r in range(world)]
    steps = []
    for j in range(1, world):
        dst, src = (rank + j) % world, (rank - j) % world
        sends = _cuts(x_start[dst], in_splits[dst], pair_chunks(in_splits[dst], row_bytes, chunks))
        recvs = _cuts(
            o_start[src], out_splits[src], pair_chunks(out_splits[src], row_bytes, chunks)
        )
        for i in range(max(len(sends), len(recvs))):
            s = (dst, *sends[i]) if i < len(sends) else None
            r = (src, *recvs[i]) if i < len(recvs) else None
            steps.append((s, r))
    return steps


def exchange_pipelined(
    x: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None,
    mode: str,
    chunks: int | None,
) -> torch.Tensor:
    """x [T, K] -> [sum(output_splits), K] through the steps of :func:`make_plan`."""
    rank = dist.get_rank(group)
    x_at, o_at, n = sum(input_splits[:rank]), sum(output_splits[:rank]), input_splits[rank]
    out, send, recv = _buffers(x, output_splits, n)
    cuda = x.device.type == "cuda"
    main = torch.cuda.current_stream(x.device) if cuda else None
    side = _side_stream(x.device) if cuda else None
    on_side = (lambda: torch.cuda.stream(side)) if cuda else nullcontext
    programs = _cast_programs(x.device)
    if cuda:
        side.wait_stream(main)  # out, send, recv may reuse memory main's pending work used
    with on_side():  # kept rows: beside the whole pipeline
        _roundtrip_into(x[x_at : x_at + n], out[o_at : o_at + n], mode, programs)

    def peer(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    row = send.shape[1]
    for s, r in make_plan(input_splits, output_splits, rank, row, chunks):
        ops, arrived = [], None
        if s is not None:
            dst, lo, rows = s
            b = lo if lo < x_at else lo - n
            _quantize_into(x[lo : lo + rows], send[b : b + rows], mode, programs=programs)
            ops.append(dist.P2POp(dist.isend, send[b : b + rows], peer(dst), group))
        if r is not None:
            src, lo, rows = r
            b = lo if lo < o_at else lo - n
            arrived = (recv[b : b + rows], out[lo : lo + rows])
            ops.append(dist.P2POp(dist.irecv, arrived[0], peer(src), group))
        works = dist.batch_isend_irecv(ops)
        with on_side():
            for w in works:
                w.wait()
            if arrived is not None:
                _dequantize_into(*arrived, programs=programs)
    if cuda:
        main.wait_stream(side)
    return out
