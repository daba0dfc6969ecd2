"""One ExpertParallelMoE layer, forward + backward, phase by phase, dispatch host-synced or
static (sync-free), eager or replayed from a CUDA graph:

Variants are named PATH-EXCHANGE[-EXPERTS][-graph] (--variant, repeatable):

    sync-*        dispatch/combine with the splits read on the host (the layer's default)
    static-*      dispatch_static/combine_static (--capacity-factor, default 1.25), eager
    *-graph       the same layer's whole forward + backward captured in one CUDA graph and
                  replayed (total time only; CUDA only)
    EXCHANGE      the legs' wires: bf16, mxfp8 or mxfp8_to_experts (mx.WIRE_PRESETS)
    *-rows_only-graph
                  dispatch_static + combine_static forward + backward with identity experts
                  and a fixed routing (made once, outside the graph), replayed from a graph:
                  the row movement's own time (its device-side plan included), beside its
                  HBM bound (bytes each kernel must move once, at the device-copy ceiling in
                  --copy-tbs)
    EXPERTS       fp8_rowwise, fp8_rowwise_gw_hp (-reused: inside fp8_weight_reuse()), or
                  expert_loop (the old per-expert loop)

The experts are bf16 grouped GEMMs unless the name says otherwise.

Start with torchrun, one process per GPU (NCCL; one rank works: its exchange is local), or
on a machine without GPUs (gloo, a smoke test with a tiny --shape):

    torchrun --nproc-per-node=1 benchmarks/bench_moe_layer.py --json moe_layer.json
    torchrun --nproc-per-node=2 benchmarks/bench_moe_layer.py --shape 64x128x2x4x64 --iters 2

Shapes are TOKENSxHIDDENxTOPKxEXPERTSxFFN per rank (EXPERTS: local experts per rank); the
defaults are 4096x7168x8x32x2048 (DeepSeek-V3-like) and 8192x2048x8x16x768 (Qwen3-30B-A3B-
like). bf16 activations and weights, random tokens through the layer's softmax top-k router.

Each timed iteration: barrier and device sync, then CUDA events (host clock on CPU) at the
phase boundaries of one forward + backward: dispatch (the router and dispatch, forward and
their backward, which runs last), experts (forward, and backward up to the gradient of
dispatch's output), combine (forward, and backward up to the gradient of the experts'
output). The median over --iters iterations after --warmup is taken per rank and phase, then
the max over ranks. SQNR (dB) of the layer's output and of x's gradient against the first
variant, over all ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch
import torch.distributed as dist
from common import Help, median, sqnr_db, versions, warm_gpu, write_json
from tabulate import tabulate

from mxfp8_a2a._torchrun import init_from_torchrun
from mxfp8_a2a.moe import capacity_for, combine, combine_static, dispatch, dispatch_static
from mxfp8_a2a.moe.layer import ExpertParallelMoE
from mxfp8_a2a.moe.routing import route

GPU_SHAPES = ["4096x7168x8x32x2048", "8192x2048x8x16x768"]
CPU_SHAPES = ["64x128x2x4x64"]
VARIANTS = {  # name: (dispatch, exchange, experts, inside fp8_weight_reuse(), graph)
    "sync-bf16": ("sync", "bf16", "bf16", False, False),
    "sync-mxfp8": ("sync", "mxfp8", "bf16", False, False),
    "sync-mxfp8_to_experts": ("sync", "mxfp8_to_experts", "bf16", False, False),
    "static-bf16": ("static", "bf16", "bf16", False, False),
    "static-mxfp8": ("static", "mxfp8", "bf16", False, False),
    "static-bf16-graph": ("static", "bf16", "bf16", False, True),
    "static-mxfp8-graph": ("static", "mxfp8", "bf16", False, True),
    "static-mxfp8_to_experts-graph": ("static", "mxfp8_to_experts", "bf16", False, True),
    "static-mxfp8-rows_only-graph": ("static", "mxfp8", "identity", False, True),
    "sync-bf16-expert_loop": ("sync", "bf16", "loop", False, False),
    "sync-mxfp8-fp8_rowwise": ("sync", "mxfp8", "fp8_rowwise", False, False),
    "sync-mxfp8-fp8_rowwise-reused": ("sync", "mxfp8", "fp8_rowwise", True, False),
    "sync-mxfp8-fp8_rowwise_gw_hp": ("sync", "mxfp8", "fp8_rowwise_gw_hp", False, False),
    "sync-mxfp8-fp8_rowwise_gw_hp-reused": ("sync", "mxfp8", "fp8_rowwise_gw_hp", True, False),
}
DEFAULT_VARIANTS = list(VARIANTS)[:9]
MARKS = ("start", "dispatch", "experts", "combine", "combine_bwd", "experts_bwd", "end")
PHASES = ("total", "fwd", "bwd", "dispatch", "experts", "combine")


def old_expert_loop(x, w1, w2, counts: list[int]) -> torch.Tensor:
    """The experts as the layer ran them before grouped_mm: one bf16 matmul pair per expert
    over a host list of counts (indexing w[e] gives each expert's backward a full-size
    weight gradient to fill and add)."""
    outs = [
        torch.nn.functional.gelu(xe @ w1[e]) @ w2[e] for e, xe in enumerate(torch.split(x, counts))
    ]
    return torch.cat(outs) if outs else x.new_empty((0, w2.shape[-1]))


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    try:
        tokens, hidden, top_k, experts, ffn = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(
            f"--shape must look like TOKENSxHIDDENxTOPKxEXPERTSxFFN, got {text!r}"
        ) from None
    return tokens, hidden, top_k, experts, ffn


def make_layer(hidden, ffn, experts, top_k, device) -> ExpertParallelMoE:
    world = dist.get_world_size()
    # built on "meta", filled here on the device: faster than drawing on the host
    layer = ExpertParallelMoE(hidden, ffn, experts * world, top_k, device="meta")
    layer = layer.to_empty(device=device)
    torch.manual_seed(0)  # the router is replicated: the same on every rank
    with torch.no_grad():
        layer.router.normal_().mul_(hidden**-0.5)
        torch.manual_seed(1 + dist.get_rank())
        layer.w1.normal_().mul_(hidden**-0.5)
        layer.w2.normal_().mul_(ffn**-0.5)
    return layer.to(torch.bfloat16)


class Clock:
    """Marks on the current CUDA stream (events) or the host clock."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, {}

    def __call__(self, name: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks[name] = ev
        else:
            self.marks[name] = time.perf_counter()

    def ms(self, a: str, b: str) -> float:
        if self.cuda:
            return self.marks[a].elapsed_time(self.marks[b])
        return (self.marks[b] - self.marks[a]) * 1e3

    def phases(self) -> dict[str, float]:
        m = self.ms
        return {
            "total": m("start", "end"),
            "fwd": m("start", "combine"),
            "bwd": m("combine", "end"),
            "dispatch": m("start", "dispatch") + m("experts_bwd", "end"),
            "experts": m("dispatch", "experts") + m("combine_bwd", "experts_bwd"),
            "combine": m("experts", "combine") + m("combine", "combine_bwd"),
        }


def step(layer, x, grad, variant, clock, cf: float) -> tuple[torch.Tensor, ...]:
    """One forward + backward of the layer's steps, marking the phase boundaries."""
    kind, exchange, experts = VARIANTS[variant][:3]
    layer.exchange = exchange
    if experts not in ("loop", "identity"):
        layer.precision = experts
    if experts == "identity":  # the rows alone: routing made once, outside the timed steps
        if not hasattr(layer, "_fixed_routing"):
            with torch.no_grad():
                w, i = route(x @ layer.router.to(x.dtype), layer.top_k)
            layer._fixed_routing = (w.requires_grad_(True), i)
        weights, ids = layer._fixed_routing
    clock("start")
    if experts != "identity":
        weights, ids = route(x @ layer.router.to(x.dtype), layer.top_k)
    if kind == "static":
        cap = capacity_for(x.shape[0], layer.top_k, dist.get_world_size(), cf)
        ex, offs, handle = dispatch_static(x, ids, layer.num_experts, cap, exchange=exchange)
        layer.dispatch_stats.add_(handle.stats)
    else:
        ex, counts, handle = dispatch(x, ids, layer.num_experts, layer.group, exchange=exchange)
        offs = handle.expert_offsets
    clock("dispatch")
    if experts == "loop":
        ey = old_expert_loop(ex, layer.w1, layer.w2, counts)
    elif experts == "identity":  # (a new tensor where the hooks below need one)
        ey = ex if clock.cuda is None else ex * 1.0
    else:
        ey = layer.experts(ex, offs)
    clock("experts")
    out = (combine_static if kind == "static" else combine)(ey, weights, handle)
    clock("combine")
    if clock.cuda is not None:
        ey.register_hook(lambda g: clock("combine_bwd"))  # combine's backward done
        ex.register_hook(lambda g: clock("experts_bwd"))  # the experts' backward done
    out.backward(grad)
    clock("end")
    return out.detach(), x.grad


def graph_ms(layer, x, grad, variant, iters, warmup, cf, profile=0) -> dict[str, float]:
    """The step captured in one CUDA graph (forward + backward), replayed: median ms."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph (NCCL, autotuning, caches)
        for _ in range(2):
            step(layer, x, grad, variant, NoClock(), cf)
    torch.cuda.current_stream().wait_stream(side)
    layer.zero_grad(set_to_none=True)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(layer, x, grad, variant, NoClock(), cf)
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    if profile:  # the replay's kernels, longest first (torch.profiler: no host time in it)
        from common import kernel_us

        kernels = sorted(kernel_us(graph.replay).items(), key=lambda kv: -kv[1][0])
        for name, (us, n) in kernels[:profile]:
            print(f"  {us:9.1f} us  x{n}  {name[:110]}", file=sys.stderr)
    del graph
    t = torch.tensor([median(times)], dtype=torch.float64, device=x.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {p: float("nan") for p in PHASES} | {"total": t.item()}


class NoClock:
    cuda = None

    def __call__(self, name: str) -> None:
        pass


def rows_bound_ms(tokens, hidden, top_k, cf, world, copy_tbs) -> float:
    """HBM bound of the static MXFP8 row movement, forward + backward of dispatch and combine,
    one rank: every kernel reads and writes its rows once (kept rows T * k, wire rows
    1.03 H + pad bytes, buffers of W * capacity wire rows copied by the exchange, outputs of
    static_rows rows), at the device-copy ceiling (bytes read + written)."""
    from mxfp8_a2a.exchange.rows import wire_row
    from mxfp8_a2a.moe import static_rows

    cap = capacity_for(tokens, top_k, world, cf)
    kept, wire, row = tokens * top_k, wire_row(hidden), 2 * hidden
    buf = world * cap * wire
    out = static_rows(cap, world, 1, 16) * row  # (one expert's padding; the rest is the same)
    a2a = 2 * buf if world > 1 else 0  # (a group of one rank exchanges nothing)
    dispatch_fwd = tokens * row + kept * wire + a2a + kept * wire + out
    dispatch_bwd = kept * row + buf + a2a + kept * wire + tokens * row
    combine_fwd = kept * row + buf + a2a + kept * wire + tokens * row
    combine_bwd = tokens * row + 2 * kept * wire + a2a + kept * wire + out
    total = dispatch_fwd + dispatch_bwd + combine_fwd + combine_bwd
    return total / (copy_tbs * 1e12) * 1e3


def time_variant(layer, x, grad, variant, iters, warmup, cuda, cf, profile) -> dict[str, float]:
    if VARIANTS[variant][4]:
        return graph_ms(layer, x, grad, variant, iters, warmup, cf, profile)
    per_phase = {p: [] for p in PHASES}
    clocks = []
    for i in range(warmup + iters):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        clock = Clock(cuda)
        step(layer, x, grad, variant, clock, cf)
        if i >= warmup:
            clocks.append(clock)
    if cuda:
        torch.cuda.synchronize()
    for clock in clocks:
        for p, v in clock.phases().items():
            per_phase[p].append(v)
    t = torch.tensor([median(per_phase[p]) for p in PHASES], dtype=torch.float64, device=x.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(PHASES, t.tolist(), strict=True))


def bench_shape(text, variants, iters, warmup, device, cf, copy_tbs, profile) -> list[dict]:
    tokens, hidden, top_k, experts, ffn = parse_shape(text)
    cuda = device.type == "cuda"
    layer = make_layer(hidden, ffn, experts, top_k, device)
    g = torch.Generator(device=device).manual_seed(100 + dist.get_rank())
    x = torch.randn(tokens, hidden, device=device, generator=g, dtype=torch.bfloat16)
    x.requires_grad_(True)
    grad = torch.randn(tokens, hidden, device=device, generator=g, dtype=torch.bfloat16)
    rows, first = [], None
    for name in variants:
        kind, exchange, experts, reuse, graph = VARIANTS[name]
        if graph and not cuda:
            continue
        layer.zero_grad(set_to_none=True)
        layer.dispatch_stats.zero_()
        x.grad = None
        block = layer.fp8_weight_reuse() if reuse else contextlib.nullcontext()
        with block:  # (reuse: the weights are cast in this first, untimed step)
            out, gx = step(layer, x, grad, name, Clock(False), cf)
            gx = gx.clone()  # (x.grad is written again below)
            first = first or (out, gx)
            dropped = layer.dispatch_stats[0].item()
            res = time_variant(layer, x, grad, name, iters, warmup, cuda, cf, profile)
        res |= {"shape": text, "variant": name, "path": kind, "exchange": exchange}
        res |= {"experts_gemm": experts, "fp8_weight_reuse": reuse, "graph": graph}
        res |= {"capacity_factor": cf if kind == "static" else None, "dropped_rows": dropped}
        if experts == "identity":
            world = dist.get_world_size()
            res["hbm_bound_ms"] = rows_bound_ms(tokens, hidden, top_k, cf, world, copy_tbs)
        same_model = experts != "identity"
        res |= {"sqnr_out_db": sqnr_db(first[0], out) if same_model else float("nan")}
        res |= {"sqnr_grad_x_db": sqnr_db(first[1], gx) if same_model else float("nan")}
        rows.append(res)
    del layer
    if cuda:
        torch.cuda.empty_cache()
    return rows


HEADERS = ["shape", "variant", "fwd+bwd ms", "fwd ms", "bwd ms", "dispatch ms", "experts ms"]
HEADERS += ["combine ms", "vs first", "dropped", "HBM bound ms", "SQNR out", "SQNR grad x"]


def table(results: list[dict]) -> list[list]:
    out = []
    for r in results:
        same = [q for q in results if q["shape"] == r["shape"]]
        base = same[0]["total"]
        out.append(
            [r["shape"], r["variant"]] + [r[p] for p in PHASES]
            + [base / r["total"], r["dropped_rows"], r.get("hbm_bound_ms", float("nan")),
               r["sqnr_out_db"], r["sqnr_grad_x_db"]]
        )  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    p.add_argument("--shape", action="append", help="TOKENSxHIDDENxTOPKxEXPERTSxFFN per rank")
    p.add_argument("--variant", action="append", choices=tuple(VARIANTS), help="repeatable")
    p.add_argument("--iters", type=int, help="timed iterations (default 20 GPU, 3 CPU)")
    p.add_argument("--warmup", type=int, help="untimed iterations first (default 5 GPU, 1 CPU)")
    p.add_argument("--capacity-factor", type=float, default=1.25, help="static variants")
    p.add_argument("--profile", type=int, default=0, help="print the N longest kernels of "
                   "each graph replay (rank 0 and others alike)")  # fmt: skip
    p.add_argument("--copy-tbs", type=float, default=4.21, help="device copy TB/s (H200)")
    p.add_argument("--json", help="write the results here (rank 0)")
    p.add_argument("--overlap", action="append", metavar="SHARED,CHUNKS",
                   help="instead of the variants: the layer serial vs overlapped for a "
                   "shared MLP width (0: none) and overlap_chunks, repeatable "
                   "(overlap_bench.py)")  # fmt: skip
    args = p.parse_args()

    device = init_from_torchrun()
    cuda = device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes = args.shape or (GPU_SHAPES if cuda else CPU_SHAPES)
    variants = args.variant or DEFAULT_VARIANTS
    iters = args.iters or (20 if cuda else 3)
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
    if rank == 0:
        where = "CUDA" if cuda else "CPU/gloo"
        print(f"{world} rank(s) on {where}; {versions()}", file=sys.stderr)
        if not cuda:
            print("CPU/gloo timings check that the benchmark runs; they say nothing about GPUs.")
        print("'vs first': the first variant's fwd+bwd time over this one's; 'dropped': rows "
              "the static dispatch dropped in one step (capacity factor "
              f"{args.capacity_factor})", file=sys.stderr)  # fmt: skip
    if cuda:
        warm_gpu()
    if args.overlap:
        return overlap_main(args, shapes, iters, warmup, device)
    results = []
    for text in shapes:
        results += bench_shape(text, variants, iters, warmup, device, args.capacity_factor,
                               args.copy_tbs, args.profile)  # fmt: skip
    if rank == 0:
        print(tabulate(table(results), headers=HEADERS, floatfmt=".3f"))
        write_json(
            args.json,
            {"versions": versions(), "world_size": world, "iters": iters, "warmup": warmup,
             "results": results},
        )  # fmt: skip
    dist.destroy_process_group()


def overlap_main(args, shapes, iters, warmup, device) -> None:
    import overlap_bench as ob

    settings = [ob.parse_setting(t) for t in args.overlap]
    rows = []
    for text in shapes:
        rows += ob.overlap_rows(text, parse_shape(text), settings, iters, warmup, device,
                                args.capacity_factor)  # fmt: skip
    if dist.get_rank() == 0:
        print(tabulate(ob.table(rows), headers=ob.HEADERS, floatfmt=".3f"))
        write_json(args.json, {"versions": versions(), "world_size": dist.get_world_size(),
                               "iters": iters, "warmup": warmup, "overlap": rows})  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
