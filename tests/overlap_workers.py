"""Worker bodies for the overlap tests (tests/test_overlap.py): ExpertParallelMoE with shared
experts (shared_ffn) and chunks (overlap_chunks) against the serial layer: the same layer
without them, plus the shared MLP applied to the same x."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from a2a_workers import device_for

import mxfp8_a2a as mx
from mxfp8_a2a.exchange.wires import EXCHANGES
from mxfp8_a2a.moe.layer import ExpertParallelMoE

HIDDEN, FFN, SHARED = 64, 32, 48
TOP_K = 2


def tokens_of(rank: int) -> int:
    """Tokens on ``rank``: 7, 8, 9, ... (7 divides by neither 2 nor 3; ranks differ)."""
    return 7 + rank


def _layer(world, dev, seed, exchange, static, node, **kw) -> ExpertParallelMoE:
    most = tokens_of(world - 1)
    extra = dict(capacity=2 * most * TOP_K) if static else {}  # (room for every row)
    topology = mx.NodeTopology(None, 1) if node else None
    return ExpertParallelMoE(HIDDEN, FFN, 2 * world, TOP_K, exchange=exchange, seed=seed,
                             topology=topology, **extra, **kw).to(dev)  # fmt: skip


def _run(layer, x, g):
    x = x.clone().requires_grad_(True)
    out = layer(x)
    (out * g).sum().backward()
    return out.detach(), x.grad


def _rowwise_mm(x, w, offs, precision="bf16", fp8_weights=None):
    """grouped_mm one row at a time (every product [1, K] @ [K, N]): a row's result does
    not depend on the other rows, as the CPU's GEMMs do not promise (their kernels pick by
    M). Rows past offs[-1] give zeros."""
    ends = offs.tolist()
    bounds = zip([0, *ends[:-1]], ends, strict=True)
    rows = [x[i : i + 1] @ w[e] for e, (lo, hi) in enumerate(bounds) for i in range(lo, hi)]
    rows.append(x.new_zeros(x.shape[0] - (ends[-1] if ends else 0), w.shape[-1]))
    return torch.cat(rows)


@contextlib.contextmanager
def _row_independent_gemm():
    from mxfp8_a2a.moe import experts

    kept = experts.grouped_mm
    experts.grouped_mm = _rowwise_mm
    try:
        yield
    finally:
        experts.grouped_mm = kept


def _user_mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(HIDDEN, SHARED), torch.nn.GELU(), torch.nn.Linear(SHARED, HIDDEN)
    )


def overlap_equals_serial(rank, world, backend, seed, static, node):
    """For every wire preset and n = 1, 2, 3 (with the built-in shared MLP, a user module,
    SwiGLU, or none): output, x's, the router's and the shared MLP's gradients bit-equal to
    the serial layer's (its shared MLP a copy of the layer's), the experts' gradients too at
    n = 1. At n > 1 the experts' GEMMs run on a row-independent stand-in (on the CPU a row
    of torch's GEMM may change with the rows beside it) and their weights' gradients, a sum
    of per-chunk GEMMs, are within 1e-5 relative. Then the same cases on torch's own GEMMs
    with the bf16 preset, where n > 1 is only bounded (1e-5 relative). Returns the largest
    relative difference seen with torch's GEMMs."""
    with _row_independent_gemm():
        _compare(rank, world, backend, seed, static, node, exact=True)
    return _compare(rank, world, backend, seed, static, node, exact=False)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def _compare(rank, world, backend, seed, static, node, exact: bool) -> float:
    dev = device_for(backend)
    g = torch.Generator().manual_seed(seed * 10 + rank)
    x = torch.randn(tokens_of(rank), HIDDEN, generator=g).to(dev)
    grad = torch.randn(tokens_of(rank), HIDDEN, generator=g).to(dev)
    worst = 0.0
    cases = [(1, SHARED, "gelu"), (2, "module", "gelu"), (3, SHARED, "swiglu"), (3, None, "gelu")]
    # torch's own GEMMs (exact=False): a row's fp32 result may change with the rows beside
    # it, and an MXFP8 leg turns such a last-bit change into a whole e4m3 step wherever it
    # crosses a rounding boundary (seen: 1.08e-5 of the max), so the 1e-5 bound is one of
    # fp32 reassociation: unquantized legs only (every preset is bit-exact with exact=True)
    for exchange in EXCHANGES if exact else ("bf16",):
        for n, shared, activation in cases:
            kw = dict(activation=activation)
            ffn = _user_mlp(seed).to(dev) if shared == "module" else shared
            layer = _layer(world, dev, seed, exchange, static, node, shared_ffn=ffn,
                           overlap_chunks=n, **kw)  # fmt: skip
            serial = _layer(world, dev, seed, exchange, static, node, **kw)
            shared_copy = copy.deepcopy(layer.shared)
            out, gx = _run(layer, x, grad)
            xs = x.clone().requires_grad_(True)
            ref = serial(xs)
            if shared_copy is not None:
                ref = ref + shared_copy(xs)
            (ref * grad).sum().backward()
            what = f"rank {rank}, {exchange}, n={n}, shared={shared}, exact={exact}"
            pairs = [(out, ref.detach()), (gx, xs.grad), (layer.router.grad, serial.router.grad)]
            if shared_copy is not None:
                params = zip(layer.shared.parameters(), shared_copy.parameters(), strict=True)
                pairs += [(a.grad, b.grad) for a, b in params]
            pairs = [(a, b, True) for a, b in pairs]  # (bit-equal with a row-independent GEMM)
            pairs += [(layer.w1.grad, serial.w1.grad, False)]
            pairs += [(layer.w2.grad, serial.w2.grad, False)]
            for a, b, per_token in pairs:
                if n == 1 or (exact and per_token):
                    assert torch.equal(a, b), what
                rel = _relative(a, b)
                assert rel <= 1e-5, (what, rel)
                worst = max(worst, rel)
            if static:
                assert layer.read_dispatch_stats()["dropped"] == 0, what
    return worst


