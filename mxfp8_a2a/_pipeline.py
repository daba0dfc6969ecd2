"""The pipelined MXFP8 exchange: chunked quantize -> point-to-point sends -> dequantize.

Every (sender, receiver) pair splits its rows into ``pair_chunks(rows)`` chunks; both ends
know the pair's row count, so they agree on the chunking without communicating. Step i
quantizes chunk i of every destination with one kernel (rows gathered through a segment
table), sends them with one coalesced batch of isend/irecv, and dequantizes what arrived
with one kernel on a side stream, scattering rows to their place in the output. Rows a rank
sends to itself never touch the wire: they are quantized and dequantized locally. Results
are bit for bit those of the one-collective path.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import _config
from .dequantize import _launch as _dequantize_launch
from .dequantize import dequantize_reference
from .packing import pack, packed_row_bytes, unpack
from .quantize import _launch as _quantize_launch
from .quantize import quantize_reference


def pair_chunks(rows: int, row_bytes: int, chunks: int | None) -> int:
    """Chunks for a pair exchanging ``rows`` rows; ``chunks`` overrides the automatic count."""
    if rows == 0:
        return 0
    if chunks is None:
        chunks = min(_config.PIPELINE_MAX_CHUNKS, rows * row_bytes // _config.PIPELINE_CHUNK_BYTES)
    return max(1, min(chunks, rows))


@dataclass
class Step:
    """One pipeline step: ``(peer, buffer row, rows)`` to send and receive, segment tables."""

    sends: list[tuple[int, int, int]] = field(default_factory=list)
    recvs: list[tuple[int, int, int]] = field(default_factory=list)
    q_segments: tuple[int, int] = (0, 0)  # [start, end) in the table tensor
    d_segments: tuple[int, int] = (0, 0)


@dataclass
class Plan:
    steps: list[Step]
    table: list[int]  # all segment tables, int32
    send_rows: int
    recv_rows: int
    self_rows: tuple[int, int, int]  # (x row, out row, rows)


def _prefix(v: list[int]) -> list[int]:
    out, acc = [], 0
    for n in v:
        out.append(acc)
        acc += n
    return out


def make_plan(
    in_splits: list[int], out_splits: list[int], rank: int, row_bytes: int, chunks: int | None
) -> Plan:
    world = len(in_splits)
    in_start, out_start = _prefix(in_splits), _prefix(out_splits)
    c_send = [
        0 if r == rank else pair_chunks(in_splits[r], row_bytes, chunks) for r in range(world)
    ]
    c_recv = [
        0 if r == rank else pair_chunks(out_splits[r], row_bytes, chunks) for r in range(world)
    ]
    steps, table = [], []
    send_off = recv_off = 0
    for i in range(max(c_send + c_recv, default=0)):
        step = Step()
        for c, splits, start, ops, off in (
            (c_send, in_splits, in_start, step.sends, send_off),
            (c_recv, out_splits, out_start, step.recvs, recv_off),
        ):
            starts, bases, local = [], [], 0
            for peer in range(world):
                if i < c[peer]:
                    lo, hi = splits[peer] * i // c[peer], splits[peer] * (i + 1) // c[peer]
                    ops.append((peer, off + local, hi - lo))
                    starts.append(local)
                    bases.append(start[peer] + lo)
                    local += hi - lo
            seg = (len(table), len(table) + 2 * len(starts))
            table += starts + bases
            if ops is step.sends:
                step.q_segments, send_off = seg, send_off + local
            else:
                step.d_segments, recv_off = seg, recv_off + local
        steps.append(step)
    return Plan(
        steps, table, send_off, recv_off, (in_start[rank], out_start[rank], in_splits[rank])
    )


def _rows(table: torch.Tensor, seg: tuple[int, int], n: int) -> torch.Tensor:
    """Full-tensor row of each of the n chunk rows described by table[seg[0]:seg[1]]."""
    t = table[seg[0] : seg[1]].tolist()
    half = len(t) // 2
    ends = t[1:half] + [n]
    return torch.cat(
        [torch.arange(b, b + e - s) for s, e, b in zip(t[:half], ends, t[half:], strict=True)]
    )


def _quantize_rows(x, buf, table, seg, scaling_mode, programs) -> None:
    """buf (uint8 [n, K + K/32]) <- packed MXFP8 of the rows of x the segments name."""
    k, n = x.shape[1], buf.shape[0]
    if x.device.type == "cuda":
        row = buf.shape[1]
        _quantize_launch(
            x, buf, buf[:, k:], row, row, scaling_mode, n, table[seg[0] : seg[1]], programs
        )
    else:
        buf.copy_(pack(*quantize_reference(x[_rows(table, seg, n)], scaling_mode)))


def _dequantize_rows(buf, out, table, seg, programs) -> None:
    """Rows of out the segments name <- dequantized packed rows buf (uint8 [n, K + K/32])."""
    k, n = out.shape[1], buf.shape[0]
    if out.device.type == "cuda":
        row = buf.shape[1]
        _dequantize_launch(buf, buf[:, k:], row, row, out, n, table[seg[0] : seg[1]], programs)
    else:
        out[_rows(table, seg, n)] = dequantize_reference(*unpack(buf), out.dtype)


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _cast_programs(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(sms - _config.PIPELINE_RESERVED_SMS, 1) * _config.PIPELINE_PROGRAMS_PER_SM


def exchange_pipelined(
    x: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None,
    scaling_mode: str,
    chunks: int | None,
) -> torch.Tensor:
    """Pipelined quantize -> send -> dequantize of x [T, K]; returns [sum(output_splits), K]."""
    rank = dist.get_rank(group)
    k = x.shape[1]
    row = packed_row_bytes(k)
    plan = make_plan(input_splits, output_splits, rank, row, chunks)
    out = x.new_empty((sum(output_splits), k))
    send = torch.empty((plan.send_rows, row), dtype=torch.uint8, device=x.device)
    recv = torch.empty((plan.recv_rows, row), dtype=torch.uint8, device=x.device)
    table = torch.tensor(plan.table, dtype=torch.int32)
    table = table.to(x.device) if x.device.type == "cuda" else table
    cuda = x.device.type == "cuda"
    programs = _cast_programs(x.device)
    main = torch.cuda.current_stream(x.device) if cuda else None
    side = _side_stream(x.device) if cuda else None
    if cuda:
        side.wait_stream(main)  # out/recv/table may reuse memory main's pending work used

    def peer(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    for step in plan.steps:
        if step.sends:
            lo, n = step.sends[0][1], sum(s[2] for s in step.sends)
            _quantize_rows(x, send[lo : lo + n], table, step.q_segments, scaling_mode, programs)
        ops = [dist.P2POp(dist.isend, send[o : o + n], peer(p), group) for p, o, n in step.sends]
        ops += [dist.P2POp(dist.irecv, recv[o : o + n], peer(p), group) for p, o, n in step.recvs]
        works = dist.batch_isend_irecv(ops) if ops else []
        with torch.cuda.stream(side) if cuda else nullcontext():
            for w in works:
                w.wait()
            if step.recvs:
                lo, n = step.recvs[0][1], sum(r[2] for r in step.recvs)
                _dequantize_rows(recv[lo : lo + n], out, table, step.d_segments, programs)
    x_row, out_row, n = plan.self_rows
    if n:  # rows this rank keeps: quantize and dequantize locally, off the wire
        xs, outs = x[x_row : x_row + n], out[out_row : out_row + n]
        if cuda:
            local = torch.empty((n, row), dtype=torch.uint8, device=x.device)
            _quantize_launch(xs, local, local[:, k:], row, row, scaling_mode)
            _dequantize_launch(local, local[:, k:], row, row, outs)
        else:
            outs.copy_(dequantize_reference(*quantize_reference(xs, scaling_mode), out.dtype))
    if cuda:
        main.wait_stream(side)
    return out
