"""Workers of test_layer_checks.py: a real job's mistakes with ExpertParallelMoE and the
static dispatch, on gloo; each returns the message every rank raised (the same on every
rank, checked by same_error)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from robustness_workers import same_error

import mxfp8_a2a as mx
from mxfp8_a2a.exchange import agreement
from mxfp8_a2a.moe import checks as layer_checks

H = 64


def _layer(**kw) -> mx.ExpertParallelMoE:
    return mx.ExpertParallelMoE(H, 32, 2 * dist.get_world_size(), 2, **kw)


def ddp_mistakes(rank, world):
    """DDP without prepare_ddp, with init_sync=False, prepare_ddp after wrapping and
    prepare_ddp given the DDP object: the first forward (or prepare_ddp) raises on every rank;
    the right order trains."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    x = torch.randn(6, H)
    fix = r"call mx.prepare_ddp\(model\) BEFORE DistributedDataParallel\(model\)"
    out = []
    for init_sync in (True, False):
        model = DDP(torch.nn.Sequential(_layer(seed=1)), init_sync=init_sync)
        out.append(same_error(lambda m=model: m(x), "averages this layer's experts.*" + fix))
    model = torch.nn.Sequential(_layer(seed=1))
    wrapped = DDP(model)
    mx.prepare_ddp(model)  # (too late: DDP has taken the experts)
    out.append(same_error(lambda: wrapped(x), "averages this layer's experts.*" + fix))
    model = DDP(torch.nn.Sequential(_layer(seed=1)))
    out.append(same_error(lambda: mx.prepare_ddp(model), "already a DistributedDataParallel"))
    model = torch.nn.Sequential(_layer(seed=1))
    model = DDP(mx.prepare_ddp(model))  # the right order
    model(x).sum().backward()
    # the digest fallback (where torch exposes no active DDP module): DDP's broadcast made
    # the experts equal on every rank
    own = layer_checks._own_finding
    layer_checks._own_finding = lambda layer: 0
    try:
        model = DDP(torch.nn.Sequential(_layer(seed=1)))
        out.append(same_error(lambda: model(x), "the experts are the same on every rank"))
    finally:
        layer_checks._own_finding = own
    return out


