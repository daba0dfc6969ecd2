"""ExpertParallelMoE's routed path as one schedule of exchanges and compute, with its two
overlap options: shared experts (``shared_ffn``: a dense MLP beside the routed experts,
DeepSeek-V3 style) and chunks (``overlap_chunks``: the tokens split in n).

Shapes: T tokens, H hidden, k top-k; chunk c holds rows [start_c, start_c + T_c) of x
(torch.tensor_split: the first T % n chunks one token longer; a chunk may be empty). The
routing runs once on all T tokens; each chunk has its own dispatch D_c, experts E_c and
combine C_c. Issue order (the host's), and the stream each step runs on, on CUDA:

    compute:  route | S.up       E_0        E_1  ...  E_n-1  S.down | cat, + shared
    comm:              D_0   D_1     C_0 D_2    C_1  ...  C_n-1

so D_0 runs while the shared MLP's first half does, D_c+1 while E_c, C_c while E_c+1, and
the last combine while the shared MLP's second half (a shared nn.Module other than the
built-in :class:`SharedMLP` runs whole before D_0). Backward follows from autograd: each
op's backward runs on the stream its forward ran on, and the engine orders the streams
with events where a gradient crosses them, so the shared MLP's and the other chunks'
backward work can run while an exchange's backward does.

Ordering (no host sync added): each hand-over is a CUDA event recorded right after the
producing step and waited by the consuming stream (:class:`Lanes`): comm waits for the
routing (x, ids, weights), E_c for D_c's event (not for C_c-1, issued after it), C_c for
E_c's, and the final sum for the last combine's. Lifetimes: every tensor made on one
stream and read on the other is ``record_stream``-ed on the reader (x, ids, weights and
each E_c's output on comm; each D_c's rows and offsets and each C_c's output on compute),
so the caching allocator hands its memory out again only after the reader's work queued
before the free; tensors a step saves for its backward are read on the stream that made
them, or recorded as above. The gradients that cross streams in backward are autograd's
(its input buffers record them on the consuming stream). The host-synced dispatch's one
read of the counts synchronizes the comm stream only.

On CPU, under torch.compile, with a PushBuffer (whose kernels and buffer serve one
exchange at a time), or with ``layer.overlap_streams = False``, the same steps run in the
same order on one stream: same ops, same bits.

SMs the exchange holds while it runs beside compute (from reading, not measured): NCCL's
all_to_all_single is grouped send/recv, one kernel of one CTA per p2p channel in use (at
most NCCL_MAX_P2P_NCHANNELS; tens of the H100's 132 SMs within a node, fewer across nodes),
held for the whole transfer; the row kernels on the comm stream (the wire encode and decode,
the plan) take whatever SMs are free, in short bursts; the MXFP8 Transport's cast beside its
collective leaves _config.BESIDE_COMM_FREE_SMS to NCCL. Nothing caps the comm stream's share
(DeepEP's set_num_sms has no counterpart here): the GEMMs on the compute stream get what is
left and may be slowed by it.
"""

from __future__ import annotations

import contextlib

import torch

from ..exchange.push import PushBuffer
from . import checks
from .dispatch_static import combine_static, dispatch_static
from .dispatch_synced import combine, dispatch, dispatch_reporting
from .experts import ACTIVATIONS, draw_expert

SHARED_INDEX = -1  # the shared MLP's draw: draw_expert(..., index=-1), apart from experts 0..E-1


