"""Worker bodies for tests/test_static_push.py (spawned groups)."""

from __future__ import annotations

import torch
from a2a_workers import device_for
from static_workers import HIDDEN, inputs

import mxfp8_a2a as mx
from mxfp8_a2a.exchange import push
from mxfp8_a2a.exchange import push_rule as rule


def push_equals_nccl(rank, world, backend, seed, exchange):
    """One rank: the push path's dispatch, combine and gradients equal the NCCL path's bit
    for bit (on a GPU through real symmetric memory)."""
    dev = device_for(backend)
    experts, cap, top_k = 4, 9, 2
    if dev.type == "cuda":
        assert push.push_unavailable(None, dev) is None
        buf = push.PushBuffer(None, HIDDEN, experts, capacity=cap, exchange=exchange)
    else:
        buf = push.PushBuffer.emulated(1, HIDDEN, experts, capacity=cap, exchange=exchange,
                                       device=dev)[0]  # fmt: skip
    for capacity in (cap - 3, 0):
        results = []
        for transport in ("nccl", buf):
            x, ids, w, grad = inputs(rank, seed, 11, top_k, experts, "normal", dev)
            x.requires_grad_(True)
            w.requires_grad_(True)
            out, offs, h = mx.dispatch_static(x, ids, experts, capacity, exchange=exchange,
                                              transport=transport)  # fmt: skip
            res = mx.combine_static(out * 1.5, w, h)
            (res.float() * grad.float()).sum().backward()
            results.append((out, offs, h.stats, res, x.grad, w.grad))
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b)
    buf.check()
    buf.free()
    # the layer: transport "auto" (a PushBuffer where the rule allows) against "nccl"
    grads = []
    for transport in ("nccl", "auto"):
        layer = mx.ExpertParallelMoE(HIDDEN, 32, experts, top_k, exchange=exchange, capacity=12,
                                     transport=transport, device=dev, seed=seed)  # fmt: skip
        pushes = isinstance(layer.transport, push.PushBuffer)
        assert pushes == (transport == "auto" and dev.type == "cuda")  # (the rule)
        assert not pushes or layer.transport.capacity == 12
        x = inputs(rank, seed, 11, top_k, experts, "normal", dev)[0].float().requires_grad_(True)
        y = layer(x)
        y.square().sum().backward()
        grads.append((y, x.grad, layer.router.grad, layer.w1.grad))
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def push_rule(rank, world, backend):
    """The rule's answer on CPU tensors, and with the ranks on different hosts: the same
    reasons on every rank, and "nccl" from static_transport."""
    cpu = torch.device("cpu")
    off_cuda = push.push_unavailable(None, cpu)
    assert "rank 0: tensors on cpu" in off_cuda and "rank 1:" in off_cuda
    assert push.static_transport(None, HIDDEN, 4, capacity=4, device=cpu) == "nccl"
    real = rule.socket.gethostname
    rule.socket.gethostname = lambda: f"host{rank}"
    try:
        hosts = push.push_unavailable(None, cpu)
    finally:
        rule.socket.gethostname = real
    assert "the ranks are on 2 hosts" in hosts
    assert push.push_unavailable(None, "cpu") == off_cuda  # (a device name works too)
    return off_cuda, hosts


def push_bad_argument(rank, world, backend):
    try:
        push.PushBuffer(None, HIDDEN, 4, capacity=-1 if rank == 1 else 4, device="cpu")
    except ValueError as e:
        return str(e)
    raise AssertionError("no error")


def ipc_rank(rank, seed, case, queues, results):
    """Rank ``rank`` of two processes on one GPU: its buffer handed to the other process
    through CUDA IPC (torch.multiprocessing), a PushBuffer over both, the whole static path
    (the two processes' kernels time-slice the GPU, so each barrier may wait long), checked
    against the model. Puts (rank, error text or None) on ``results``."""
    from static_workers import check_model

    try:
        world, tokens, top_k, per_rank, cap, align = case
        experts = per_rank * world
        torch.cuda.set_device(0)
        buf = push.PushBuffer.__new__(push.PushBuffer)
        buf._layout(world, HIDDEN, experts, None, None, cap, "mxfp8", torch.bfloat16)
        mine = torch.zeros(buf.nbytes, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        queues[1 - rank].put(mine)
        peer = queues[rank].get(timeout=120)
        mems = [mine, peer] if rank == 0 else [peer, mine]
        buf._setup(rank, [mine, peer], [m.data_ptr() for m in mems], 200_000_000)
        x, ids, w, grad = inputs(rank, seed, tokens[rank], top_k, experts, "normal", "cuda")
        x.requires_grad_(True)
        w.requires_grad_(True)
        out, offs, h = mx.dispatch_static(x, ids, experts, cap, align=align, transport=buf)
        res = mx.combine_static(out, w, h)
        (res.float() * grad.float()).sum().backward()
        torch.cuda.synchronize()
        buf.check()
        got = (out.detach(), offs, h.stats, res.detach(), x.grad, w.grad)
        check_model(rank, world, seed, tokens, top_k, per_rank, "normal", cap, "mxfp8", align, got)
        results.put((rank, None))
    except Exception as e:  # (reported to the test, which raises it)
        results.put((rank, f"{type(e).__name__}: {e}"))
    queues[1 - rank].put("done")  # (the peer's buffer stays mapped until both are done)
    queues[rank].get(timeout=300)
