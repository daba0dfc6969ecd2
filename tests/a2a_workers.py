"""Worker bodies for the exchange tests of the data it delivers, and the helpers the other
worker modules share; each worker runs on every rank of a process group. Exact forward and
backward (small, large and repeated calls), routing, SQNR against a bf16 exchange; the edge
cases, bad input, memory, torch.compile and CUDA graph workers are in a2a_call_workers.py.

Data is drawn from a seed the test passes in (fresh per run), so any rank can rebuild what
every other rank sent and check its own output bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from helpers import sqnr_db

import mxfp8_a2a as mx


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


def case_kwargs(case: str) -> dict:
    """Keyword arguments of a case: "nccl" (the default transport) or "copy R" (a
    CopyEngineTransport in R row ranges per direction, R an int or "auto")."""
    if case == "nccl":
        return {}
    r = case.split()[1]
    return dict(transport=mx.CopyEngineTransport(row_ranges=None if r == "auto" else int(r)))


def copy_cases(dev, world, *ranges) -> list[str]:
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
    for case in ("nccl", *copy_cases(dev, world, 1, 3)):
        x = make_x(rank).requires_grad_(True)
        x_before = x.detach().clone()
        out = mx.to_mxfp8_a2a_dequant(
            x, torch.tensor(out_splits), in_splits, scaling_mode=mode, validate=True,
            **case_kwargs(case),
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
    for case in ("nccl", *copy_cases(dev, world, 1, 4, "auto")):
        x = make_x(rank).requires_grad_(True)
        out = mx.to_mxfp8_a2a_dequant(x, out_splits, in_splits, **case_kwargs(case))
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
    for case in ("nccl", *copy_cases(dev, world, 1, 2)):
        out_splits = [s[i][rank] for i in range(world)]
        out = mx.to_mxfp8_a2a_dequant(x, out_splits, s[rank], **case_kwargs(case))
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


def plain_exchange(rank, world, backend, seed):
    """exchange.plain.all_to_all_rows (the benchmarks' bf16 baseline): every rank's rows arrive
    in rank order, unchanged, in their dtype; the gradient is the swapped exchange, and the
    backward is itself differentiable (double backward)."""
    from mxfp8_a2a.exchange.plain import all_to_all_rows

    dev = device_for(backend)
    s = split_matrix(world, seed)
    out_splits = [s[src][rank] for src in range(world)]
    t = [[s[d][r] for d in range(world)] for r in range(world)]  # splits swapped

    def make_x(src):
        return rank_input(src, sum(s[src]), 40, torch.bfloat16, seed, dev)

    def make_w(dst):
        return rank_input(dst, sum(t[dst]), 40, torch.bfloat16, seed + 7, dev)

    def received(rank, s, make):
        return torch.cat([make(src)[sum(s[src][:rank]) :][: s[src][rank]] for src in range(world)])

    x = make_x(rank).requires_grad_(True)
    out = all_to_all_rows(x, out_splits, s[rank])
    assert out.dtype == x.dtype and torch.equal(out.detach(), received(rank, s, make_x))
    w = make_w(rank).requires_grad_(True)
    (grad,) = torch.autograd.grad(out, x, w, create_graph=True)
    assert torch.equal(grad.detach(), received(rank, t, make_w))
    (grad * grad).sum().backward()  # d/dw |A^T w|^2 = 2 A A^T w = 2 w (A: a permutation)
    assert torch.equal(w.grad, 2 * w.detach())
    with torch.no_grad():
        assert torch.equal(all_to_all_rows(x, out_splits, s[rank]), out.detach())
