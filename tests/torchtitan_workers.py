"""Workers of test_torchtitan.py: torchtitan's own modules (its deepseek_v3 debug model's MoE,
sized down) with its AllToAllTokenDispatcher and with mxfp8_a2a.torchtitan's dispatcher, at
expert-parallel degree = world (gloo, CPU)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torchtitan.distributed.utils import set_spmd_backend
from torchtitan.models.common.moe import MoE
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
from torchtitan.models.deepseek_v3 import model_registry
from wires_workers import FACTOR, model

import mxfp8_a2a as mx
from mxfp8_a2a.torchtitan import MXFP8TokenDispatcher, mxfp8_dispatch

BF16_U = 2.0**-8  # bf16's unit roundoff


def ep_mesh(world: int, device: str = "cpu"):
    set_spmd_backend("partial_dtensor")  # torchtitan's tests do this first
    return init_device_mesh(device, (world,), mesh_dim_names=("ep",))


def debug_moe_config(dim: int | None = None) -> MoE.Config:
    """The MoE block of torchtitan's deepseek_v3 "debugmodel" (dim 256, 8 experts top-3,
    2 shared experts), optionally at another width."""
    spec = model_registry("debugmodel")
    moe = next(cfg for _, cfg, _, _ in spec.model.traverse(MoE.Config))
    if dim is not None:
        moe = _with_dim(moe, dim)
    return moe


def _with_dim(cfg, dim: int):
    """A copy of a config tree with every `dim` / `in_features`-like field of the old
    width set to ``dim``."""
    old = cfg.routed_experts.inner_experts.dim
    if dataclasses.is_dataclass(cfg):
        changes = {}
        for f in dataclasses.fields(cfg):
            v = getattr(cfg, f.name)
            if dataclasses.is_dataclass(v):
                changes[f.name] = _with_width(v, old, dim)
        return dataclasses.replace(cfg, **changes)
    return cfg


def _with_width(cfg, old: int, new: int):
    changes = {}
    for f in dataclasses.fields(cfg):
        if not f.init:
            continue
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            changes[f.name] = _with_width(v, old, new)
        elif f.name in ("dim", "in_features") and v == old:
            changes[f.name] = new
        elif f.name == "out_features" and v == old:
            changes[f.name] = new
    return dataclasses.replace(cfg, **changes)


def local_moe(cfg: MoE.Config, rank: int, world: int, seed: int, mesh) -> MoE:
    """torchtitan's MoE built from ``cfg`` in bf16, weights drawn from ``seed`` (the same global
    weights on every rank), this rank's experts only (what EP sharding leaves), the
    dispatcher wired to ``mesh``."""
    moe = cfg.build()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        for b in moe.buffers():
            b.zero_()
    experts = moe.routed_experts.inner_experts
    local = experts.num_experts // world
    for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
        full = getattr(experts, name)
        setattr(experts, name, torch.nn.Parameter(full.detach()[rank * local : (rank + 1) * local]))
    moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    return moe.bfloat16()  # what FSDP2's bf16 mixed precision computes with


def run_moe(moe: MoE, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """Forward and backward of sum(out * g): the output and every gradient."""
    x = x.clone().requires_grad_(True)
    out = moe(x)
    (out.float() * g).sum().backward()
    res = {"out": out.detach(), "x": x.grad}
    res |= {n: p.grad for n, p in moe.named_parameters()}
    return res


def normwise(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def moe_bf16_matches_torchtitan(rank, world, seed, tokens, dim, device="cpu"):
    """torchtitan's MoE block with its own dispatcher and with ours on the bf16 wire: the
    largest normwise relative difference of the output and each gradient (on ``device``)."""
    mesh = ep_mesh(world, device)
    cfg = debug_moe_config(dim)
    ours_cfg = dataclasses.replace(cfg)
    rexp = dataclasses.replace(cfg.routed_experts)
    rexp.token_dispatcher = mxfp8_dispatch(cfg.routed_experts.token_dispatcher, wire="bf16")
    ours_cfg.routed_experts = rexp
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    x = torch.randn(2, tokens, cfg.routed_experts.inner_experts.dim, generator=gen).bfloat16()
    g = torch.randn(x.shape, generator=gen)
    x, g = x.to(device), g.to(device)
    theirs = run_moe(local_moe(cfg, rank, world, seed, mesh).to(device), x, g)
    ours = run_moe(local_moe(ours_cfg, rank, world, seed, mesh).to(device), x, g)
    assert theirs.keys() == ours.keys()
    return {k: normwise(ours[k], theirs[k]) for k in theirs}


def _inputs(rank, seed, tokens, top_k, experts, dim):
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    scale = torch.exp2(torch.randint(-8, 9, (tokens, 1), generator=gen).float())
    x = (torch.randn(tokens, dim, generator=gen) * scale).bfloat16()
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices
    scores = torch.rand(tokens, top_k, generator=gen) + 0.1
    g = torch.randn(tokens, dim, generator=gen).bfloat16()
    return x, ids, scores, g


def _through(dispatcher, x, ids, scores, g, experts):
    """dispatch -> y = routed * FACTOR (bf16) -> combine -> backward of sum(out * g)."""
    x = x.clone().requires_grad_(True)
    s = scores.clone().requires_grad_(True)
    counts = torch.bincount(ids.flatten(), minlength=experts)
    routed, per_expert, md = dispatcher.dispatch(x, s, ids, counts)
    y = routed * FACTOR
    y.retain_grad()
    out = dispatcher.combine(y, md, x)
    (out.float() * g.float()).sum().backward()
    return dict(routed=routed.detach(), per_expert=per_expert, y=y.detach(), y_grad=y.grad,
                out=out.detach(), x=x.grad, s=s.grad, md=md)  # fmt: skip


def dispatcher_bf16_bounds(rank, world, seed, tokens, top_k, per_rank, dim, device="cpu"):
    """Our dispatcher (bf16 wire) against torchtitan's AllToAllTokenDispatcher, elementwise:
    the rows and counts the experts get must be equal; out, the scores' and x's gradients
    within the rounding bounds of the two combines (see test_torchtitan.py)."""
    mesh = ep_mesh(world, device)
    experts = per_rank * world
    x, ids, scores, g = (t.to(device) for t in _inputs(rank, seed, tokens, top_k, experts, dim))
    cfg = AllToAllTokenDispatcher.Config(num_experts=experts, top_k=top_k)
    tt = cfg.build()
    tt.wire_meshes(ep_mesh=mesh)
    ours = mxfp8_dispatch(cfg, wire="bf16").build()
    ours.wire_meshes(ep_mesh=mesh)
    a, b = _through(tt, x, ids, scores, g, experts), _through(ours, x, ids, scores, g, experts)
    assert torch.equal(a["routed"], b["routed"]), "the experts' rows differ"
    assert a["per_expert"].dtype == b["per_expert"].dtype, (a["per_expert"], b["per_expert"])
    assert torch.equal(a["per_expert"], b["per_expert"])
    # M[t] = sum_j |s_j| |y_j|: torchtitan's combine of the magnitudes (fp32)
    with torch.no_grad():
        md = dataclasses.replace(a["md"], topk_scores_experts_sorted_N=a["md"]
                                 .topk_scores_experts_sorted_N.abs())  # fmt: skip
        mag = tt.combine(a["y"].abs().float(), md, x.float())
        gmag = tt.combine(torch.ones_like(a["y"]).float(), md, x.float())  # sum_j |s_j|
    diff = (b["out"].float() - a["out"].float()).abs()
    worst_out = (diff / (mag * BF16_U).clamp_min(1e-30)).max().item()
    # x's gradient: y = routed * FACTOR, so d out / d x[t] = FACTOR sum_j s_j g[t]
    xmag = FACTOR * gmag * g.float().abs()
    worst_x = (b["x"].float() - a["x"].float()).abs() / (xmag * BF16_U).clamp_min(1e-30)
    # the scores' gradient: sum over D of g * y in fp32, in two summation orders
    smag = torch.zeros_like(scores)
    for j in range(top_k):  # |g| . |y_j|, y_j = x[t] * FACTOR in bf16 (the same rows)
        smag[:, j] = (g.float().abs() * (x.float() * FACTOR).bfloat16().float().abs()).sum(1)
    worst_s = ((b["s"] - a["s"]).abs() / (smag * 2.0**-24 * dim).clamp_min(1e-30)).max().item()
    return worst_out, worst_x.max().item(), worst_s


def dispatcher_matches_legs_model(
    rank, world, seed, tokens_by_rank, top_k, per_rank, wire, dim, device="cpu"
):
    """Our dispatcher with an MXFP8 preset against the plain-torch model of its legs (the
    wire tests' model, on the CPU): rows, their gradients, out and x's gradient bit for bit
    (the dispatcher on ``device``)."""
    mesh = ep_mesh(world, device)
    experts = per_rank * world
    wires = mx.WIRE_PRESETS[wire]
    want_rows, want_grads, want_out, want_gx, want_gw, gw_abs = model(
        rank, world, seed, tokens_by_rank, top_k, per_rank, wires, dim
    )
    from static_workers import inputs

    x, ids, w, g = inputs(rank, seed, tokens_by_rank[rank], top_k, experts, "normal", "cpu", dim)
    cfg = AllToAllTokenDispatcher.Config(num_experts=experts, top_k=top_k)
    ours = mxfp8_dispatch(cfg, wire=wire).build()
    ours.wire_meshes(ep_mesh=mesh)
    r = _through(ours, x.to(device), ids.to(device), w.to(device), g.to(device), experts)
    r = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in r.items()}
    assert torch.equal(r["routed"], torch.cat(want_rows)), "rows"
    assert r["per_expert"].tolist() == [len(v) for v in want_rows]
    assert torch.equal(r["y_grad"], torch.cat(want_grads)), "rows' gradients"
    assert torch.equal(r["out"], want_out), "out"
    assert torch.equal(r["x"], want_gx), "x's gradient"
    assert ((r["s"] - want_gw).abs() <= 2 * dim * 2.0**-24 * gw_abs + 1e-6).all(), "scores"
    dist.barrier()


OVERRIDE_FLAG = 'mxfp8_a2a.torchtitan.mxfp8_dispatch={"wire": "%s"}'


def overridden_debug_model(wire: str):
    """torchtitan's deepseek_v3 debug model config with the override applied as the trainer
    applies it (the --override.imports string parsed by torchtitan); the original too."""
    import copy

    from torchtitan.config.configurable import Configurable
    from torchtitan.config.override import OverrideConfig, apply_overrides, parse_cli_imports

    original = model_registry("debugmodel").model
    cfg = copy.deepcopy(original)
    imports = parse_cli_imports([OVERRIDE_FLAG % wire])
    lines = apply_overrides(OverrideConfig(imports=imports), cfg)
    before = {f: type(c) for f, c, _, _ in original.traverse(Configurable.Config, recurse=True)}
    after = {f: type(c) for f, c, _, _ in cfg.traverse(Configurable.Config, recurse=True)}
    return original, cfg, lines, before, after


class CausalSDPA(torch.nn.Module):
    """A CPU stand-in for the debug model's flex attention (no backward on CPU): causal
    scaled-dot-product attention on torchtitan's (B, L, heads, head_dim) layout."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, **kwargs):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return out.transpose(1, 2)


def debug_model_trains(rank, world, seed, wire, steps, ckpt):
    """The overridden debug model at EP = world: every MoE layer on our dispatcher, nothing
    else changed; forward, backward and AdamW steps on one batch; the state dict through DCP.
    Returns the losses."""
    import torch.distributed.checkpoint as dcp

    mesh = ep_mesh(world)
    _, cfg, lines, before, after = overridden_debug_model(wire)
    changed = {f for f in before if after.get(f) is not before[f]}
    assert before.keys() == after.keys() and changed, before.keys() ^ after.keys()
    assert all(f.endswith(".moe.routed_experts.token_dispatcher") for f in changed), changed
    assert all(after[f] is MXFP8TokenDispatcher.Config for f in changed)
    assert len(lines) == len(changed) == sum(f.endswith(".moe") for f in before), lines
    torch.manual_seed(seed)  # the same initial weights on every rank
    net = cfg.build()
    net.init_states()
    moes = [m for m in net.modules() if isinstance(m, MoE)]
    assert len(moes) == len(changed)
    for moe in moes:
        d = moe.routed_experts.token_dispatcher
        assert type(d) is MXFP8TokenDispatcher and d.wire == wire
        experts, local = moe.routed_experts.inner_experts, d.num_experts // world
        for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
            w = getattr(experts, name).detach()[rank * local : (rank + 1) * local]
            # sharded over the EP mesh as torchtitan's EP leaves them: a DTensor, Shard(0)
            w = DTensor.from_local(w.clone(), mesh, [Shard(0)], run_check=False)
            setattr(experts, name, torch.nn.Parameter(w))
        d.wire_meshes(ep_mesh=mesh)
    mine = {id(p) for m in moes for p in m.routed_experts.inner_experts.parameters()}
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed + rank)  # each rank its own batch
    tokens = torch.randint(0, 2048, (2, 17), generator=gen)
    for block in net.layers.values():
        block.attention.inner_attention = CausalSDPA()
    losses = []
    for _ in range(steps):
        logits = net(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        for p in net.parameters():  # data parallel over the EP ranks: average the rest
            if id(p) not in mine and p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        losses.append(loss.item())
    # the dispatcher holds no state: the state dict is the model's, through DCP and back
    state = net.state_dict()
    assert not any("token_dispatcher" in k for k in state)
    dcp.save(state, checkpoint_id=ckpt)
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, checkpoint_id=ckpt)
    for k, v in state.items():
        a, b = (t.to_local() if isinstance(t, DTensor) else t for t in (loaded[k], v))
        assert torch.equal(a, b), k
    return losses


