"""Worker bodies for the robustness tests of the exchange: bad input on one rank, ranks that
disagree, double backward, validate on one rank only. Each runs on every rank of a gloo
group (NCCL where a test asks for it)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from a2a_workers import device_for, split_matrix

import mxfp8_a2a as mx
from mxfp8_a2a.exchange import checks
from mxfp8_a2a.exchange.nccl import NcclTransport


def same_error(call, match: str, group=None) -> str:
    """``call`` raises a ValueError/TypeError matching ``match`` here, and the same error
    (type and message) on every rank of ``group`` (each rank calls this alike)."""
    with pytest.raises((ValueError, TypeError), match=match) as info:
        call()
    mine = (type(info.value).__name__, str(info.value))
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    assert all(m == mine for m in every), every
    return mine[1]


class Renamed(NcclTransport):
    """Another kind of transport that moves the same bytes as "nccl"."""

    name = "renamed"


class WithSetting(NcclTransport):
    def __init__(self, value):
        self.value = value

    def setting(self):
        return self.value


class Broken(NcclTransport):
    def check(self, device, group):
        raise RuntimeError("broken transport: no link to the peers")


def exchange_errors(rank, world, backend):
    """Bad input on one rank only, or ranks that disagree, with validate=True: the same
    error on every rank, naming the rank, the argument and the fix; then the group works."""
    dev = device_for(backend)
    ones = [1] * world
    x = torch.randn(world, 64, device=dev)
    a2a = mx.to_mxfp8_a2a_dequant

    def on(r, bad, good):
        return bad if rank == r else good

    # an unknown transport, or one whose check raises something other than a ValueError
    same_error(
        lambda: a2a(x, ones, ones, validate=True, transport=on(0, "ib", "nccl")),
        r"bad arguments on rank\(s\) \[0\] of the group: rank 0: transport must be 'nccl'",
    )
    same_error(
        lambda: a2a(x, ones, ones, validate=True, transport=on(1, Broken(), "nccl")),
        r"rank\(s\) \[1\] .*rank 1: broken transport: no link",
    )
    # counts that overflow int64, negative, float, bool, or a wrong number of them
    big = [2**63] + [0] * (world - 1)
    same_error(
        lambda: a2a(x, ones, on(0, big, ones), validate=True),
        r"rank 0: input_splits\[0\] = 9223372036854775808; row counts must be non-negative "
        r"and below 2\*\*62",
    )
    same_error(
        lambda: a2a(x, on(world - 1, [2**64] * world, ones), ones, validate=True),
        rf"rank {world - 1}: output_splits\[0\] = 18446744073709551616",
    )
    same_error(
        lambda: a2a(x, ones, on(1, [1.0] * world, ones), validate=True),
        r"rank 1: input_splits must hold integers",
    )
    same_error(
        lambda: a2a(x, ones, on(0, torch.ones(world, dtype=torch.bool), ones), validate=True),
        r"rank 0: input_splits must be a 1-D integer tensor .*not bool",
    )
    # a transport setting that does not fit the validation payload
    same_error(
        lambda: a2a(x, ones, ones, validate=True, transport=on(1, WithSetting(2**63), "nccl")),
        r"rank 1: transport.setting\(\) of WithSetting must be an int in \[0, 2\*\*62\)",
    )
    # what the byte counts (or a backward) depend on, differing between ranks
    same_error(
        lambda: a2a(x, ones, ones, validate=True, transport=on(0, Renamed(), "nccl")),
        r"transport differs between ranks \(\[robustness_workers.Renamed, mxfp8_a2a.exchange.nccl",
    )
    same_error(
        lambda: a2a(x, ones, ones, validate=True, transport=WithSetting(on(1, 3, 2))),
        r"transport setting differs between ranks \(\[2, 3",
    )
    same_error(
        lambda: a2a(on(0, x.clone().requires_grad_(), x), ones, ones, validate=True),
        r"x.requires_grad differs between ranks \(\[True, False.*make x require grad on "
        r"every rank or on none",
    )
    z = torch.randn(world, on(2, 96, 64), device=dev)
    same_error(
        lambda: a2a(z, ones, ones, validate=True),
        r"x.shape\[1\] differs between ranks \(\[64, 64, 96",
    )
    # a receiver that expects more rows than are sent (without validate: undefined rows)
    more = on(1, [2] + [1] * (world - 1), ones)
    same_error(
        lambda: a2a(x, more, ones, validate=True),
        r"splits disagree: rank 0 sends 1 rows to rank 1 \(input_splits\[1\] on rank 0\) but "
        r"rank 1 expects 2 \(output_splits\[0\] on rank 1\); compute output_splits with",
    )
    # two bad ranks at once: both named, on every rank
    same_error(
        lambda: a2a(x, ones, on(0, [-1] * world, on(2, "xx", ones)), validate=True),
        r"rank\(s\) \[0, 2\] .*rank 0: input_splits\[0\] = -1.*; rank 2: input_splits must be a",
    )
    _output_splits_errors(rank, world)
    _non_member(rank, world, dev)
    # the group still works, and splits given as generators are fine (kept for the backward)
    xg = x.clone().requires_grad_()
    out = a2a(xg, (v for v in ones), iter(ones), validate=True)
    out.sum().backward()
    assert out.shape == (world, 64) and torch.equal(xg.grad, torch.ones_like(x))


def _output_splits_errors(rank, world):
    """compute_output_splits: bad counts on one rank raise the same error on every rank."""
    s = split_matrix(world, 5)
    want = [s[src][rank] for src in range(world)]

    def on(r, bad):
        return bad if rank == r else s[rank]

    cos = mx.compute_output_splits
    same_error(lambda: cos(on(1, [-1] + s[rank][1:])), r"rank 1: input_splits\[0\] = -1")
    same_error(lambda: cos(on(0, [1.5] * world)), r"rank 0: input_splits must hold integers")
    same_error(lambda: cos(on(2, [1.0] * world)), r"rank 2: input_splits must hold integers")
    same_error(lambda: cos(on(0, [1] * (world + 1))), rf"input_splits has {world + 1} entries")
    same_error(lambda: cos(on(1, [2**63] * world)), r"rank 1: input_splits\[0\] = 9223372036")
    assert cos(v for v in s[rank]) == want  # a generator
    assert cos(torch.tensor(s[rank], dtype=torch.int32)) == want


def _non_member(rank, world, dev):
    """A group this rank is not in: a ValueError naming the group on that rank (it takes
    part in no collective); the members exchange as usual."""
    sub = dist.new_group([0, 1])
    x = torch.randn(2, 64, device=dev)
    if rank >= 2:
        for call in (
            lambda: mx.to_mxfp8_a2a_dequant(x, [1, 1], [1, 1], sub, validate=True),
            lambda: mx.compute_output_splits([1, 1], sub),
            lambda: mx.dispatch(x, torch.zeros(2, 1, dtype=torch.long), 2, sub),
        ):
            with pytest.raises(ValueError, match="not a member of `group`"):
                call()
    else:
        assert mx.compute_output_splits([1, 1], sub) == [1, 1]
        assert mx.to_mxfp8_a2a_dequant(x, [1, 1], [1, 1], sub, validate=True).shape == (2, 64)
    dist.barrier()


def _plain(t, out_splits, in_splits):
    return funcol.wait_tensor(
        funcol.all_to_all_single_autograd(t, out_splits, in_splits, dist.group.WORLD)
    )


def double_backward(rank, world, seed):
    """Gradients of gradients (create_graph=True) match all_to_all_single_autograd's."""
    s = split_matrix(world, seed)
    ins, outs = s[rank], [s[src][rank] for src in range(world)]
    g = torch.Generator().manual_seed(seed + rank)
    for dtype in (torch.float32, torch.bfloat16):
        # integers of at most 3 significant bits: every MXFP8 pass is exact, so the results
        # equal the plain exchange's bit for bit (a nonlinear loss: y enters twice)
        x = torch.randint(-8, 9, (sum(ins), 64), generator=g).to(dtype)
        w = torch.randint(-2, 3, (sum(outs), 64), generator=g).to(dtype)
        v = torch.randint(-8, 9, x.shape, generator=g).to(dtype)
        results = []
        for f in (mx.to_mxfp8_a2a_dequant, _plain):
            xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = f(xx, outs, ins)
            (gx,) = torch.autograd.grad((y * y * ww).sum(), xx, create_graph=True)
            assert gx.requires_grad
            results.append((gx.detach(), *torch.autograd.grad((gx * v).sum(), (xx, ww))))
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b), (a - b).abs().max()
        # any data: d/dw <grad_x (y . w), v> is the exchange of v, each row
        # dequantize(quantize(row)) of what the plain exchange gives
        x = torch.randn(sum(ins), 64, generator=g).to(dtype).requires_grad_()
        w = torch.randn(sum(outs), 64, generator=g).to(dtype).requires_grad_()
        v = torch.randn(x.shape, generator=g).to(dtype)
        (gx,) = torch.autograd.grad(
            (mx.to_mxfp8_a2a_dequant(x, outs, ins) * w).sum(), x, create_graph=True
        )
        assert torch.equal(gx, mx.quantize_dequantize_reference(_plain(w.detach(), ins, outs)))
        (gw,) = torch.autograd.grad((gx * v).sum(), w)
        assert torch.equal(gw, mx.quantize_dequantize_reference(_plain(v, outs, ins)))


