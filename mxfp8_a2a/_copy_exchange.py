"""The copy-engine exchange: packed rows written into the peer's buffer by DMA copies.

For groups of two ranks (CUDA GPUs with peer access, e.g. on NVLink). Each rank holds one
symmetric-memory allocation (torch.distributed._symmetric_memory) mapped into the peer's
address space; it receives the peer's rows. Each rank knows both counts of its one pair
(rows it sends, rows it receives), so the buffers are sized and grown alike on both ranks
with nothing gathered and no host wait. A call, on the caller's stream ("main"), a copy
stream and a fence stream:

1. copy stream: a barrier (the peer has finished reading its buffer: its previous call's
   dequantize);
2. for each of ``chunks`` row ranges: main quantizes the range into a local staging tensor
   (packed rows, all SMs); the copy stream copies it into the peer's buffer with
   ``Tensor.copy_`` (cudaMemcpyAsync: the copy engines move the bytes over NVLink and leave
   the SMs to the casts); the fence stream runs a barrier after it (the range has arrived
   both ways);
3. main: the kept rows' round trip straight into the output (beside the copies), then each
   range's dequantize after its barrier.

So the copy of range i runs while range i + 1 is quantized, the kept rows round-trip and
range i - 1 is dequantized. The copy stream starts a call only after everything the caller's
stream had queued before it, so the first barrier of call n + 1 passes only when both ranks
have dequantized call n. Both ranks must make the same sequence of exchange calls with the
same ``chunks`` (as for any collective); the splits are checked across ranks only with
``validate``.

Groups of more than two ranks would need every rank's splits to place the rows (one gather
and a host wait per call); not done.
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
    """One symmetric allocation for (group, device), grown on demand."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        self.group, self.device = group, device
        self.nbytes, self.buf, self.handle = 0, None, None
        self.views: dict[tuple, torch.Tensor] = {}

    def reserve(self, nbytes: int) -> None:
        """At least nbytes. Collective when it grows: both ranks ask for the same nbytes (the
        larger count of their one pair)."""
        if nbytes <= self.nbytes:
            return
        symm_mem = _symm_mem()
        size = max(1 << 20, 1 << (nbytes - 1).bit_length())  # powers of two: few regrowths
        torch.cuda.synchronize(self.device)  # no copy of this rank still targets the old one
        name = self.group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch
            with warnings.catch_warnings():  # deprecated (not needed) in newer ones
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(name)
        try:
            self.buf = symm_mem.empty(size, dtype=torch.uint8, device=self.device)
            self.handle = symm_mem.rendezvous(self.buf, name)
        except RuntimeError as e:
            raise RuntimeError(
                "transport='copy_engine' could not map the ranks' buffers into each other "
                "(symmetric memory needs the group's GPUs on one host with peer access); use "
                f"transport='nccl'. The error was: {e}"
            ) from e
        self.nbytes, self.views = size, {}

    def rows(self, rank: int, row: int) -> torch.Tensor:
        """``rank``'s allocation as uint8 [rows, row] (mapped peer memory for the peer)."""
        key = (rank, row)
        if key not in self.views:
            shape = (self.nbytes // row, row)
            self.views[key] = self.handle.get_buffer(rank, shape, torch.uint8, 0)
        return self.views[key]


class _State:
    """Per (group, device): the row buffer and the side streams."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        self.rows = _Region(group, device)
        # high priority, so that the barriers find an SM among the casts' programs
        self.copy = torch.cuda.Stream(device, priority=-1)
        self.fence = torch.cuda.Stream(device, priority=-1)


_STATES: dict[tuple[str, int], _State] = {}


def _state(group: dist.ProcessGroup, device: torch.device) -> _State:
    key = (group.group_name, device.index)
    if key not in _STATES:
        _STATES[key] = _State(group, device)
    return _STATES[key]


def row_ranges(n: int, chunks: int) -> list[tuple[int, int]]:
    """The ``chunks`` (first, end) row ranges of a pair's n rows (sender and receiver cut
    alike: both know n)."""
    return [(n * i // chunks, n * (i + 1) // chunks) for i in range(chunks)]


def auto_ranges(pair_rows: int, k: int) -> int:
    """Row ranges for a copy-engine exchange whose pair moves at most pair_rows rows of K
    columns one way (COPY_ENGINE_* in _config.py); both ranks get the same."""
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
    gives them. A group of two ranks; ``chunks``: row ranges per direction, pipelined."""
    pg = group if group is not None else dist.group.WORLD
    rank, k, dev = dist.get_rank(pg), x.shape[1], x.device
    peer = 1 - rank
    st = _state(pg, dev)
    main = torch.cuda.current_stream(dev)
    row = _wire_row(k)
    x_at, o_at, n = sum(input_splits[:rank]), sum(output_splits[:rank]), input_splits[rank]
    x_peer, o_peer = sum(input_splits[:peer]), sum(output_splits[:peer])
    out = x.new_empty((sum(output_splits), k))
    sends, receives = (
        row_ranges(input_splits[peer], chunks),
        row_ranges(output_splits[peer], chunks),
    )
    most = max(input_splits[peer], output_splits[peer])
    arrived = []
    if most:
        staging = torch.empty((input_splits[peer], row), dtype=torch.uint8, device=dev)
        st.copy.wait_stream(main)  # what the caller queued before (see the module doc)
        with torch.cuda.stream(st.copy):
            st.rows.reserve(most * row)
            st.rows.handle.barrier(channel=1)  # the peer has read its buffer
        dest = st.rows.rows(peer, row)
        for a, b in sends:
            if b > a:
                _quantize_into(x[x_peer + a : x_peer + b], staging[a:b], mode)
            st.copy.wait_stream(main)
            with torch.cuda.stream(st.copy):
                if b > a:
                    dest[a:b].copy_(staging[a:b])
            st.fence.wait_stream(st.copy)
            with torch.cuda.stream(st.fence):
                st.rows.handle.barrier(channel=0)  # this range has arrived both ways
            arrived.append(torch.cuda.Event())
            arrived[-1].record(st.fence)
        staging.record_stream(st.copy)
    if n:
        _roundtrip_into(x[x_at : x_at + n], out[o_at : o_at + n], mode)
    if not arrived:
        return out
    mine = st.rows.rows(rank, row)
    for (a, b), done in zip(receives, arrived, strict=True):
        main.wait_event(done)
        if b > a:
            _dequantize_into(mine[a:b], out[o_peer + a : o_peer + b])
    return out