def count_all_to_alls(fn) -> tuple[object, int]:
    """fn()'s result and the all-to-all collectives it ran (c10d's own op, under every
    path: the process group's call, dist.all_to_all_single, functional collectives)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, sum(e.count for e in prof.key_averages() if e.key == "c10d::alltoall_base_")


def collectives_under_checkpointing(rank, world, seed, wire, policy, static=False):
    """torchtitan's debug MoE block (our dispatcher, the static one if ``static``, or
    torchtitan's with wire None) wrapped
    as torchtitan wraps blocks (policy "selective", "full" or None): all-to-alls in the
    forward and in the backward, and the results."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    mesh = ep_mesh(world)
    cfg = debug_moe_config()
    if wire is not None:
        from mxfp8_a2a.torchtitan import mxfp8_dispatch_static

        factory = mxfp8_dispatch_static if static else mxfp8_dispatch
        cfg.routed_experts.token_dispatcher = factory(
            cfg.routed_experts.token_dispatcher, wire=wire
        )
    block = local_moe(cfg, rank, world, seed, mesh)
    if policy is not None:
        ac = (SelectiveAC if policy == "selective" else FullAC).Config().build()
        block = ac._wrap_block(block, base_fqn="layers.1.moe")
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    x = torch.randn(2, 16, 256, generator=gen).bfloat16().requires_grad_(True)
    g = torch.randn(x.shape, generator=gen)
    out, fwd = count_all_to_alls(lambda: block(x))
    _, bwd = count_all_to_alls(lambda: (out.float() * g).sum().backward())
    return fwd, bwd, out.detach(), x.grad


