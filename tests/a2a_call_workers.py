"""Worker bodies for the exchange tests of how it is called: edge cases (no rows, one row,
NaN and inf), bad input raising on every rank, memory flat over many calls, torch.compile
with fullgraph=True and CUDA graph capture; each runs on every rank of a process group.
"""

from __future__ import annotations

import itertools
import resource

import torch
from a2a_workers import case_kwargs, copy_cases, device_for

import mxfp8_a2a as mx
from mxfp8_a2a._torchrun import capture_graph


def edge_cases(rank, world, backend):
    for case in ("nccl", *copy_cases(device_for(backend), world, 1, 2)):
        _edge_cases(rank, world, backend, case_kwargs(case))


def _edge_cases(rank, world, backend, how):
    dev = device_for(backend)
    # no rows anywhere
    x = torch.zeros(0, 32, device=dev, requires_grad=True)
    out = mx.to_mxfp8_a2a_dequant(x, [0] * world, [0] * world, **how)
    assert out.shape == (0, 32)
    out.sum().backward()
    assert x.grad.shape == (0, 32)
    # a single row, from rank 0 to the last rank
    x = torch.full((1 if rank == 0 else 0, 32), 3.0, device=dev)
    in_splits = [0] * world
    out_splits = [0] * world
    if rank == 0:
        in_splits[world - 1] = 1
    if rank == world - 1:
        out_splits[0] = 1
    out = mx.to_mxfp8_a2a_dequant(x, out_splits, in_splits, **how)
    assert out.shape[0] == (1 if rank == world - 1 else 0)
    # NaN and inf survive in their block
    x = torch.ones(world, 64, device=dev)
    x[:, 1] = float("nan")
    x[:, 40] = float("inf")
    out = mx.to_mxfp8_a2a_dequant(x, [1] * world, [1] * world, **how)
    assert out[:, :32].isnan().all() and out[:, 40].isinf().all()