def fsdp_without_shard_experts(rank, world):
    """fully_shard(model) without shard_experts: the first forward raises on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(_layer(seed=1))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return same_error(lambda: model(torch.randn(6, H)), "the experts are the same on every")


def seeds(rank, world):
    """Ranks seeded differently: the first forward says so on every rank; the same
    torch.manual_seed builds the same router, and consecutive layers differ."""
    torch.manual_seed(rank)
    layer = _layer()
    msg = same_error(lambda: layer(torch.randn(5, H)), "the router differs between the ranks")
    torch.manual_seed(5)
    a, b = _layer(), _layer()
    assert not torch.equal(a.router, b.router) and not torch.equal(a.w1, b.w1)
    a(torch.randn(5, H)).sum().backward()  # (the check passes)
    routers = [torch.empty_like(a.router) for _ in range(world)]
    dist.all_gather(routers, a.router.detach())
    assert all(torch.equal(r, routers[0]) for r in routers)
    return msg


def static_tokens_differ(rank, world, compiled):
    """capacity_factor with max_tokens: ranks pass different token counts (eager, or
    compiled with fullgraph=True, dynamic=True) and get what the host-synced layer gives;
    more than max_tokens on one rank raises at the first call on every rank."""
    torch.manual_seed(0)
    static = _layer(exchange="bf16", seed=2, capacity_factor=2.0, max_tokens=12)
    synced = _layer(exchange="bf16", seed=2)
    msg = same_error(lambda: static(torch.randn(12 + rank, H)), "more than the layer's max_tok")
    run = torch.compile(static, fullgraph=True, dynamic=True) if compiled else static
    for t in (5 + 3 * rank, 12 - rank, 7):
        x = torch.randn(t, H, requires_grad=True)
        y = x.detach().clone().requires_grad_(True)
        got, want = run(x), synced(y)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        got.square().sum().backward()
        want.square().sum().backward()
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-4, atol=1e-5)
    assert static.read_dispatch_stats()["dropped"] == 0
    return msg


def _case(rank, world, seed=0, tokens=6, **kw):
    args = {"experts": 2 * world, "capacity": 12, "hidden": H, "dtype": torch.float32} | kw
    g = torch.Generator().manual_seed(seed * 10 + rank)
    x = torch.randn(tokens, args["hidden"], generator=g).to(args["dtype"])
    ids = torch.randint(0, args["experts"], (tokens, 2), generator=g)
    return x, ids, args


def _dispatch(x, ids, args, **kw):
    return mx.dispatch_static(x, ids, args["experts"], args["capacity"], **kw)


def static_sizes_differ(rank, world):
    """dispatch_static with a size that differs on one rank (or a bad argument there) at a
    new configuration: the same ValueError on every rank, no abort; then the group works."""
    last = rank == world - 1
    cases = [
        ({"capacity": 12 + last}, r"capacity differs between ranks"),
        ({"hidden": 96 if last else H}, r"x.shape\[1\] differs between ranks"),
        ({"dtype": torch.float16 if last else torch.float32}, r"rank\(s\) \[\d\].*float16"),
        ({"experts": 33 * world * (1 + last)}, r"num_experts differs between ranks"),
    ]
    out = []
    for kw, match in cases:
        x, ids, args = _case(rank, world, **kw)
        out.append(same_error(lambda x=x, ids=ids, args=args: _dispatch(x, ids, args), match))
    x, ids, args = _case(rank, world)  # x's dtype matters where the rows travel in it
    x = x.bfloat16() if last else x
    out.append(same_error(lambda: _dispatch(x, ids, args, exchange="bf16"), "x.dtype differs"))
    x, ids, args = _case(rank, world)
    exchange = "bf16" if last else "mxfp8"
    out.append(same_error(lambda: _dispatch(x, ids, args, exchange=exchange), "exchange differs"))
    transport = "gloo" if last else "nccl"
    match = r"rank\(s\) \[\d\].*transport must be 'nccl' or a PushBuffer"
    out.append(same_error(lambda: _dispatch(x, ids, args, transport=transport), match))
    _dispatch(x, ids, args)  # the group still works
    return out


def static_agrees_once(rank, world):
    """A known configuration costs no collective (one gather per new one); validate=True
    (or MXFP8_A2A_VALIDATE=1 at import) gathers on every call and catches a size that
    changed on one rank after the ranks agreed."""
    gathers = []
    real = agreement.gather_rows
    agreement.gather_rows = lambda *a: gathers.append(1) or real(*a)
    try:
        x, ids, args = _case(rank, world)
        for _ in range(3):
            _dispatch(x, ids, args)
        assert len(gathers) == 1, gathers
        x2, ids2, args2 = _case(rank, world, tokens=9)  # (tokens: not a term)
        _dispatch(x2, ids2, args2)
        assert len(gathers) == 1, gathers
        _dispatch(x, ids, args | {"capacity": 13})  # a new configuration on every rank
        assert len(gathers) == 2, gathers
        _dispatch(x, ids, args, validate=True)
        assert len(gathers) == 3, gathers
        cap = 12 + (rank == 0)  # changed on rank 0 only, after the ranks agreed on 12 and 13
        return same_error(
            lambda: _dispatch(x, ids, args | {"capacity": cap}, validate=True), "capacity differs"
        )
    finally:
        agreement.gather_rows = real


def static_validate_compiled(rank, world):
    """validate=True under torch.compile(fullgraph=True): the agreement traced
    (agreement.agree_compiled), the same result as eager."""
    x, ids, args = _case(rank, world)

    def fn(x, ids):
        out, _, handle = _dispatch(x, ids, args, exchange="bf16", validate=True)
        return mx.combine_static(out, torch.ones(ids.shape, dtype=x.dtype), handle)

    torch.testing.assert_close(torch.compile(fn, fullgraph=True)(x, ids), fn(x, ids))


def push_buffer_device_on_one_rank(rank, world):
    """A device only one rank cannot use: PushBuffer and static_transport raise the same
    error on every rank (before any buffer exchange)."""
    device = "bogus:0" if rank == world - 1 else "cpu"
    a = same_error(lambda: mx.PushBuffer(None, H, 2 * world, capacity=4, device=device),
                   r"PushBuffer: rank \d: device='bogus:0'")  # fmt: skip
    b = same_error(lambda: mx.static_transport(None, H, 2 * world, capacity=4, device=device),
                   r"push_unavailable: rank \d: device='bogus:0'")  # fmt: skip
    assert mx.static_transport(None, H, 2 * world, capacity=4, device="cpu") == "nccl"
    return [a, b]


def layer_configs_differ(rank, world):
    """Layers built differently on one rank (capacity, hidden, exchange): the first forward
    raises the same error on every rank, before any dispatch."""
    last = rank == world - 1
    out = []
    for kw, hidden, match in [
        ({"capacity": 8 + last}, H, r"ExpertParallelMoE: capacity differs between ranks"),
        ({}, 96 if last else H, r"ExpertParallelMoE: hidden differs between ranks"),
        ({"exchange": "bf16" if last else "mxfp8"}, H, r"exchange differs between ranks"),
    ]:
        layer = mx.ExpertParallelMoE(hidden, 32, 2 * world, 2, seed=0, **kw)
        out.append(same_error(lambda a=layer, h=hidden: a(torch.randn(4, h)), match))
    return out


def replicas_and_upcycling(rank, world):
    """On a (dp=2, ep=2) mesh: replicas seeded differently (torch.manual_seed(dp rank)) hold
    equal experts after prepare_ddp / shard_experts; experts that are copies of one MLP on
    every rank (sparse upcycling) pass the first-forward check under prepare_ddp; combine
    legs that differ between ranks (same dispatch legs) raise on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "ep"))
    dp_rank = mesh["dp"].get_local_rank()
    for wrap in ("ddp", "fsdp2"):
        torch.manual_seed(100 + dp_rank)  # the same in an ep group, not across replicas
        layer = mx.ExpertParallelMoE(H, 32, 4, 2, mesh["ep"], seed=None)
        torch.manual_seed(7)
        layer.router.data = torch.randn_like(layer.router)  # (the rest of the model: DDP's)
        if wrap == "ddp":
            mx.prepare_ddp(torch.nn.Sequential(layer), mesh["dp"])
            local = layer.w1.detach()
        else:
            mx.shard_experts(torch.nn.Sequential(layer), mesh["dp"])
            local = layer.w1.full_tensor().detach()
        copies = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(copies, local, group=mesh["dp"].get_group())
        assert torch.equal(copies[0], copies[1]), wrap
    upcycled = mx.ExpertParallelMoE(H, 32, 2 * world, 2, seed=3)
    with torch.no_grad():
        upcycled.experts.w1.copy_(upcycled.experts.w1[:1].expand_as(upcycled.experts.w1))
        upcycled.experts.w2.copy_(upcycled.experts.w2[:1].expand_as(upcycled.experts.w2))
        for p in upcycled.experts.parameters():
            dist.broadcast(p, src=0)  # every expert on every rank: one MLP's copy
    model = DDP(mx.prepare_ddp(torch.nn.Sequential(upcycled)))
    model(torch.randn(6, H)).sum().backward()
    last = rank == world - 1
    combine_bwd = "bf16" if last else "mxfp8"
    wires = mx.Wires("mxfp8", "bf16", "bf16", combine_bwd)
    x, ids, args = _case(rank, world)
    return same_error(lambda: _dispatch(x, ids, args, exchange=wires), "exchange differs")
