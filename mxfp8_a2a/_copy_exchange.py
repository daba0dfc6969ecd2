"""The copy-engine exchange: packed rows written into the receivers' buffers by DMA copies.

Each rank of the group holds two symmetric-memory allocations (torch.distributed.
_symmetric_memory: CUDA GPUs with peer access, e.g. on NVLink), mapped into every other
rank's address space: a small one for the splits table and one for the rows it receives.
A call, on the caller's stream ("main"), a copy stream and a fence stream:

1. main: quantize the outgoing rows into a local staging tensor (packed rows, all SMs), then
   the kept rows' round trip straight into the output;
2. copy stream, beside the casts, with more than two ranks: every rank writes its splits
   into its table slot, a barrier, every rank reads all slots (the host waits for that only).
   From the table every rank knows where its rows land in each receiver's buffer (after the
   rows of lower ranks) and checks that every receiver expects what its senders send (every
   rank checks the same table, so all raise alike); the row buffers grow collectively when a
   call needs more. With two ranks each knows both counts of its one pair, so nothing is
   gathered and the host never waits: a barrier only tells that the peer has finished
   reading its buffer (the splits are then checked only with ``validate``);
3. copy stream: each receiver's rows go into its buffer with ``Tensor.copy_``
   (cudaMemcpyAsync: the copy engines move the bytes over NVLink and leave the SMs to the
   casts); fence stream: a barrier after them (every rank's rows have arrived);
4. main: dequantize the received rows into the output around the kept rows.

With ``chunks`` = c > 1 the rows of every (sender, receiver) pair are cut into c row ranges;
range i is quantized, copied, fenced by its own barrier and dequantized, so that the copy of
range i runs while range i + 1 is quantized and range i - 1 dequantized.

Reuse: the copy stream starts a call only after everything the caller's stream had queued
before it (the previous call's dequantize included), so a rank's table (or, with two ranks,
first) barrier of call n + 1 passes only when every rank has finished reading its buffer in
call n, and one row buffer
suffices; table slots alternate between two halves (a slot is rewritten two calls later,
after a table barrier that every reader of it has passed). Every rank must make the same
sequence of exchange calls (as for any collective).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from . import _config
from ._exchange import _dequantize_into, _quantize_into, _roundtrip_into, _wire_row


def _symm_mem():
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:  # pragma: no cover - depends on the torch build
        raise RuntimeError(
            "transport='copy_engine' needs torch.distributed._symmetric_memory (a CUDA build "
            "of torch); use transport='nccl'"
        ) from e
    return symm_mem


class _Region:
    """One symmetric allocation of ``parts`` equal parts for (group, device), grown on
    demand."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, parts: int):
        self.group, self.device, self.parts = group, device, parts
        self.part_bytes, self.buf, self.handle = 0, None, None
        self.views: dict[tuple, torch.Tensor] = {}

    def reserve(self, nbytes: int) -> None:
        """Parts of at least nbytes. Collective when it grows: every rank must ask for the
        same nbytes (the gathered splits table guarantees it)."""
        if nbytes <= self.part_bytes:
            return
        symm_mem = _symm_mem()
        part = max(1 << 20, 1 << (nbytes - 1).bit_length())  # powers of two: few regrowths
        torch.cuda.synchronize(self.device)  # no copy of this rank still targets the old one
        name = self.group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch
            with warnings.catch_warnings():  # deprecated (not needed) in newer ones
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(name)
        try:
            self.buf = symm_mem.empty(self.parts * part, dtype=torch.uint8, device=self.device)
            self.handle = symm_mem.rendezvous(self.buf, name)
        except RuntimeError as e:
            raise RuntimeError(
                "transport='copy_engine' could not map the ranks' buffers into each other "
                "(symmetric memory needs the group's GPUs on one host with peer access); use "
                f"transport='nccl'. The error was: {e}"
            ) from e
        self.part_bytes, self.views = part, {}

    def view(self, rank: int, part: int, shape: tuple[int, ...], dtype) -> torch.Tensor:
        """The start of part ``part`` of ``rank``'s allocation as a tensor (mapped peer
        memory for another rank)."""
        key = (rank, part, shape, dtype)
        if key not in self.views:
            offset = part * self.part_bytes // dtype.itemsize
            self.views[key] = self.handle.get_buffer(rank, shape, dtype, offset)
        return self.views[key]


