"""Worker bodies for the exchange tests; each runs on every rank of a process group.

Data is drawn from a seed the test passes in (fresh per run), so any rank can rebuild what
every other rank sent and check its own output bit for bit.
"""

from __future__ import annotations

import resource

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from helpers import sqnr_db

import mxfp8_a2a as mx
from mxfp8_a2a._torchrun import capture_graph


def device_for(backend: str) -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )


def split_matrix(
    world: int, seed: int, max_rows: int = 9, zero_rank: bool = True, zeros: bool = True
) -> list[list[int]]:
    """S[src][dst] rows src sends to dst, uneven. With ``zeros`` some pairs send nothing and,
    with ``zero_rank``, rank world-1 sends nothing at all; without, every pair sends >= 1."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0 if zeros else 1, max_rows + 1, (world, world), generator=g)
    if zeros:
        s[s % 4 == 1] = 0
        if zero_rank:
            s[world - 1, :] = 0
    return s.tolist()


def rank_input(src: int, rows: int, k: int, dtype, seed: int, device) -> torch.Tensor:
    """The x rank ``src`` sends: random rows of many magnitudes."""
    g = torch.Generator().manual_seed(seed * 1000 + src)
    x = torch.randn(rows, k, generator=g) * torch.exp2(
        torch.randint(-8, 9, (rows, 1), generator=g).float()
    )
    return x.to(dtype).to(device)


def expected_rows(rank: int, s: list[list[int]], make, mode: str = "rceil") -> torch.Tensor:
    """What ``rank`` must receive: from each source, in order, dequantize(quantize(rows))."""
    parts = []
    for src in range(len(s)):
        x = make(src)
        start = sum(s[src][:rank])
        rows = x[start : start + s[src][rank]].cpu()
        parts.append(mx.dequantize_reference(*mx.quantize_reference(rows, mode), rows.dtype))
    return torch.cat(parts)


def _how(case: str) -> dict:
    """Keyword arguments of a case: "nccl" (the default transport) or "copy R" (a
    CopyEngineTransport in R row ranges per direction, R an int or "auto")."""
    if case == "nccl":
        return {}
    r = case.split()[1]
    return dict(transport=mx.CopyEngineTransport(row_ranges=None if r == "auto" else int(r)))


def _copies(dev, world, *ranges) -> list[str]:
    """The copy-engine cases where that transport can run (CUDA, two ranks)."""
    return [f"copy {r}" for r in ranges] if dev.type == "cuda" and world == 2 else []


def exact_forward_backward(rank, world, backend, seed, k, dtype, mode):
    dev = device_for(backend)
    s = split_matrix(world, seed)
    in_splits = s[rank]
    out_splits = [s[src][rank] for src in range(world)]
    assert mx.compute_output_splits(in_splits) == out_splits

    def make_x(src):
        return rank_input(src, sum(s[src]), k, dtype, seed, dev)

    def make_w(dst):  # the upstream gradient on rank dst
        return rank_input(dst, sum(s[i][dst] for i in range(world)), k, dtype, seed + 7, dev)

    t = [[s[d][r] for d in range(world)] for r in range(world)]  # splits swapped
    want_out = expected_rows(rank, s, make_x, mode)
    want_grad = expected_rows(rank, t, make_w, mode)
    # NCCL/gloo; on CUDA the copy-engine transport, whole and in 3 row ranges (some empty)
    for case in ("nccl", *_copies(dev, world, 1, 3)):
        x = make_x(rank).requires_grad_(True)
        x_before = x.detach().clone()
        out = mx.to_mxfp8_a2a_dequant(
            x, torch.tensor(out_splits), in_splits, scaling_mode=mode, validate=True,
            **_how(case),
        )  # fmt: skip
        assert out.dtype == dtype and out.shape == (sum(out_splits), k)
        assert torch.equal(out.detach().cpu(), want_out), case
        out.backward(make_w(rank))
        assert torch.equal(x.grad.cpu(), want_grad), case
        assert torch.equal(x.detach(), x_before)  # input untouched


def exact_large(rank, world, backend, seed):
    """Thousands of rows per pair, K = 1024: the kept rows reach KEEP_LOCAL_MIN_ELEMENTS on
    CUDA (round-trip kernel beside the collective)."""
    from mxfp8_a2a import _config

    dev = device_for(backend)
    k = 1024
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(1, 2000, (world, world), generator=g)
    s.fill_diagonal_(_config.KEEP_LOCAL_MIN_ELEMENTS // k + int(s[0, 0]))
    s = s.tolist()
    in_splits, out_splits = s[rank], [s[src][rank] for src in range(world)]

    def make_x(src):
        return rank_input(src, sum(s[src]), k, torch.bfloat16, seed, dev)

    def make_g(dst):  # the upstream gradient on rank dst
        rows = sum(s[i][dst] for i in range(world))
        return rank_input(dst, rows, k, torch.bfloat16, seed + 7, dev)

    want_out = expected_rows(rank, s, make_x)
    t = [[s[d][r] for d in range(world)] for r in range(world)]
    want_grad = expected_rows(rank, t, make_g)
    grad = make_g(rank)
    for case in ("nccl", *_copies(dev, world, 1, 4, "auto")):
        x = make_x(rank).requires_grad_(True)
        out = mx.to_mxfp8_a2a_dequant(x, out_splits, in_splits, **_how(case))
        assert torch.equal(out.detach().cpu(), want_out), case
        out.backward(grad)
        assert torch.equal(x.grad.cpu(), want_grad), case


def repeated_calls(rank, world, backend, seed):
    """The same shapes and splits, called again and again on new data (on CUDA the second
    call records the launches and later calls replay them): every forward and backward
    exact; K = 1024, the rows a rank sends itself first above KEEP_LOCAL_MIN_ELEMENTS (kept
    off the wire, round trip), then a few (on the wire, also for a group of one rank); the
    fifth call takes x as a view 2 bytes off 16-byte alignment (its own plan)."""

    from mxfp8_a2a import _config

    dev = device_for(backend)
    k = 1024
    g = torch.Generator().manual_seed(seed)
    for diagonal in (_config.KEEP_LOCAL_MIN_ELEMENTS // k + 5, 3):
        s = torch.randint(0, 300, (world, world), generator=g)
        s.fill_diagonal_(diagonal)
        _repeat(rank, world, s.tolist(), k, seed + diagonal, dev)


def _repeat(rank, world, s, k, seed, dev):
    in_splits, out_splits = s[rank], [s[src][rank] for src in range(world)]
    t = [[s[d][r] for d in range(world)] for r in range(world)]
    for call in range(5):
        step = seed + 100 * call

        def make_x(src, step=step):
            return rank_input(src, sum(s[src]), k, torch.bfloat16, step, dev)

        def make_g(dst, step=step):
            rows = sum(s[i][dst] for i in range(world))
            return rank_input(dst, rows, k, torch.bfloat16, step + 7, dev)

        x = make_x(rank)
        if call == 4:  # a view whose rows start 2 bytes past a 16-byte boundary
            wide = torch.empty(x.shape[0], k + 1, dtype=x.dtype, device=dev)
            wide[:, 1:] = x
            x = wide[:, 1:]
        x.requires_grad_(True)
        out = mx.to_mxfp8_a2a_dequant(x, out_splits, in_splits)
        assert torch.equal(out.detach().cpu(), expected_rows(rank, s, make_x)), call
        out.backward(make_g(rank))
        assert torch.equal(x.grad.cpu(), expected_rows(rank, t, make_g)), call


def routing(rank, world, backend, seed):
    """Rows encode (source, destination, index) exactly in e4m3; every row lands right."""
    dev = device_for(backend)
    s = split_matrix(world, seed, max_rows=40)
    k = 64

    def encode(src):
        rows = []
        for dst in range(world):
            for i in range(s[src][dst]):
                r = torch.zeros(k)
                r[0], r[1] = src + 1, dst + 1
                r[2:8] = torch.tensor([(i >> b) & 1 for b in range(6)], dtype=torch.float32)
                r[32:] = torch.randn(32)
                rows.append(r)
        return torch.stack(rows) if rows else torch.zeros(0, k)

    x = encode(rank).to(torch.bfloat16).to(dev)
    for case in ("nccl", *_copies(dev, world, 1, 2)):
        out_splits = [s[i][rank] for i in range(world)]
        out = mx.to_mxfp8_a2a_dequant(x, out_splits, s[rank], **_how(case))
        check_routing(out.float().cpu(), s, rank, world)


def check_routing(out, s, rank, world):
    row = 0
    for src in range(world):
        for i in range(s[src][rank]):
            assert out[row, 0] == src + 1 and out[row, 1] == rank + 1, (row, out[row, :2])
            got = sum(int(out[row, 2 + b]) << b for b in range(6))
            assert got == i, (src, i, got)
            row += 1
    assert row == out.shape[0]


def sqnr_vs_bf16(rank, world, backend, seed):
    dev = device_for(backend)
    s = split_matrix(world, seed, max_rows=64, zeros=False)  # every rank gets rows
    out_splits = [s[i][rank] for i in range(world)]
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(sum(s[rank]), 256, generator=g).to(torch.bfloat16).to(dev)
    w = torch.randn(sum(out_splits), 256, generator=g).to(torch.bfloat16).to(dev)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = funcol.all_to_all_single_autograd(xa, out_splits, s[rank], dist.group.WORLD)
    ref = funcol.wait_tensor(ref)
    (ref.float() * w.float()).sum().backward()
    out = mx.to_mxfp8_a2a_dequant(xb, out_splits, s[rank])
    (out.float() * w.float()).sum().backward()

    return sqnr_db(ref.detach(), out.detach()), sqnr_db(xa.grad, xb.grad)


def edge_cases(rank, world, backend):
    for case in ("nccl", *_copies(device_for(backend), world, 1, 2)):
        _edge_cases(rank, world, backend, _how(case))


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
    with pytest.raises(ValueError, match=r"x.shape\[1\] \(K\) differs between ranks"):
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
    backward, and matches eager bit for bit."""
    dev = device_for(backend)
    splits = [2] * world

    def step(x):
        return mx.to_mxfp8_a2a_dequant(x, splits, splits).float().pow(2).sum()

    compiled_step = torch.compile(
        step, fullgraph=True, backend="inductor" if dev.type == "cuda" else "aot_eager"
    )
    x = torch.randn(2 * world, 64, device=dev, dtype=torch.bfloat16)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    step(xa).backward()
    loss = compiled_step(xb)
    loss.backward()
    assert torch.equal(xa.grad, xb.grad)


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
