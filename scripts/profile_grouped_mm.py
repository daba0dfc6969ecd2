"""Where the time of the experts' grouped GEMMs goes, piece by piece, on one GPU.

    python scripts/profile_grouped_mm.py [--shape TOKENSxHIDDENxTOPKxEXPERTSxFFN]... [--json F]

The MoE layer's experts (bench_moe_layer.py's shapes): x [tokens * top_k, hidden] rows in
random uneven expert groups, h = gelu(grouped_mm(x, w1)), y = grouped_mm(h, w2), forward and
backward. Times (triton.testing.do_bench, median) of the whole for bf16 and fp8_rowwise, and
of each piece of the fp8_rowwise path on its own: the casts (operand, layout) and each GEMM
(FP8 and bf16), with effective GB/s of the casts (bytes read + written
once). A torch.profiler table of one fp8_rowwise step follows (--profile).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate

from mxfp8_a2a import grouped_mm
from mxfp8_a2a.grouped.torch_gemms import grouped_gemm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import do_bench_ms, versions, warm_gpu, write_json  # noqa: E402

fr = importlib.import_module("mxfp8_a2a.grouped.fp8_rowwise")

SHAPES = ["4096x7168x8x32x2048", "8192x2048x8x16x768"]


def bench(fn) -> float:
    return do_bench_ms(fn, rep_ms=200) * 1e3


def uneven_offsets(m: int, e: int, g: torch.Generator) -> torch.Tensor:
    weights = torch.rand(e, generator=g) + 0.5
    counts = (weights / weights.sum() * m).floor().to(torch.int64)
    counts[-1] += m - counts.sum()
    return counts.cumsum(0).to(torch.int32).cuda()


def _bench_pieces(a, w, g, offs) -> list[tuple[str, object, int]]:
    """(piece, function, elements cast) of one GEMM's operands and products: a [M, K] rows
    grouped by offs, w [E, K, N], g [M, N] the gradient of the output."""
    aq, asc = fr._scale_rows(a)
    wq, ws = fr._weights_per_column(w)
    gq, gs = fr._scale_rows(g)
    wr, wrs = fr._weights_per_row(w)
    return [
        (f"fwd: scale rows of a {list(a.shape)}", lambda: fr._scale_rows(a), a.numel()),
        (f"fwd: w per column {list(w.shape)}", lambda: fr._weights_per_column(w), w.numel()),
        ("fwd: FP8 GEMM", lambda: fr._scaled_gmm(aq, wq, asc, ws, offs), 0),
        (f"bwd: scale rows of grad {list(g.shape)}", lambda: fr._scale_rows(g), g.numel()),
        ("bwd: w per row", lambda: fr._weights_per_row(w), w.numel()),
        ("bwd: grad_x FP8 GEMM", lambda: fr._scaled_gmm(gq, wr, gs, wrs, offs), 0),
        ("bwd: grad_w a padded per group", lambda: fr.padded_token_scales(a, offs), a.numel()),
        ("bwd: grad_w grad padded per group", lambda: fr.padded_token_scales(g, offs), g.numel()),
        ("bwd: grad_w whole (casts + FP8 GEMM)", lambda: fr._fp8_grad_w(a, g, offs), 0),
        ("fwd: bf16 GEMM", lambda: grouped_gemm(a, w, offs), 0),
        ("bwd: bf16 grad_w GEMM", lambda: grouped_gemm(a.t(), g, offs), 0),
    ]


def pieces(x, w1, w2, offs) -> list[tuple[str, float, int]]:
    """(piece, us, bytes moved once) of one fp8_rowwise forward + backward of the two GEMMs."""
    h = F.gelu(grouped_mm(x, w1, offs))
    gh = torch.randn_like(h)
    go = torch.randn(x.shape[0], w2.shape[2], dtype=x.dtype, device=x.device)
    out = []
    for tag, a, w, g in (("w1", x, w1, gh), ("w2", h, w2, go)):
        for name, fn, elems in _bench_pieces(a, w, g, offs):
            out.append((f"{tag} {name}", bench(fn), 3 * elems))
    return out


def expert_inputs(text: str):
    """For a shape TOKENSxHIDDENxTOPKxEXPERTSxFFN, on the GPU, seeded: x [tokens * top_k,
    hidden] bf16 (requires grad), w1 [experts, hidden, ffn] and w2 [experts, ffn, hidden]
    bf16 (require grad), offs int32 [experts] (uneven groups) and the output's gradient."""
    tokens, hidden, top_k, experts, ffn = (int(v) for v in text.split("x"))
    m = tokens * top_k
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, hidden, generator=g).to(torch.bfloat16).cuda().requires_grad_()
    w1 = (torch.randn(experts, hidden, ffn, generator=g) * hidden**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(experts, ffn, hidden, generator=g) * ffn**-0.5).to(torch.bfloat16)
    w1, w2 = w1.cuda().requires_grad_(), w2.cuda().requires_grad_()
    offs = uneven_offsets(m, experts, g)
    go = torch.randn(m, hidden, generator=g).to(torch.bfloat16).cuda()
    return x, w1, w2, offs, go


def experts_step(x, w1, w2, offs, go, precision: str) -> tuple[torch.Tensor, ...]:
    """One forward+backward of the experts: gelu(x @ w1[e]) @ w2[e], grad go. The gradients
    of x, w1 and w2 are returned fresh, as in a step after zero_grad(set_to_none=True) (a
    backward into .grad would add into the previous step's gradients, traffic a real step
    does not have)."""
    h = F.gelu(grouped_mm(x, w1, offs, precision=precision))
    return torch.autograd.grad(grouped_mm(h, w2, offs, precision=precision), (x, w1, w2), go)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", action="append")
    p.add_argument("--json")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    results = []
    print(versions())
    warm_gpu()
    for text in args.shape or SHAPES:
        inputs = expert_inputs(text)
        x, w1, w2, offs, _ = inputs
        whole = {
            p: bench(functools.partial(experts_step, *inputs, p))
            for p in ("bf16", "fp8_rowwise", "fp8_rowwise_gw_hp")
        }
        ratio, ratio_hp = (whole["bf16"] / whole[p] for p in ("fp8_rowwise", "fp8_rowwise_gw_hp"))
        print(
            f"{text}: experts fwd+bwd bf16 {whole['bf16']:.0f} us, "
            f"fp8_rowwise {whole['fp8_rowwise']:.0f} us ({ratio:.2f}x), fp8_rowwise_gw_hp "
            f"{whole['fp8_rowwise_gw_hp']:.0f} us ({ratio_hp:.2f}x)"
        )
        with torch.no_grad():
            rows = pieces(x.detach(), w1.detach(), w2.detach(), offs)
        table = [[n, us, b / us / 1e3 if b else None] for n, us, b in rows]
        print(tabulate(table, headers=["piece", "us", "GB/s"], floatfmt=".1f"), flush=True)
        results.append({"shape": text, "whole_us": whole, "pieces": table})
        if args.profile:
            for _ in range(3):
                experts_step(*inputs, "fp8_rowwise")
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                experts_step(*inputs, "fp8_rowwise")
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    write_json(args.json, {"versions": versions(), "results": results})


if __name__ == "__main__":
    main()