class _State:
    """Per (group, device): the table and row regions, the side streams, a call counter."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        self.table, self.rows = _Region(group, device, 2), _Region(group, device, 1)
        # high priority, so that the barriers and the table's small kernels find an SM among
        # the casts' programs
        self.copy = torch.cuda.Stream(device, priority=-1)
        self.fence = torch.cuda.Stream(device, priority=-1)
        self.calls = 0


_STATES: dict[tuple[str, int], _State] = {}


def _state(group: dist.ProcessGroup, device: torch.device) -> _State:
    key = (group.group_name, device.index)
    if key not in _STATES:
        _STATES[key] = _State(group, device)
    return _STATES[key]


def _gather_table(st: _State, payload: list[int], rank: int, world: int) -> list[list[int]]:
    """Every rank's payload, through the table region (on the current stream; the host waits
    for this stream only)."""
    st.table.reserve(8 * len(payload) * world)
    half = st.calls % 2
    mine = st.table.view(rank, half, (len(payload),), torch.int64)
    mine.copy_(torch.tensor(payload, dtype=torch.int64))
    st.table.handle.barrier(channel=0)
    slots = [st.table.view(q, half, (len(payload),), torch.int64) for q in range(world)]
    return torch.stack(slots).tolist()


def layout(table: list[list[int]], rank: int) -> tuple[list[int], int]:
    """(first row of this rank's rows in each receiver's buffer, the most rows any rank
    receives from the others), from the gathered table (row q: rank q's input_splits, then
    its output_splits). Raises ValueError, the same on every rank (every rank checks every
    receiver), where what some rank expects disagrees with what another sends it."""
    world = len(table)
    sends = [row[:world] for row in table]
    for dst in range(world):
        for src in range(world):
            if sends[src][dst] != table[dst][world + src]:
                raise ValueError(
                    f"splits disagree: rank {src} sends {sends[src][dst]} rows to rank {dst} "
                    f"but rank {dst} expects {table[dst][world + src]} (its output_splits"
                    f"[{src}]); compute output_splits with compute_output_splits(input_splits)"
                )
    # a receiver's buffer holds the other ranks' rows in rank order (kept rows skip it)
    first = [sum(sends[q][d] for q in range(rank) if q != d) for d in range(world)]
    most = max(sum(sends[q][d] for q in range(world) if q != d) for d in range(world))
    return first, most


def row_ranges(n: int, chunks: int) -> list[tuple[int, int]]:
    """The ``chunks`` (first, end) row ranges of a pair's n rows (sender and receiver cut
    alike: both know n)."""
    return [(n * i // chunks, n * (i + 1) // chunks) for i in range(chunks)]


def auto_ranges(pair_rows: int, k: int) -> int:
    """Row ranges for a copy-engine exchange whose busiest (sender, receiver) pair moves
    pair_rows rows of K columns (COPY_ENGINE_* in _config.py); every rank must use the same."""
    wire = pair_rows * _wire_row(k)
    return max(1, min(_config.COPY_ENGINE_MAX_RANGES, wire // _config.COPY_ENGINE_RANGE_BYTES))


def copy_exchange(
    x: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None,
    mode: str,
    chunks: int = 1,
) -> torch.Tensor:
    """x [T, K] (CUDA, bf16/fp32) -> [sum(output_splits), K] in x's dtype, rows in
    source-rank order, each dequantize(quantize(row)) bit for bit, as the NCCL exchange
    gives them. ``chunks``: row ranges per (sender, receiver) pair, pipelined."""
    pg = group if group is not None else dist.group.WORLD
    rank, world, k, dev = dist.get_rank(pg), dist.get_world_size(pg), x.shape[1], x.device
    st = _state(pg, dev)
    st.calls += 1
    main = torch.cuda.current_stream(dev)
    st.copy.wait_stream(main)  # what the caller queued before this call (see the module doc)
    row = _wire_row(k)
    x_at, o_at, n = sum(input_splits[:rank]), sum(output_splits[:rank]), input_splits[rank]
    out = x.new_empty((sum(output_splits), k))
    staging = torch.empty((x.shape[0] - n, row), dtype=torch.uint8, device=dev)
    x_starts, s_starts = [0], [0]  # first row of each destination in x and in staging
    for d, rows in enumerate(input_splits):
        x_starts.append(x_starts[-1] + rows)
        s_starts.append(s_starts[-1] + (0 if d == rank else rows))
    ranges = [row_ranges(rows, chunks) for rows in input_splits]

    def quantize(i: int) -> torch.cuda.Event:
        for d in range(world):
            a, b = ranges[d][i]
            if d != rank and b > a:
                src = x[x_starts[d] + a : x_starts[d] + b]
                _quantize_into(src, staging[s_starts[d] + a : s_starts[d] + b], mode)
        done = torch.cuda.Event()
        done.record(main)
        return done

    def send(i: int, quantized: torch.cuda.Event, first: list[int]) -> torch.cuda.Event:
        """Range i's copies into the receivers' buffers, then its barrier."""
        st.copy.wait_event(quantized)
        with torch.cuda.stream(st.copy):
            for d in range(world):
                a, b = ranges[d][i]
                if d != rank and b > a:
                    dst = st.rows.view(d, 0, (st.rows.part_bytes // row, row), torch.uint8)
                    dst[first[d] + a : first[d] + b].copy_(
                        staging[s_starts[d] + a : s_starts[d] + b]
                    )
        copied = torch.cuda.Event()
        copied.record(st.copy)
        st.fence.wait_event(copied)
        with torch.cuda.stream(st.fence):
            st.rows.handle.barrier(channel=0)  # range i of every pair has arrived
        arrived = torch.cuda.Event()
        arrived.record(st.fence)
        return arrived

    arrived = []
    if world == 2:  # each rank knows both counts of its one pair: no table
        peer = 1 - rank
        most = max(input_splits[peer], output_splits[peer])
        if most:
            with torch.cuda.stream(st.copy):
                st.rows.reserve(most * row)
                # the peer has finished reading its buffer (its previous call's dequantize)
                st.rows.handle.barrier(channel=1)
            arrived = [send(i, quantize(i), [0, 0]) for i in range(chunks)]
        if n:
            _roundtrip_into(x[x_at : x_at + n], out[o_at : o_at + n], mode)
    else:
        quantized = [quantize(i) for i in range(chunks)]
        if n:
            _roundtrip_into(x[x_at : x_at + n], out[o_at : o_at + n], mode)
        with torch.cuda.stream(st.copy):  # beside the casts
            table = _gather_table(st, [*input_splits, *output_splits, chunks], rank, world)
        if any(t[-1] != chunks for t in table):
            raise ValueError(
                f"chunks differ between ranks: {[t[-1] for t in table]}; every rank must pass "
                "the same chunks"
            )
        first, most = layout([t[:-1] for t in table], rank)
        if most:  # (the same on every rank: every rank sees the same table)
            with torch.cuda.stream(st.copy):
                st.rows.reserve(most * row)
            arrived = [send(i, quantized[i], first) for i in range(chunks)]
    staging.record_stream(st.copy)
    if not arrived:  # no rank sends another a row
        return out
    mine = st.rows.view(rank, 0, (st.rows.part_bytes // row, row), torch.uint8)
    # where each source's rows start in this rank's buffer
    r_first = [sum(output_splits[q] for q in range(src) if q != rank) for src in range(world)]
    for i in range(chunks):
        main.wait_event(arrived[i])
        for src in range(world):
            a, b = row_ranges(output_splits[src], chunks)[i]
            if src != rank and b > a:
                at = sum(output_splits[:src])
                got = mine[r_first[src] + a : r_first[src] + b]
                _dequantize_into(got, out[at + a : at + b])
    return out