def compiled_block_error(rank, world, seed):
    """A block compiled as torchtitan compiles blocks (fullgraph): the error it raises."""
    mesh = ep_mesh(world)
    cfg = debug_moe_config()
    cfg.routed_experts.token_dispatcher = mxfp8_dispatch(cfg.routed_experts.token_dispatcher)
    block = local_moe(cfg, rank, world, seed, mesh)
    block.compile(fullgraph=True)
    try:
        block(torch.randn(2, 8, 256).bfloat16())
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def mistake_error(rank, world, case):
    """The error each rank sees for a mistake on some ranks: "hidden" (a width that is not
    a multiple of 32 with an MXFP8 leg, all ranks), "wire" (rank 0 on another wire)."""
    mesh = ep_mesh(world)
    wire = "bf16" if case == "wire" and rank == 0 else "mxfp8"
    d = mxfp8_dispatch(AllToAllTokenDispatcher.Config(num_experts=2 * world, top_k=2), wire=wire)
    d = d.build()
    d.wire_meshes(ep_mesh=mesh)
    dim = 48 if case == "hidden" else 64
    x, ids = torch.randn(6, dim).bfloat16(), torch.randint(0, 2 * world, (6, 2))
    try:
        d.dispatch(x, torch.rand(6, 2), ids, torch.bincount(ids.flatten(), minlength=2 * world))
    except ValueError as e:
        return str(e)
    return None