def _outcome(call) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        call()
        return "ok", "", time.monotonic() - start
    except Exception as e:
        return type(e).__name__, str(e)[:300], time.monotonic() - start


def validate_on_one_rank(rank, world):
    """MXFP8_A2A_VALIDATE set on one rank in the middle of a run changes nothing (read at
    import); validate=True on one rank only ends in the process group's timeout error on
    every rank (run with a short one), not in a silent hang or in garbage."""
    x = torch.randn(world, 64)
    ones = [1] * world
    if rank == 0:
        os.environ[checks.VALIDATE_ENV] = "1"
    out = mx.to_mxfp8_a2a_dequant(x, ones, ones)  # validates nowhere: no deadlock
    assert out.shape == (world, 64) and not checks.validating(False)
    return _outcome(lambda: mx.to_mxfp8_a2a_dequant(x, ones, ones, validate=rank == 0))


def compiled_and_eager_ranks(rank, world):
    """Rank 0 runs the exchange under torch.compile, the others eager (as after a graph break
    or a recompile limit on one rank): the same bytes move, every row arrives exact."""
    s = split_matrix(world, 11, max_rows=6, zeros=False)
    out_splits = [s[src][rank] for src in range(world)]
    x = torch.randn(sum(s[rank]), 64).to(torch.bfloat16) * (rank + 1)

    def step(t):
        return mx.to_mxfp8_a2a_dequant(t, out_splits, s[rank])

    run = torch.compile(step, fullgraph=True, backend="aot_eager") if rank == 0 else step
    out = run(x)
    back = mx.to_mxfp8_a2a_dequant(out, s[rank], out_splits)  # eager everywhere
    assert torch.equal(back, mx.quantize_dequantize_reference(x))
    # validation: the compiled rank takes part in the same all_gather (agreement.py)
    run = torch.compile(step_validated, fullgraph=True, backend="aot_eager") if rank == 0 else None
    out = (run or step_validated)(x, out_splits, s[rank])
    assert torch.equal(mx.to_mxfp8_a2a_dequant(out, s[rank], out_splits), back)


def step_validated(x, out_splits, in_splits):
    return mx.to_mxfp8_a2a_dequant(x, out_splits, in_splits, validate=True)