class SharedMLP(torch.nn.Module):
    """The built-in shared experts: one dense MLP hidden -> ffn -> hidden on every token,
    ``activation`` "gelu" (w1 [hidden, ffn]) or "swiglu" (w1 [hidden, 2 * ffn], gate then
    up), w2 [ffn, hidden]; Parameters in ``dtype`` (default fp32), used in x's dtype, drawn
    as an expert of index -1 of the layer's seed (the same on every rank). Dense and
    replicated: data parallelism averages them like the router."""

    def __init__(self, hidden: int, ffn: int, activation: str, seed: int, device=None,
                 dtype: torch.dtype | None = None):  # fmt: skip
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.activation, kw = activation, {"device": device, "dtype": dtype or torch.float32}
        width = 2 * ffn if activation == "swiglu" else ffn
        self.w1 = torch.nn.Parameter(torch.empty(hidden, width, **kw))
        self.w2 = torch.nn.Parameter(torch.empty(ffn, hidden, **kw))
        if self.w1.device.type != "meta":
            w1, w2 = draw_expert(hidden, ffn, seed, SHARED_INDEX, activation)
            with torch.no_grad():
                self.w1.copy_(w1)
                self.w2.copy_(w2)

    def extra_repr(self) -> str:
        ffn, hidden = self.w2.shape
        return f"{hidden} -> {ffn} -> {hidden}, {self.activation}"

    def up(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> act(x @ w1) [T, ffn] in x's dtype."""
        h = x @ self.w1.to(x.dtype)
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            return torch.nn.functional.silu(gate) * up
        return torch.nn.functional.gelu(h)

    def down(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, ffn] -> h @ w2 [T, hidden] in h's dtype."""
        return h @ self.w2.to(h.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x))


def build_shared(shared_ffn, hidden, activation, seed, device, dtype) -> torch.nn.Module | None:
    """The layer's ``shared_ffn`` argument as a module (None: no shared experts)."""
    if shared_ffn is None or isinstance(shared_ffn, torch.nn.Module):
        return shared_ffn
    if type(shared_ffn) is not int or shared_ffn < 1:
        raise ValueError(
            "shared_ffn must be None, an int >= 1 (the width of a built-in shared MLP) or an "
            f"nn.Module mapping [T, hidden] to [T, hidden], got {shared_ffn!r}"
        )
    return SharedMLP(hidden, shared_ffn, activation, seed, device, dtype)


def check_chunks(overlap_chunks, transport) -> None:
    """A ValueError naming ``overlap_chunks`` if it is not an int >= 1 or meets a PushBuffer."""
    if type(overlap_chunks) is not int or overlap_chunks < 1:
        raise ValueError(f"overlap_chunks must be an int >= 1, got {overlap_chunks!r}")
    if overlap_chunks > 1 and isinstance(transport, PushBuffer):
        raise ValueError(
            "overlap_chunks > 1 needs transport='nccl' (or 'auto'): a PushBuffer's buffer holds "
            "one exchange at a time"
        )


def shared_term(layer) -> str | None:
    """The layer's shared experts as ranks compare them (moe/terms.py's LAYER table): the
    built-in MLP's width, another module's class, or None."""
    shared = layer.shared
    if isinstance(shared, SharedMLP):
        return str(shared.w2.shape[0])
    return None if shared is None else f"{type(shared).__module__}.{type(shared).__qualname__}"


