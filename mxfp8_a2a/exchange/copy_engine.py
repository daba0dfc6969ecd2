"""The copy-engine transport: packed rows written into the peer's buffer by DMA copies.

For groups of two ranks on CUDA GPUs with peer access (e.g. NVLink). The transport object
owns one symmetric-memory allocation per rank (torch.distributed._symmetric_memory), mapped
into the peer's address space, that receives the peer's rows, and two side streams. Each
rank knows both counts of its one pair (rows it sends, rows it receives), so the buffers are
sized and grown alike on both ranks with nothing gathered and no host wait. A call, on the
caller's stream ("main"), the copy stream and the fence stream:

1. copy stream: a barrier (the peer has finished reading its buffer: its previous call's
   dequantize);
2. for each row range: main quantizes the range into a local staging tensor (all SMs); the
   copy stream copies it into the peer's buffer with ``Tensor.copy_`` (cudaMemcpyAsync: the
   copy engines move the bytes over NVLink and leave the SMs to the casts); the fence stream
   runs a barrier after it (the range has arrived both ways);
3. main: the kept rows' round trip straight into the output (beside the copies), then each
   range's dequantize after its barrier.

So the copy of range i runs while range i + 1 is quantized, the kept rows round-trip and
range i - 1 is dequantized. The copy stream starts a call only after everything the caller's
stream had queued before it, so the first barrier of call n + 1 passes only when both ranks
have dequantized call n. Both ranks must make the same sequence of exchange calls with the
same row-range count (as for any collective; ``validate=True`` checks it).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from .. import _config
from .._common import e4m3_gpu_error
from .rows import dequantize_into, quantize_into, roundtrip_into, wire_row
from .transport import Transport


def _symm_mem():
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:  # pragma: no cover - depends on the torch build
        raise RuntimeError(
            "CopyEngineTransport needs torch.distributed._symmetric_memory (a CUDA build of "
            "torch); use transport='nccl'"
        ) from e
    return symm_mem


def row_ranges(n: int, ranges: int) -> list[tuple[int, int]]:
    """The ``ranges`` (first, end) row ranges of a pair's n rows (sender and receiver cut
    alike: both know n)."""
    return [(n * i // ranges, n * (i + 1) // ranges) for i in range(ranges)]


def auto_row_ranges(pair_rows: int, k: int) -> int:
    """Row ranges for a pair that moves at most pair_rows rows of K columns one way: about
    COPY_ENGINE_RANGE_BYTES of wire bytes per range, at most COPY_ENGINE_MAX_RANGES (see
    _config.py). Both ranks of the pair get the same count."""
    wire = pair_rows * wire_row(k)
    return max(1, min(_config.COPY_ENGINE_MAX_RANGES, wire // _config.COPY_ENGINE_RANGE_BYTES))


class CopyEngineTransport(Transport):
    """Copy engines into symmetric memory, for a group of two ranks on CUDA GPUs with peer
    access. Faster than NCCL for large exchanges on NVLink (BENCHMARKS.md); not capturable
    in CUDA graphs (its buffer grows with a synchronizing rendezvous).

    Args:
        group: the process group (two ranks) this transport serves; default the world.
        row_ranges: row ranges per direction, pipelined (quantize, copy and dequantize
            overlap); None (default) picks 1 or 2 from the pair's wire bytes.
    Memory: one symmetric allocation per rank of the largest (rows one way x wire row
    bytes) seen so far, rounded up to a power of two (at least 1 MiB), plus a staging
    tensor per call. :meth:`close` frees it; the transport must not be used afterwards.
    Create it on every rank of the group (creating it is not collective; the first
    exchange is).
    """

    name, capturable = "copy_engine", False

    def __init__(self, group: dist.ProcessGroup | None = None, row_ranges: int | None = None):
        if row_ranges is not None and (type(row_ranges) is not int or row_ranges < 1):
            raise ValueError(f"row_ranges must be None or a positive int, got {row_ranges!r}")
        if group is None and not dist.is_initialized():
            raise RuntimeError(
                "CopyEngineTransport(group=None) serves the default group: create it after "
                "torch.distributed.init_process_group, or pass the group"
            )
        self.group = group if group is not None else dist.group.WORLD
        self.row_ranges = row_ranges
        self.nbytes = 0
        self._buf = self._handle = None
        self._views: dict[tuple, torch.Tensor] = {}
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        self._device: torch.device | None = None

    def setting(self) -> int:
        return 0 if self.row_ranges is None else self.row_ranges

    def check(self, device, group):
        world = dist.get_world_size(group)
        if device.type != "cuda" or world != 2:
            raise ValueError(
                "CopyEngineTransport needs CUDA tensors (GPUs with peer access) and a group of "
                f"two ranks; got tensors on {device} and {world} ranks: use transport='nccl'"
            )
        if (problem := e4m3_gpu_error(device)) is not None:
            raise ValueError(problem)
        given = group if group is not None else dist.group.WORLD
        if given is not self.group:
            raise ValueError(
                "this CopyEngineTransport serves another process group; create one per group"
            )
        if self._device is not None and device != self._device:
            raise ValueError(
                f"this CopyEngineTransport holds buffers on {self._device}, x is on {device}"
            )

    def close(self) -> None:
        """Free the symmetric buffer and the streams (waits for this rank's GPU work)."""
        if self._device is not None:
            torch.cuda.synchronize(self._device)
        self._buf = self._handle = self._streams = self._device = None
        self._views, self.nbytes = {}, 0

    def _reserve(self, nbytes: int, device: torch.device) -> None:
        """At least nbytes of buffer. Collective when it grows: both ranks ask for the same
        nbytes (the larger count of their one pair)."""
        if self._streams is None:
            # high priority, so that the barriers find an SM among the casts' programs
            self._streams = tuple(torch.cuda.Stream(device, priority=-1) for _ in range(2))
            self._device = device
        if nbytes <= self.nbytes:
            return
        symm_mem = _symm_mem()
        size = max(1 << 20, 1 << (nbytes - 1).bit_length())  # powers of two: few regrowths
        torch.cuda.synchronize(device)  # no copy of this rank still targets the old buffer
        name = self.group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch
            with warnings.catch_warnings():  # deprecated (not needed) in newer ones
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(name)
        try:
            self._buf = symm_mem.empty(size, dtype=torch.uint8, device=device)
            self._handle = symm_mem.rendezvous(self._buf, name)
        except RuntimeError as e:
            raise RuntimeError(
                "CopyEngineTransport could not map the ranks' buffers into each other "
                "(symmetric memory needs the group's GPUs on one host with peer access); use "
                f"transport='nccl'. The error was: {e}"
            ) from e
        self.nbytes, self._views = size, {}

    def _rows(self, rank: int, row: int) -> torch.Tensor:
        """``rank``'s buffer as uint8 [rows, row] (mapped peer memory for the peer)."""
        key = (rank, row)
        if key not in self._views:
            shape = (self.nbytes // row, row)
            self._views[key] = self._handle.get_buffer(rank, shape, torch.uint8, 0)
        return self._views[key]

    def exchange(self, x, output_splits, input_splits, group, scaling_mode):
        rank, k, dev = dist.get_rank(self.group), x.shape[1], x.device
        peer = 1 - rank
        main = torch.cuda.current_stream(dev)
        row = wire_row(k)
        x_at, o_at, n = sum(input_splits[:rank]), sum(output_splits[:rank]), input_splits[rank]
        x_peer, o_peer = sum(input_splits[:peer]), sum(output_splits[:peer])
        out = x.new_empty((sum(output_splits), k))
        most = max(input_splits[peer], output_splits[peer])
        ranges = self.row_ranges or auto_row_ranges(most, k)
        sends = row_ranges(input_splits[peer], ranges)
        receives = row_ranges(output_splits[peer], ranges)
        arrived = []
        if most:
            staging = torch.empty((input_splits[peer], row), dtype=torch.uint8, device=dev)
            self._reserve(0, dev)
            copy, fence = self._streams
            copy.wait_stream(main)  # what the caller queued before (see the module doc)
            with torch.cuda.stream(copy):
                self._reserve(most * row, dev)
                self._handle.barrier(channel=1)  # the peer has read its buffer
            dest = self._rows(peer, row)
            for a, b in sends:
                if b > a:
                    quantize_into(x[x_peer + a : x_peer + b], staging[a:b], scaling_mode)
                copy.wait_stream(main)
                with torch.cuda.stream(copy):
                    if b > a:
                        dest[a:b].copy_(staging[a:b])
                fence.wait_stream(copy)
                with torch.cuda.stream(fence):
                    self._handle.barrier(channel=0)  # this range has arrived both ways
                arrived.append(torch.cuda.Event())
                arrived[-1].record(fence)
            staging.record_stream(copy)
        if n:
            roundtrip_into(x[x_at : x_at + n], out[o_at : o_at + n], scaling_mode, False)
        if not arrived:
            return out
        mine = self._rows(rank, row)
        for (a, b), done in zip(receives, arrived, strict=True):
            main.wait_event(done)
            if b > a:
                dequantize_into(mine[a:b], out[o_peer + a : o_peer + b])
        return out
