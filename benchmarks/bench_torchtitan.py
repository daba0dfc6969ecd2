"""torchtitan's MoE block (its own deepseek_v3 module) with torchtitan's AllToAllTokenDispatcher
against mxfp8_a2a.torchtitan's dispatchers, all on the same expert-parallel exchange path.

    torchrun --nproc-per-node=1 benchmarks/bench_torchtitan.py --json out.json

Per dispatcher, median ms over --iters steps after --warmup (CUDA events, a barrier and a
sync before each step, max over ranks): ``block``: the block's forward + backward (router,
dispatch, routed experts, combine, shared experts); ``dispatcher``: dispatch -> rows * 1 ->
combine, forward + backward of the same routing (the dispatcher's own cost: counts, host
sync, permutation, casts, exchange); each as a ratio to torchtitan's. ``local``: the block
with no expert-parallel mesh (torchtitan's local reorder, no exchange). At one rank the wire
is a local copy. Needs torchtitan (pip install -e '.[torchtitan]').
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch
import torch.distributed as dist
from common import Help, Timer, report
from torch.distributed.device_mesh import init_device_mesh
from torchtitan.distributed.utils import set_spmd_backend
from torchtitan.models.common.moe import MoE
from torchtitan.models.deepseek_v3 import model_registry

from mxfp8_a2a.torchtitan import mxfp8_dispatch, mxfp8_dispatch_static

VARIANTS = {  # name: (factory of the dispatcher's config from torchtitan's, its kwargs)
    "torchtitan": (None, {}),
    "mxfp8_a2a bf16": (mxfp8_dispatch, {"wire": "bf16"}),
    "mxfp8_a2a mxfp8": (mxfp8_dispatch, {"wire": "mxfp8"}),
    "static bf16": (mxfp8_dispatch_static, {"wire": "bf16"}),
    "static mxfp8": (mxfp8_dispatch_static, {"wire": "mxfp8"}),
}


def block_config(dim: int, ffn: int, experts: int, top_k: int, shared: int) -> MoE.Config:
    """torchtitan's deepseek_v3 debug MoE block at these sizes (one shared expert of
    width ``shared``; 0: none)."""
    spec = model_registry("debugmodel")
    cfg = next(c for _, c, _, _ in spec.model.traverse(MoE.Config))
    rx = cfg.routed_experts
    inner = dataclasses.replace(rx.inner_experts, dim=dim, hidden_dim=ffn, num_experts=experts)
    disp = dataclasses.replace(rx.token_dispatcher, num_experts=experts, top_k=top_k)
    gate = dataclasses.replace(cfg.router.gate, in_features=dim, out_features=experts)
    router = dataclasses.replace(cfg.router, num_experts=experts, top_k=top_k, gate=gate)
    sh = cfg.shared_experts
    if shared:
        sh = dataclasses.replace(
            sh,
            w1=dataclasses.replace(sh.w1, in_features=dim, out_features=shared),
            w2=dataclasses.replace(sh.w2, in_features=shared, out_features=dim),
            w3=dataclasses.replace(sh.w3, in_features=dim, out_features=shared),
        )
    else:
        sh = None
    rx = dataclasses.replace(rx, inner_experts=inner, token_dispatcher=disp)
    return dataclasses.replace(cfg, num_experts=experts, routed_experts=rx, router=router,
                               shared_experts=sh)  # fmt: skip


def dispatcher_for(cfg: MoE.Config, name: str, mesh):
    factory, kwargs = VARIANTS[name]
    dcfg = cfg.routed_experts.token_dispatcher
    d = (factory(dcfg, **kwargs) if factory else dcfg).build()
    if mesh is not None:
        d.wire_meshes(ep_mesh=mesh)
    return d


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--dim", type=int, default=7168, help="hidden size")
    p.add_argument("--ffn", type=int, default=2048, help="each routed expert's width")
    p.add_argument("--shared", type=int, default=2048, help="shared expert's width (0: none)")
    p.add_argument("--experts", type=int, default=32, help="experts per rank")
    p.add_argument("--top-k", type=int, default=8, help="experts per token")
    p.add_argument("--iters", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--variant", action="append", choices=sorted(VARIANTS),
                   help="dispatchers to time (default: all)")  # fmt: skip
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    set_spmd_backend("partial_dtensor")
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    cfg = block_config(args.dim, args.ffn, args.experts * world, args.top_k, args.shared)
    torch.manual_seed(0)
    moe = cfg.build()
    with torch.no_grad():
        for prm in moe.parameters():
            prm.normal_(0, prm.shape[-1] ** -0.5)
        for b in moe.buffers():
            b.zero_()
    inner = moe.routed_experts.inner_experts
    local = args.experts
    lo = dist.get_rank() * local
    for n in ("w1_EFD", "w2_EDF", "w3_EFD"):  # this rank's experts, what EP sharding leaves
        setattr(inner, n, torch.nn.Parameter(getattr(inner, n).detach()[lo : lo + local]))
    moe = moe.to(device=device, dtype=torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(1 + dist.get_rank())
    x = torch.randn(1, args.tokens, args.dim, device=device, dtype=torch.bfloat16, generator=gen)
    g = torch.randn_like(x)
    timer = Timer(device, args.iters, args.warmup)

    def block_step(_):
        xi = x.detach().requires_grad_(True)
        moe(xi).backward(g)

    # one routing for the dispatcher-only step: torchtitan's router on x
    with torch.no_grad():
        scores, ids, _ = moe.router(x, moe.expert_bias_E)
    scores, ids = scores.flatten(0, 1).float(), ids.flatten(0, 1)
    counts = torch.bincount(ids.flatten(), minlength=cfg.num_experts)
    x_td, g_td = x.flatten(0, 1), g.flatten(0, 1)

    def dispatcher_step(d):
        xi = x_td.detach().requires_grad_(True)
        s = scores.detach().requires_grad_(True)
        routed, _, md = d.dispatch(xi, s, ids, counts)
        out = d.combine(routed * 1.0, md, xi)
        out.backward(g_td)

    rows = []
    names = args.variant or list(VARIANTS)
    for name in (["local"] if world == 1 else []) + names:  # (local: all experts here)
        d = dispatcher_for(cfg, "torchtitan" if name == "local" else name,
                           None if name == "local" else mesh)  # fmt: skip
        moe.routed_experts.token_dispatcher = d
        row = {"dispatcher": name, "block ms": timer(block_step)}
        if name != "local":
            row["dispatcher ms"] = timer(dispatcher_step, lambda d=d: d)
        rows.append(row)
    base = next((r for r in rows if r["dispatcher"] == "torchtitan"), None)
    for r in rows:
        if base:
            r["block / torchtitan"] = r["block ms"] / base["block ms"]
            if "dispatcher ms" in r:
                r["dispatcher / torchtitan"] = r["dispatcher ms"] / base["dispatcher ms"]
    if dist.get_rank() == 0:
        print(f"tokens {args.tokens} x dim {args.dim}, {args.experts} experts per rank, top-"
              f"{args.top_k}, ffn {args.ffn}, shared {args.shared}, EP {world}, bf16")  # fmt: skip
        report(rows, args.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