def chunk_capacity(capacity: int | None, overlap_chunks: int) -> int | None:
    """Each chunk's static capacity: ceil(capacity / n) rows per rank pair (the same wire
    bytes in all as one call; a chunk drops the rows past its own share)."""
    return None if capacity is None else -(-capacity // overlap_chunks)


_COMM_STREAMS: dict[int, torch.cuda.Stream] = {}


class Lanes:
    """The schedule's two streams: ``compute`` (the caller's current stream) and ``comm``
    (one exchange stream per device, kept); both None where the schedule runs on one."""

    def __init__(self, device: torch.device, on: bool):
        self.compute = self.comm = None
        if on:
            index = device.index if device.index is not None else torch.cuda.current_device()
            if index not in _COMM_STREAMS:
                _COMM_STREAMS[index] = torch.cuda.Stream(device=index)
            self.compute, self.comm = torch.cuda.current_stream(index), _COMM_STREAMS[index]

    def exchange(self) -> contextlib.AbstractContextManager:
        """Where the exchange steps run: the comm stream (or the current one)."""
        return torch.cuda.stream(self.comm) if self.comm is not None else contextlib.nullcontext()

    @staticmethod
    def signal(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """An event recorded on ``stream`` now (its work queued so far)."""
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    @staticmethod
    def take(stream, event, *tensors: torch.Tensor) -> None:
        """``stream`` waits for ``event``; ``tensors`` (made on the other stream) are recorded
        on ``stream``, so their memory is reused only after its work queued before the free."""
        if stream is None:
            return
        stream.wait_event(event)
        for t in tensors:
            t.record_stream(stream)


def _dispatch(layer, x, ids, capacity):
    """One chunk's dispatch: (rows [N, H], end offsets int32 [L], handle)."""
    if layer.static:
        ex, offs, handle = dispatch_static(x, ids, layer.num_experts, capacity, layer.group,
                                           exchange=layer.wires, align=layer.align,
                                           transport=layer.transport,
                                           topology=layer.topology)  # fmt: skip
        with torch.no_grad():  # dropped and bad ids add up, the other two are maxima
            s, new = layer.dispatch_stats, handle.stats
            added, peak = s[0::2] + new[0::2], torch.maximum(s[1::2], new[1::2])
            s.copy_(torch.stack([added, peak], 1).view(-1))  # STAT_NAMES' order
        return ex, offs, handle
    ex, _, handle = dispatch(x, ids, layer.num_experts, layer.group, exchange=layer.wires,
                             transport=layer.transport, topology=layer.topology)  # fmt: skip
    return ex, handle.expert_offsets, handle


def _combine(layer, y, weights, handle) -> torch.Tensor:
    return combine_static(y, weights, handle) if layer.static else combine(y, weights, handle)


def _report(layer, x: torch.Tensor, problem: str) -> None:
    """Raise ``problem`` on every rank (as the layer's forward does for a bad x)."""
    if layer.static:
        push = layer.transport if isinstance(layer.transport, PushBuffer) else None
        checks.report(problem, layer.group, push)
        raise ValueError(problem)
    dispatch_reporting(x, None, layer.num_experts, layer.group, layer.wires, layer.transport,
                       problem)  # fmt: skip


def routed_forward(layer, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
    """The layer's output [T, H] in x's dtype from x [T, H], the routing weights [T, k] and
    expert ids [T, k]: the routed experts' combine plus the shared MLP (if any), on the
    module docstring's schedule."""
    n, shared = layer.overlap_chunks, layer.shared
    push = isinstance(layer.transport, PushBuffer)
    on = x.is_cuda and layer.overlap_streams and not push and (shared is not None or n > 1)
    on = on and not torch.compiler.is_compiling()
    lanes = Lanes(x.device, on)
    lanes.take(lanes.comm, lanes.signal(lanes.compute), x, ids, weights)
    xs, ids_c, ws = (torch.tensor_split(t, n) if n > 1 else (t,) for t in (x, ids, weights))
    capacity = chunk_capacity(layer.capacity, n)
    half = whole = None
    if isinstance(shared, SharedMLP):
        half = shared.up(x)
    elif shared is not None:
        whole = shared(x)
        if not isinstance(whole, torch.Tensor) or whole.shape != x.shape:
            got = getattr(whole, "shape", type(whole))
            _report(layer, x, f"shared_ffn must map [T, hidden] to {tuple(x.shape)}, got {got}")
    with lanes.exchange():
        step = _dispatch(layer, xs[0], ids_c[0], capacity)
        ready = lanes.signal(lanes.comm)
    outs = []
    for c in range(n):
        ex, offs, handle = step
        lanes.take(lanes.compute, ready, ex, offs)
        y = layer.experts(ex, offs)
        done = lanes.signal(lanes.compute)
        with lanes.exchange():
            if c + 1 < n:
                step = _dispatch(layer, xs[c + 1], ids_c[c + 1], capacity)
                ready = lanes.signal(lanes.comm)
            lanes.take(lanes.comm, done, y)
            outs.append(_combine(layer, y, ws[c], handle))
    if half is not None:
        whole = shared.down(half)
    lanes.take(lanes.compute, lanes.signal(lanes.comm), *outs)
    routed = torch.cat(outs) if n > 1 else outs[0]
    return routed if whole is None else routed + whole
