"""bench_moe_layer.py --overlap SHARED,CHUNKS: the whole layer (router, dispatch, experts,
combine, shared experts), forward + backward through ``layer(x)``, eager, with the exchange
on one stream (serial: ``overlap_streams = False``) and on its own stream (overlapped), for
each (shared MLP width, 0: none; overlap_chunks) and both dispatch paths.

Per row: the median step time of each mode (CUDA events around forward + backward after a
barrier and a device sync; the max over ranks) and serial / overlapped. Only the step time:
the exposed exchange time (the step minus the same step with the exchange replaced by a
local copy of equal bytes) is not measured here, and at one rank the exchange moves nothing
over NCCL (its work is the row kernels), so one GPU shows the schedule's cost, not its gain.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from common import Timer

from mxfp8_a2a.moe.layer import ExpertParallelMoE

HEADERS = ["shape", "path", "shared", "chunks", "serial ms", "overlapped ms", "serial/overl."]


def parse_setting(text: str) -> tuple[int, int]:
    """'SHARED,CHUNKS' -> (shared MLP width, 0: none; overlap_chunks)."""
    try:
        shared, chunks = (int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(
            f"--overlap must look like SHARED,CHUNKS (e.g. 2048,2), got {text!r}"
        ) from None
    return shared, chunks


def _layer(shape, shared, chunks, static, cf, device) -> ExpertParallelMoE:
    tokens, hidden, top_k, experts, ffn = shape
    world = dist.get_world_size()
    extra = dict(capacity_factor=cf, max_tokens=tokens) if static else {}
    layer = ExpertParallelMoE(hidden, ffn, experts * world, top_k, shared_ffn=shared or None,
                              overlap_chunks=chunks, device="meta", **extra)  # fmt: skip
    layer = layer.to_empty(device=device)
    with torch.no_grad():  # (the router and the shared MLP the same on every rank)
        for name, p in layer.named_parameters():
            torch.manual_seed(1 + dist.get_rank() if name.startswith("experts") else 0)
            p.normal_().mul_(p.shape[-2] ** -0.5)
        layer.dispatch_stats.zero_()
    return layer.to(torch.bfloat16)


def _step_ms(layer, x, grad, iters, warmup) -> float:
    """common.Timer's median step (forward + backward of ``layer(x)``), max over ranks."""

    def step(_):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(grad)

    return Timer(x.device, iters, warmup)(step)


def overlap_rows(text, shape, settings, iters, warmup, device, cf) -> list[dict]:
    """One row per (path, setting) of one shape (see the module docstring)."""
    cuda = device.type == "cuda"
    tokens, hidden = shape[:2]
    g = torch.Generator(device=device).manual_seed(100 + dist.get_rank())
    x = torch.randn(tokens, hidden, device=device, generator=g, dtype=torch.bfloat16)
    x.requires_grad_(True)
    grad = torch.randn(tokens, hidden, device=device, generator=g, dtype=torch.bfloat16)
    rows = []
    for path in ("sync", "static"):
        for shared, chunks in settings:
            layer = _layer(shape, shared, chunks, path == "static", cf, device)
            res = {"shape": text, "path": path, "shared_ffn": shared, "overlap_chunks": chunks}
            for mode, streams in (("serial", False), ("overlapped", True)):
                layer.overlap_streams = streams
                res[f"{mode}_ms"] = _step_ms(layer, x, grad, iters, warmup)
            rows.append(res)
            del layer
            if cuda:
                torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> list[list]:
    return [[r["shape"], r["path"], r["shared_ffn"], r["overlap_chunks"], r["serial_ms"],
             r["overlapped_ms"], r["serial_ms"] / r["overlapped_ms"]] for r in rows]  # fmt: skip