def settings_differ(rank, world, backend):
    """Ranks that disagree on overlap_chunks or shared_ffn: the same ValueError on every
    rank at the first forward, before any exchange. Returns the messages."""
    dev = device_for(backend)
    messages = []
    for kw in (dict(overlap_chunks=1 + (rank == 1)), dict(shared_ffn=SHARED if rank else None)):
        layer = _layer(world, dev, 0, "mxfp8", False, False, **kw)
        try:
            layer(torch.randn(5, HIDDEN, device=dev))
        except ValueError as e:
            messages.append(str(e))
        else:
            raise AssertionError(f"no error for {kw}")
    dist.barrier()
    return messages


def shared_is_dense(rank, world, backend):
    """The shared MLP is an ordinary dense module: prepare_ddp leaves it to DDP (not in the
    ignore list), the state dict holds it as plain tensors (the experts as DTensors)."""
    from torch.distributed.tensor import DTensor

    dev = device_for(backend)
    model = torch.nn.Sequential(_layer(world, dev, 0, "mxfp8", False, False, shared_ffn=SHARED))
    mx.prepare_ddp(model)
    ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    assert "0.experts.w1" in ignored and not any("shared" in name for name in ignored), ignored
    state = model.state_dict()
    assert isinstance(state["0.experts.w1"], DTensor)
    assert not isinstance(state["0.shared.w1"], DTensor)
    assert not isinstance(state["0.shared.w2"], DTensor)
    return sorted(name for name in state if "shared" in name)


def compiled_equals_eager(rank, world, backend, seed):
    """The static layer with shared experts and 2 chunks under torch.compile(fullgraph=True)
    (one stream: the schedule's steps in order) against eager: output and x's gradient
    close (Inductor fuses and reorders sums, so not bit for bit)."""
    dev = device_for(backend)
    layer = _layer(world, dev, seed, "bf16", True, False, shared_ffn=SHARED, overlap_chunks=2)
    eager = copy.deepcopy(layer)
    x = torch.randn(tokens_of(rank), HIDDEN, generator=torch.Generator().manual_seed(seed))
    out, gx = _run(torch.compile(layer, fullgraph=True), x.to(dev), torch.ones_like(x))
    ref, gref = _run(eager, x.to(dev), torch.ones_like(x))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gx, gref, rtol=1e-4, atol=1e-5)
