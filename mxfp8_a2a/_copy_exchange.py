"""The copy-engine exchange: packed rows written into the receivers' buffers by DMA copies.

Each rank of the group holds one symmetric-memory allocation (torch.distributed.
_symmetric_memory: CUDA GPUs with peer access, e.g. on NVLink), mapped into every other
rank's address space. A call:

1. all_gathers every rank's input and output splits on a side stream while the outgoing rows
   are quantized (the host waits only for that small collective). From the table every rank
   knows where its rows land in each receiver's buffer (after the rows of lower ranks) and
   checks that every receiver expects what its senders send (every rank checks the same
   table, so all raise alike); the buffers grow collectively when a call needs more;
2. quantizes the outgoing rows into a local staging tensor (packed rows, all SMs) and, beside
   the copies, the kept rows' round trip straight into the output;
3. copies each receiver's rows into its buffer with ``Tensor.copy_`` (cudaMemcpyAsync: the
   GPU's copy engines move the bytes over NVLink and leave the SMs to the casts), then a
   barrier (symmetric-memory signal pads) on the copy stream: every rank's rows have arrived;
4. dequantizes the received rows into the output around the kept rows.

With ``chunks`` = c > 1 the rows of every (sender, receiver) pair are cut into c row ranges;
range i is quantized, copied, fenced by its own barrier and dequantized, so that the copies of
range i run while range i + 1 is quantized and range i - 1 dequantized.

The allocation has two halves used in turn: a rank writes half h of call n + 2 only after
the last barrier of call n + 1, which every rank reaches after dequantizing call n. Every rank
must make the same sequence of exchange calls (as for any collective).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ._exchange import _dequantize_into, _quantize_into, _roundtrip_into, _wire_row

# torch >= 2.13 renames all_gather_into_tensor to all_gather_single
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _symm_mem():
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:  # pragma: no cover - depends on the torch build
        raise RuntimeError(
            "transport='copy_engine' needs torch.distributed._symmetric_memory (a CUDA build "
            "of torch); use transport='nccl'"
        ) from e
    return symm_mem


class _Buffers:
    """One symmetric allocation of two halves for (group, device), grown on demand."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        self.group, self.device = group, device
        self.half_bytes, self.buf, self.handle, self.calls = 0, None, None, 0
        self.views: dict[tuple[int, int, int], torch.Tensor] = {}

    def reserve(self, nbytes: int) -> None:
        """Halves of at least nbytes. Collective when it grows: every rank must ask for the
        same nbytes (the gathered splits table guarantees it)."""
        if nbytes <= self.half_bytes:
            return
        symm_mem = _symm_mem()
        half = max(1 << 20, 1 << (nbytes - 1).bit_length())  # powers of two: few regrowths
        torch.cuda.synchronize(self.device)  # no copy of this rank still targets the old one
        name = self.group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch
            with warnings.catch_warnings():  # deprecated (not needed) in newer ones
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(name)
        try:
            self.buf = symm_mem.empty(2 * half, dtype=torch.uint8, device=self.device)
            self.handle = symm_mem.rendezvous(self.buf, name)
        except RuntimeError as e:
            raise RuntimeError(
                "transport='copy_engine' could not map the ranks' buffers into each other "
                "(symmetric memory needs the group's GPUs on one host with peer access); use "
                f"transport='nccl'. The error was: {e}"
            ) from e
        self.half_bytes, self.views = half, {}

    def peer(self, rank: int, half: int, row: int) -> torch.Tensor:
        """Half ``half`` of ``rank``'s buffer as uint8 [rows, row] (mapped peer memory)."""
        key = (rank, half, row)
        if key not in self.views:
            rows = self.half_bytes // row
            self.views[key] = self.handle.get_buffer(
                rank, (rows, row), torch.uint8, half * self.half_bytes
            )
        return self.views[key]

    def next_half(self) -> int:
        self.calls += 1
        return self.calls % 2


