"""PushBuffer: a receive buffer in the memory of every rank of a one-node group, which the
ranks' kernels store rows into directly (the "push" transport of the static dispatch,
moe/push.py), and the barrier between the ranks' kernels.

Each rank owns one allocation of the same size, in torch symmetric memory (mapped into
every peer's address space; torch.distributed._symmetric_memory, a private torch API,
checked at construction), or, for W ranks emulated in one process (tests, benchmarks), W
plain device tensors. Bytes of rank d's allocation:

- pads int64 [W]: pads[s] = the last barrier rank s has signalled to rank d; then rank d's
  error flag (int64);
- counts int64 [W, C]: row s, the counts message rank s sent rank d (C count columns);
- rows: [W * cap, row] wire rows, source s's rows at [s * cap, (s + 1) * cap) for the call's
  cap <= capacity (the layout of all_to_all_single's output with equal splits cap).

An exchange on the push transport is: barrier; every rank stores its rows (and counts) into
the receivers' buffers; barrier; every rank reads its own buffer. The first barrier keeps a
rank from writing into a buffer its receiver is still reading (the receiver joins it only
after the reads of its previous exchange, queued before it on the same stream); the second
makes the rows visible before they are read.

Memory ordering across GPUs: the stores are plain stores by the push kernel; the barrier is
a later kernel on the same stream, so those stores happen before it. In the barrier, each
program signals one peer with an atomic max at system scope with release semantics (the
stores before it become visible to whoever acquires the signal) and then spins on its own pad
with acquire semantics (an atomic read at system scope) until that peer's signal arrives;
the kernels after it, on the same stream, read after the acquire. (torch's own
symmetric-memory barrier orders a previous kernel's stores the same way: a system-scope
fence in the barrier kernel, after the writing kernel on the stream; this is to be confirmed
across GPUs.) Every exchange on one buffer must run on one stream, in the same order on
every rank (as for any collective). Signals are epochs (the
n-th barrier writes n), not flags: a pad needs no reset, so a CUDA graph replays the same
kernels, and repeated or reordered signals are harmless (atomic max).

A spin gives up after ``spin_limit`` iterations (None: never), sets its rank's error flag
and the late peer's (whose buffer it may now write early), which :meth:`PushBuffer.check`
raises on, and lets the stream go on; the ranks' epochs then differ: :meth:`PushBuffer.reset`
on every rank.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from .. import _config
from .._common import next_pow2
from .push_rule import _device, _gather, _probe, _symm_mem, _verdict, push_unavailable
from .rows import wire_row
from .wires import layer_wires, leg_pair

_ALIGN = 256  # byte alignment of each region of a buffer
_NEVER = 2**62  # spin_limit None
_BUFFERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # key -> PushBuffer
_KEYS = itertools.count(1)


@triton.jit
def _barrier_kernel(addr_ptr, epoch_ptr, world, spin_limit):
    """Program p: signal peer p (the next epoch, release), then wait for peer p's signal of
    the same epoch (acquire). addr_ptr int64 [3W + 1]: addresses of this rank's pad in each
    peer's buffer, of each peer's pad in this rank's buffer, of each rank's error flag, of
    this rank's; epoch_ptr int64 [W], this rank's barriers so far with each peer. Giving up
    sets this rank's error flag and peer p's (its buffer may now be written early)."""
    p = tl.program_id(0)
    e = tl.load(epoch_ptr + p) + 1
    tl.store(epoch_ptr + p, e)
    to_peer = tl.load(addr_ptr + p).to(tl.pointer_type(tl.int64))
    tl.atomic_max(to_peer, e, sem="release", scope="sys")
    mine = tl.load(addr_ptr + world + p).to(tl.pointer_type(tl.int64))
    seen = tl.atomic_max(mine, 0, sem="acquire", scope="sys")  # (a read: pads are >= 0)
    n = 0
    while (seen < e) & (n < spin_limit):
        seen = tl.atomic_max(mine, 0, sem="acquire", scope="sys")
        n += 1
    if seen < e:
        tl.atomic_max(tl.load(addr_ptr + 3 * world).to(tl.pointer_type(tl.int64)), 1, scope="sys")
        peer_err = tl.load(addr_ptr + 2 * world + p).to(tl.pointer_type(tl.int64))
        tl.atomic_max(peer_err, 1, scope="sys")


@triton.jit
def _put_kernel(src_ptr, table_ptr, n, BLOCK: tl.constexpr):
    """Program d: src int64 [W, n] row d stored at table[d] (an address)."""
    d = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    v = tl.load(src_ptr + d * n + i, mask=i < n)
    dst = tl.load(table_ptr + d).to(tl.pointer_type(tl.int64))
    tl.store(dst + i, v, mask=i < n)


def counts_columns(local: int) -> int:
    """Columns of the static dispatch's counts message (moe/dispatch_static.py), whatever
    the local experts ``local``: num_experts, then max(DISPATCH_INLINE_COUNTS, local) counts."""
    return 1 + max(_config.DISPATCH_INLINE_COUNTS, local)


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def static_transport(
    group: dist.ProcessGroup | None,
    hidden: int,
    num_experts: int,
    *,
    device: torch.device | str | None = None,
    **sizes,
) -> PushBuffer | str:
    """The transport rule of the static dispatch: a :class:`PushBuffer` (built with
    ``sizes``: tokens, top_k, capacity, exchange, dtype, spin_limit) when
    :func:`push_unavailable` finds nothing against it (every rank on one host, CUDA, peer
    access, torch symmetric memory), else "nccl". A collective; the same answer on every
    rank (a ``device`` one rank cannot use raises on every rank)."""
    if push_unavailable(group, device) is None:
        return PushBuffer(group, hidden, num_experts, device=device, **sizes)
    return "nccl"


def _wires(exchange) -> set[str]:
    """The wires of an ``exchange`` (a wire, a layer preset, Wires or a pair), or ValueError."""
    if isinstance(exchange, tuple) and len(exchange) == 2:
        return set(leg_pair(exchange, "dispatch"))
    return set(layer_wires(exchange))


class PushBuffer:
    """The receive buffers of the static dispatch's push transport, one per rank, owned by
    the caller (:meth:`free` releases them).

    Args:
        group: the process group (all ranks on one host with peer access; see
            :func:`push_unavailable`); default the world. Creating it is a collective.
        hidden: the hidden size H of the rows exchanged (at most that).
        num_experts: total experts E (a multiple of the group size W).
        capacity: rows per rank pair the buffers hold (dispatch_static's capacity may be
            lower); None: the dropless value ``tokens * min(top_k, E / W)`` (needs
            ``tokens``, the most tokens a rank dispatches, and ``top_k``).
        exchange: the legs it carries: "mxfp8" (wire rows of wire_row(H) bytes), "bf16"
            (rows of H values of ``dtype``) or any other layer ``exchange`` (a preset such as
            "mxfp8_to_experts", a Wires, a (forward, backward) pair): rows of its widest leg.
        spin_limit: iterations a barrier waits for a peer before it gives up (None: never;
            tests bound it).
    Memory per rank (``nbytes``): W * capacity rows of wire_row(H) = 33 H / 32 bytes
    rounded up to 16 ("mxfp8"; H * dtype's size where a leg is unquantized), plus
    W * (1 + max(32, E / W)) int64 counts and W pads; e.g. W = 8, 4096 tokens, top-8, 256
    experts, H = 7168, dropless, "mxfp8": 8 * 32768 * 7392 bytes = 1.94 GB (the NCCL
    static path needs the same for its receive buffer, and a send buffer).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        hidden: int,
        num_experts: int,
        *,
        tokens: int | None = None,
        top_k: int | None = None,
        capacity: int | None = None,
        exchange: str = "mxfp8",
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        spin_limit: int | None = None,
    ):
        world = dist.get_world_size(group)
        device, me, mine = _probe(device)
        mine = mine, None
        try:  # (checked everywhere before any rank acts on it: one gather, one answer)
            self._layout(world, hidden, num_experts, tokens, top_k, capacity, exchange, dtype)
            self._check_spin_limit(spin_limit)
            if mine[0] is None:
                mine = None, (self.capacity, self.row_bytes, self.count_columns, self.nbytes)
        except (TypeError, ValueError) as e:
            mine = mine[0] or str(e), None
        peers = _gather(group, (me, *mine))
        errors = [f"rank {r}: {e}" for r, (_, e, _) in enumerate(peers) if e]
        why = _verdict([p[0] for p in peers])
        sizes = [p[2] for p in peers]
        if not errors and why is None and len(set(sizes)) > 1:
            errors.append(
                f"the ranks' buffers differ ((capacity, row bytes, count columns, bytes) by rank: "
                f"{sizes}): pass the same hidden, num_experts, exchange and capacity (or tokens) "
                "on every rank"
            )
        if errors or why:
            raise ValueError("PushBuffer: " + ("; ".join(errors) or
                             f"the push transport cannot serve this group ({why}); use "
                             "transport='nccl'"))  # fmt: skip
        symm_mem, mem, failed = _symm_mem(), None, None
        try:
            mem = symm_mem.empty(self.nbytes, dtype=torch.uint8, device=device).zero_()
        except RuntimeError as e:  # (out of memory, say: every rank must hear of it)
            failed = f"{type(e).__name__}: {e}"
        failures = [f"rank {r}: {f}" for r, f in enumerate(_gather(group, failed)) if f]
        if failures:
            raise RuntimeError(f"PushBuffer: allocating {self.nbytes} bytes failed: {failures}")
        handle = symm_mem.rendezvous(mem, (group or dist.group.WORLD).group_name)
        torch.cuda.synchronize(device)
        self._setup(dist.get_rank(group), [mem], list(handle.buffer_ptrs), spin_limit)
        self.group, self._handle = group, handle
        self._sync()  # (every rank's buffer zeroed before any rank's first store)

    @classmethod
    def emulated(cls, world: int, hidden: int, num_experts: int, *, device=None,
                 spin_limit: int | None = None, **sizes) -> list[PushBuffer]:  # fmt: skip
        """W ranks' buffers in this process (plain tensors on ``device``): rank r's calls
        must run concurrently with the others' (one stream per rank; a CUDA GPU), e.g. to
        test the protocol on one GPU. ``sizes``: tokens, top_k, capacity, exchange, dtype."""
        if type(world) is not int or world < 1:
            raise ValueError(f"PushBuffer.emulated: world must be an int >= 1, got {world!r}")
        unknown = set(sizes) - {"tokens", "top_k", "capacity", "exchange", "dtype"}
        if unknown:
            raise TypeError(f"PushBuffer.emulated got unexpected arguments {sorted(unknown)}")
        cls._check_spin_limit(spin_limit)
        bufs = [cls.__new__(cls) for _ in range(world)]
        for b in bufs:
            b._layout(world, hidden, num_experts, sizes.get("tokens"), sizes.get("top_k"),
                      sizes.get("capacity"), sizes.get("exchange", "mxfp8"),
                      sizes.get("dtype", torch.bfloat16))  # fmt: skip
        device = _device(device)
        mems = [torch.zeros(bufs[0].nbytes, dtype=torch.uint8, device=device) for _ in bufs]
        for r, b in enumerate(bufs):
            b._setup(r, mems[r:] + mems[:r], [m.data_ptr() for m in mems], spin_limit)
        return bufs

    def _layout(self, world, hidden, num_experts, tokens, top_k, capacity, exchange, dtype):
        for name, v in (("hidden", hidden), ("num_experts", num_experts)):
            if type(v) is not int or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if num_experts % world:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of the group "
                             f"size ({world})")  # fmt: skip
        wires = _wires(exchange)
        local = num_experts // world
        if capacity is None:
            if type(tokens) is not int or type(top_k) is not int or tokens < 0 or top_k < 0:
                raise ValueError(
                    "capacity=None (dropless) needs tokens (the most tokens a rank dispatches) "
                    f"and top_k, ints >= 0; got tokens={tokens!r}, top_k={top_k!r}"
                )
            capacity = tokens * min(top_k, local)
        if type(capacity) is not int or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0 or None, got {capacity!r}")
        self.world, self.hidden, self.num_experts = world, hidden, num_experts
        self.capacity, self.exchange = capacity, exchange
        # rows of the widest leg: MXFP8 rows of wire_row(H) bytes, unquantized of H values
        self.row_bytes = max(wire_row(hidden) if w == "mxfp8" else hidden * dtype.itemsize
                             for w in wires)  # fmt: skip
        self.count_columns = counts_columns(local)
        self._counts_at = _round_up(8 * (world + 1))  # W pads, then the error flag
        self._rows_at = self._counts_at + _round_up(8 * world * self.count_columns)
        self.nbytes = self._rows_at + _round_up(world * capacity * self.row_bytes)

    @staticmethod
    def _check_spin_limit(spin_limit) -> None:
        if spin_limit is not None and (type(spin_limit) is not int or not 0 <= spin_limit < 2**31):
            raise ValueError(f"spin_limit must be an int in [0, 2**31) or None, got {spin_limit!r}")

    def _setup(self, rank, mems, bases, spin_limit):
        """mems[0]: this rank's allocation (the others only kept alive); bases: every rank's
        address; spin_limit checked by the caller."""
        self.rank, self._mems, self.device = rank, mems, mems[0].device
        self.group, self._handle = None, None  # (a process group's: set by __init__)
        w, mine = self.world, bases[rank]
        addr = [b + 8 * rank for b in bases] + [mine + 8 * p for p in range(w)]
        addr += [b + 8 * w for b in bases] + [mine + 8 * w]  # the ranks' error flags, this one
        self._bases = torch.tensor(bases, dtype=torch.int64, device=self.device)
        self._barrier_addr = torch.tensor(addr, dtype=torch.int64, device=self.device)
        self._epochs = torch.zeros(w, dtype=torch.int64, device=self.device)
        self._error = mems[0][8 * w : 8 * w + 8].view(torch.int64)
        self.spin_limit = _NEVER if spin_limit is None else spin_limit
        self.key = next(_KEYS)
        _BUFFERS[self.key] = self

    # ---------------------------------------------------------------- used by the transport

    def table(self, region: str, cap: int, row_bytes: int) -> torch.Tensor:
        """int64 [W]: where this rank's part of ``region`` ("counts" or "rows", rows of
        row_bytes, cap per source) starts in each rank's buffer."""
        at = self._counts_at if region == "counts" else self._rows_at
        return self._bases + (at + self.rank * cap * row_bytes)

    def received(self, region: str, rows: int, row: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's ``region`` as [rows, row] of ``dtype`` (a view of the buffer)."""
        at = self._counts_at if region == "counts" else self._rows_at
        n = rows * row * dtype.itemsize
        return self._mems[0][at : at + n].view(dtype).view(rows, row)

    def barrier(self) -> None:
        """The barrier of the module docstring, queued on the current stream."""
        self._check_live()
        _barrier_kernel[(self.world,)](self._barrier_addr, self._epochs, self.world,
                                       self.spin_limit, num_warps=1)  # fmt: skip

    def put_counts(self, msg: torch.Tensor) -> None:
        """Store msg int64 [W, C] row d as this rank's counts row in rank d's buffer."""
        c = msg.shape[1]
        table = self.table("counts", 1, 8 * c)
        _put_kernel[(self.world,)](msg.contiguous(), table, c, BLOCK=next_pow2(c), num_warps=1)

    # ---------------------------------------------------------------- for the caller

    def check(self) -> None:
        """Raise if a barrier of this rank, or of a rank that gave up waiting for it, gave up
        (a host read of the error flag; call it on every rank)."""
        self._check_live()
        if int(self._error.item()):
            raise RuntimeError(
                f"PushBuffer (rank {self.rank}): a barrier gave up after {self.spin_limit} "
                "spins (a peer did not join: ranks ran different exchanges, or one stopped); "
                "the buffers' contents since then are not valid: call reset() on every rank"
            )

    def reset(self) -> None:
        """Zero this rank's pads, barrier counts and error flag (after a spin gave up), with
        no exchange in flight. Collective for a group's buffer (every rank resets before any
        rank signals again); emulated ranks: reset every rank before the next exchange."""
        self._check_live()
        self._sync()
        self._mems[0][: self._counts_at].zero_()
        self._epochs.zero_()
        self._sync()

    def free(self) -> None:
        """Release the buffer (collective for a group's buffer: no peer stores into it
        afterwards). CUDA graphs captured with it hold its addresses: drop them first."""
        if self._mems:
            self._sync()
        _BUFFERS.pop(getattr(self, "key", None), None)
        self._mems, self._handle, self._error = [], None, None

    def _sync(self) -> None:
        """Wait for this device, then (a group's buffer) for every rank of the group."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self._handle is not None:
            dist.barrier(self.group, device_ids=[self.device.index])

    def _check_live(self) -> None:
        if not self._mems:
            raise RuntimeError("this PushBuffer was freed")

    def __repr__(self) -> str:
        return (f"PushBuffer(rank={self.rank}, world={self.world}, hidden={self.hidden}, "
                f"capacity={self.capacity}, exchange={self.exchange!r}, "
                f"nbytes={self.nbytes})")  # fmt: skip


def lookup(key: int) -> PushBuffer:
    """The live PushBuffer of ``key`` (custom ops take the key, not the object)."""
    buf = _BUFFERS.get(key)
    if buf is None:
        raise RuntimeError(f"PushBuffer {key} was freed or never existed")
    return buf