def bad_input(rank, world, backend):
    """Each bad call raises on every rank before any collective, and the group still works."""
    import pytest

    dev = device_for(backend)
    ones = [1] * world
    x = torch.randn(world, 64, device=dev)
    cases = [
        (lambda: mx.to_mxfp8_a2a_dequant(x, ones, [2] * world), "input_splits sum to"),
        (
            lambda: mx.to_mxfp8_a2a_dequant(x, ones, [-1, 1 + world] + [0] * (world - 2)),
            "non-negative",
        ),
        (lambda: mx.to_mxfp8_a2a_dequant(x, ones + [0], ones), "output_splits has"),
        (lambda: mx.to_mxfp8_a2a_dequant(torch.randn(world, 48, device=dev), ones, ones), r"K=48"),
        (lambda: mx.to_mxfp8_a2a_dequant(x.half(), ones, ones), "bfloat16 or float32"),
        (lambda: mx.to_mxfp8_a2a_dequant(x.view(world, 2, 32), ones, ones), "2-D"),
        (lambda: mx.to_mxfp8_a2a_dequant(x, ones, ones, scaling_mode="up"), "scaling_mode"),
        (lambda: mx.to_mxfp8_a2a_dequant(x, [1.5] * world, ones), "integers"),
        (lambda: mx.to_mxfp8_a2a_dequant(x, ones, ones, transport="ib"), "transport must be"),
        (lambda: mx.to_mxfp8_a2a_dequant(x, ones, [2**63] + [0] * (world - 1)), "2\\*\\*62"),
        (lambda: mx.to_mxfp8_a2a_dequant(x, ones, (2 for _ in ones)), "input_splits sum"),
        (
            lambda: mx.to_mxfp8_a2a_dequant(x, [0 if r == rank else 1 for r in range(world)], ones),
            "to itself",
        ),
    ]
    if dev.type == "cpu":
        ce = mx.CopyEngineTransport()
        call = lambda: mx.to_mxfp8_a2a_dequant(x, ones, ones, transport=ce)  # noqa: E731
        cases.append((call, "needs CUDA tensors .* and a group of two ranks"))
    if dev.type == "cuda":
        cases.append(
            (
                lambda: mx.to_mxfp8_a2a_dequant(
                    x,
                    torch.ones(
                        world, dtype=torch.int64, device="cuda:1" if rank == 0 else "cuda:0"
                    ),
                    ones,
                ),
                "keep the splits",
            )
        )
    for call, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            call()
    # splits that disagree: rank 0 sends 2 rows to rank 1, rank 1 expects 1 -> every rank raises
    in_splits, out_splits = list(ones), list(ones)
    if rank == 0:
        in_splits = [1, 2] + [1] * (world - 2)
    y = torch.randn(sum(in_splits), 64, device=dev)
    with pytest.raises(ValueError, match="splits disagree: rank 0 sends 2 rows to rank 1"):
        mx.to_mxfp8_a2a_dequant(y, out_splits, in_splits, validate=True)
    # what the collective's byte counts depend on, differing between ranks: every rank raises
    z = torch.randn(world, 64 if rank else 96, device=dev)
    with pytest.raises(ValueError, match=r"x.shape\[1\] differs between ranks \(\[96, 64"):
        mx.to_mxfp8_a2a_dequant(z, ones, ones, validate=True)
    with pytest.raises(ValueError, match="x.dtype differs between ranks"):
        mx.to_mxfp8_a2a_dequant(x.to(torch.bfloat16) if rank else x, ones, ones, validate=True)
    with pytest.raises(ValueError, match="scaling_mode differs between ranks"):
        mode = "floor" if rank else "rceil"
        mx.to_mxfp8_a2a_dequant(x, ones, ones, validate=True, scaling_mode=mode)
    # an unknown transport or an int64-overflowing split on one rank only: every rank raises
    bad_how = dict(transport="ib") if rank == 0 else {}
    with pytest.raises(ValueError, match="transport must be" if rank == 0 else "bad arguments"):
        mx.to_mxfp8_a2a_dequant(x, ones, ones, validate=True, **bad_how)
    big = [2**63] + [0] * (world - 1) if rank == 0 else ones
    with pytest.raises(ValueError, match=r"2\*\*62" if rank == 0 else "bad arguments"):
        mx.to_mxfp8_a2a_dequant(x, ones, big, validate=True)
    if dev.type == "cuda" and world == 2:
        with pytest.raises(ValueError, match="transport differs between ranks"):
            how = dict(transport=mx.CopyEngineTransport()) if rank else {}
            mx.to_mxfp8_a2a_dequant(x, ones, ones, validate=True, **how)
    # a bad argument on one rank only: with validate every rank raises
    z = torch.randn(world, 64 if rank else 48, device=dev)
    with pytest.raises(ValueError, match="K=48" if rank == 0 else "bad arguments on rank"):
        if rank == 0:
            mx.to_mxfp8_a2a_dequant(z, ones, ones, validate=True)
        else:
            mx.to_mxfp8_a2a_dequant(z, ones, ones, validate=True)
    # the group is still usable
    out = mx.to_mxfp8_a2a_dequant(x, ones, ones)
    assert out.shape == (world, 64)


def memory_flat(rank, world, backend, calls):
    dev = device_for(backend)
    x = torch.randn(4 * world, 64, device=dev, requires_grad=True)
    splits = [4] * world

    def step():
        mx.to_mxfp8_a2a_dequant(x, splits, splits).sum().backward()

    for _ in range(200):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(calls):
        step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB


def compiled(rank, world, backend):
    """A compiled function calling the exchange traces with fullgraph=True, forward and
    backward, and matches eager bit for bit, for bf16 and fp32 rows (fp32: the dequantize
    returns its rows in their own dtype, which torch 2.11 compiled into zero gradients);
    with backward="bf16" the gradient comes back unquantized (2 * the dequantized rows,
    exactly)."""
    dev = device_for(backend)
    splits = [2] * world
    for dtype, backward in itertools.product((torch.bfloat16, torch.float32), ("mxfp8", "bf16")):

        def step(x, backward=backward):
            y = mx.to_mxfp8_a2a_dequant(x, splits, splits, backward=backward)
            return y.float().pow(2).sum()

        compiled_step = torch.compile(
            step, fullgraph=True, backend="inductor" if dev.type == "cuda" else "aot_eager"
        )
        x = torch.randn(2 * world, 64, device=dev, dtype=dtype)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        step(xa).backward()
        loss = compiled_step(xb)
        loss.backward()
        assert torch.equal(xa.grad, xb.grad), (dtype, backward)
        if backward == "bf16":
            assert torch.equal(xa.grad, 2 * mx.quantize_dequantize_reference(x))