_BUFFERS: dict[tuple[str, int], _Buffers] = {}
_STREAMS: dict[int, torch.cuda.Stream] = {}


def _buffers(group: dist.ProcessGroup, device: torch.device) -> _Buffers:
    key = (group.group_name, device.index)
    if key not in _BUFFERS:
        _BUFFERS[key] = _Buffers(group, device)
    return _BUFFERS[key]


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream of the splits table, the copies and the barriers (high priority, so that
    the barrier kernels find an SM among the casts' programs)."""
    if device.index not in _STREAMS:
        _STREAMS[device.index] = torch.cuda.Stream(device, priority=-1)
    return _STREAMS[device.index]


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
    main, side = torch.cuda.current_stream(dev), _copy_stream(dev)
    with torch.cuda.stream(side):  # the splits table, beside the quantize
        payload = [*input_splits, *output_splits, chunks]
        mine = torch.tensor(payload, dtype=torch.int64, device=dev)
        gathered = torch.empty(world * len(payload), dtype=torch.int64, device=dev)
        _all_gather(gathered, mine, group=pg)
    row = _wire_row(k)
    x_at, o_at, n = sum(input_splits[:rank]), sum(output_splits[:rank]), input_splits[rank]
    out = x.new_empty((sum(output_splits), k))
    staging = torch.empty((x.shape[0] - n, row), dtype=torch.uint8, device=dev)
    x_starts, s_starts = [0], [0]  # first row of each destination in x and in staging
    for d, rows in enumerate(input_splits):
        x_starts.append(x_starts[-1] + rows)
        s_starts.append(s_starts[-1] + (0 if d == rank else rows))
    quantized = []
    for i in range(chunks):
        for d in range(world):
            a, b = row_ranges(input_splits[d], chunks)[i]
            if d != rank and b > a:
                src = x[x_starts[d] + a : x_starts[d] + b]
                _quantize_into(src, staging[s_starts[d] + a : s_starts[d] + b], mode)
        quantized.append(torch.cuda.Event())
        quantized[-1].record(main)
    if n:
        _roundtrip_into(x[x_at : x_at + n], out[o_at : o_at + n], mode)
    with torch.cuda.stream(side):
        table = gathered.view(world, -1).tolist()  # waits for the all_gather only
    if any(t[-1] != chunks for t in table):
        raise ValueError(
            f"chunks differ between ranks: {[t[-1] for t in table]}; every rank must pass the "
            "same chunks"
        )
    first, most = layout([t[:-1] for t in table], rank)
    if most == 0:  # no rank sends another a row (every rank sees the same table)
        return out
    bufs = _buffers(pg, dev)
    bufs.reserve(most * row)
    half = bufs.next_half()
    mine_buf = bufs.peer(rank, half, row)
    # where each source's rows start in this rank's buffer
    r_first = [sum(output_splits[q] for q in range(src) if q != rank) for src in range(world)]
    arrived = []
    for i in range(chunks):
        side.wait_event(quantized[i])
        with torch.cuda.stream(side):
            for d in range(world):
                a, b = row_ranges(input_splits[d], chunks)[i]
                if d != rank and b > a:
                    dst = bufs.peer(d, half, row)[first[d] + a : first[d] + b]
                    dst.copy_(staging[s_starts[d] + a : s_starts[d] + b])
            bufs.handle.barrier(channel=0)  # range i of every pair has arrived
        arrived.append(torch.cuda.Event())
        arrived[-1].record(side)
    staging.record_stream(side)
    for i in range(chunks):
        main.wait_event(arrived[i])
        for src in range(world):
            a, b = row_ranges(output_splits[src], chunks)[i]
            if src != rank and b > a:
                at = sum(output_splits[:src])
                got = mine_buf[r_first[src] + a : r_first[src] + b]
                _dequantize_into(got, out[at + a : at + b])
    return out