def static_against_synced(rank, world, seed, wire, compiled, device="cpu"):
    """The debug MoE block on our static dispatcher (dropless; compiled with fullgraph as
    torchtitan compiles blocks, if ``compiled``) against the synced one, eager: the normwise
    relative difference of out and each gradient (on ``device``)."""
    from mxfp8_a2a.torchtitan import mxfp8_dispatch_static

    mesh = ep_mesh(world, device)
    results = []
    for factory in (mxfp8_dispatch, mxfp8_dispatch_static):
        cfg = debug_moe_config()
        cfg.routed_experts.token_dispatcher = factory(
            cfg.routed_experts.token_dispatcher, wire=wire
        )
        block = local_moe(cfg, rank, world, seed, mesh).to(device)
        if compiled and factory is mxfp8_dispatch_static:
            block.compile(fullgraph=True)
        gen = torch.Generator().manual_seed(seed * 10 + rank)
        x = torch.randn(2, 16, 256, generator=gen).bfloat16()
        g = torch.randn(x.shape, generator=gen)
        results.append(run_moe(block, x.to(device), g.to(device)))
    synced, static = results
    return {k: normwise(static[k], synced[k]) for k in synced}


def dispatcher_node_route_matches_model(rank, world, seed, tokens_by_rank, top_k, per_rank, g):
    """Our dispatcher with ranks_per_node=g: the node-aware route, bit for bit the model of
    its hops (node_workers.py), from torchtitan's own wiring of the EP mesh."""
    from node_workers import HIDDEN, node_inputs, node_model

    from mxfp8_a2a.torchtitan import MXFP8StaticTokenDispatcher

    mesh = ep_mesh(world)
    experts = per_rank * world
    wires = mx.Wires(*["mxfp8"] * 4)
    want = node_model(rank, world, g, seed, tokens_by_rank, top_k, per_rank, wires)
    x, ids, w, grad = node_inputs(rank, seed, tokens_by_rank[rank], top_k, experts)
    for kind in (MXFP8TokenDispatcher, MXFP8StaticTokenDispatcher):
        cfg = kind.Config(num_experts=experts, top_k=top_k, ranks_per_node=g)
        ours = cfg.build()
        ours.wire_meshes(ep_mesh=mesh)
        assert ours.topology is not None and ours.topology.ranks_per_node == g
        r = _through(ours, x, ids, w, grad, experts)
        assert r["md"].handle.nodes is not None
        if kind is MXFP8TokenDispatcher:  # (the static rows: another order, padded)
            assert torch.equal(r["routed"], torch.cat(want[0])), "rows"
            assert torch.equal(r["y_grad"], torch.cat(want[1])), "rows' gradients"
        assert torch.equal(r["out"], want[2]), "out"
        assert torch.equal(r["x"], want[3]), "x's gradient"
        bound = 2 * HIDDEN * 2.0**-24 * want[5] + 1e-6
        assert ((r["s"] - want[4]).abs() <= bound).all(), "scores"
    dist.barrier()


def counts_dtype_as_torchtitans(rank, world, seed):
    """At EP > 1 the tokens per local expert come back int64 from both of our dispatchers,
    as from torchtitan's (a sum of the exchanged counts), whatever the counts' dtype in."""
    from mxfp8_a2a.torchtitan import mxfp8_dispatch_static

    mesh = ep_mesh(world)
    experts = 2 * world
    x, ids, scores, _ = _inputs(rank, seed, 12, 2, experts, 64)
    cfg = AllToAllTokenDispatcher.Config(num_experts=experts, top_k=2)
    got = {}
    for name, c in (("torchtitan", cfg), ("ours", mxfp8_dispatch(cfg, wire="bf16")),
                    ("static", mxfp8_dispatch_static(cfg, wire="bf16"))):  # fmt: skip
        d = c.build()
        d.wire_meshes(ep_mesh=mesh)
        for dtype in (torch.int32, torch.int64):
            counts = torch.bincount(ids.flatten(), minlength=experts).to(dtype)
            got[name, dtype] = d.dispatch(x, scores, ids, counts)[1].dtype
    return got