def _graph_replays(rank, world, g, kept):
    k = 1024
    in_splits = [int(v) for v in torch.randint(0, 600, (world,), generator=g)]
    in_splits[rank] = kept
    out_splits = mx.compute_output_splits(in_splits)
    x = torch.empty(sum(in_splits), k, device="cuda", dtype=torch.bfloat16)
    xg = torch.empty_like(x, requires_grad=True)
    grad = torch.empty(sum(out_splits), k, device="cuda", dtype=torch.bfloat16)

    def refill():
        for t in (x, xg.data, grad):
            t.copy_(torch.randn(t.shape, generator=g).mul(100).to(t))

    def fwd():
        with torch.no_grad():
            return mx.to_mxfp8_a2a_dequant(x, out_splits, in_splits)

    def fwd_bwd():
        xg.grad = None
        y = mx.to_mxfp8_a2a_dequant(xg, out_splits, in_splits)
        y.backward(grad)
        return y, xg.grad

    refill()
    graph_f, out = capture_graph(fwd, warmup=2)
    graph_b, (y, gx) = capture_graph(fwd_bwd, warmup=2)
    for _ in range(2):
        refill()
        graph_f.replay()
        graph_b.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fwd()), kept
        y_eager, gx_eager = fwd_bwd()
        assert torch.equal(y, y_eager) and torch.equal(gx, gx_eager), kept
    return x, in_splits, out_splits


def graph_capture(rank, world, backend, seed):
    """Forward and forward+backward captured in CUDA graphs: a replay on new data matches
    the eager call bit for bit (uneven splits; the rows a rank sends itself first many
    enough to take the round-trip path, beside an asynchronous collective, then few, on the
    wire, the collective then on the caller's stream);
    calls that would synchronize raise a clear error under capture."""
    import pytest

    g = torch.Generator().manual_seed(seed + rank)
    for kept in (4200, 3):  # 4200 * 1024 elements: over KEEP_LOCAL_MIN_ELEMENTS
        x, in_splits, out_splits = _graph_replays(rank, world, g, kept)
    for bad, match in (
        (dict(validate=True), "validate=False"),
        (dict(output_splits=torch.tensor(out_splits, device="cuda")), "list of ints"),
    ):
        args = dict(output_splits=out_splits) | bad
        splits = args.pop("output_splits")
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(ValueError, match=match), torch.cuda.graph(graph):
            mx.to_mxfp8_a2a_dequant(x, splits, in_splits, **args)


def public_fallbacks(rank, world, backend):
    """Without the process group's alltoall_base binding (the public all_to_all_single) and
    without torch's functional collectives (a graph break under torch.compile, the eager
    transport), the exchange and the bf16 exchange give the same bits as with them."""
    from mxfp8_a2a.exchange import api, nccl, plain

    dev = device_for(backend)
    g = torch.Generator().manual_seed(rank)
    splits = [3] * world
    x = (torch.randn(3 * world, 64, generator=g) * 8).to(dev)
    grad = torch.randn(3 * world, 64, generator=g).to(dev)

    def run(fn):
        xx = x.clone().requires_grad_()
        out = fn(xx)
        out.backward(grad)
        return out.detach(), xx.grad

    def mxfp8(t):
        return mx.to_mxfp8_a2a_dequant(t, splits, splits)

    def bf16(t):
        return plain.all_to_all_rows(t, splits, splits)

    want = [run(mxfp8), run(bf16)]
    binding = nccl._binding
    nccl._binding = lambda pg: None
    try:
        got = [run(mxfp8), run(bf16)]
    finally:
        nccl._binding = binding
    api.HAS_FUNCOL = plain.HAS_FUNCOL = False
    try:
        got_compiled = [run(torch.compile(f, backend="aot_eager")) for f in (mxfp8, bf16)]
    finally:
        api.HAS_FUNCOL = plain.HAS_FUNCOL = True
    for results in (got, got_compiled):
        for a, b in zip(results, want, strict=True):
            assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
