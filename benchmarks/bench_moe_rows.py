"""Dispatch's and combine's row movement, forward+backward, without the exchange: torch
indexing (``x[index]``, whose backward is index_put_ with accumulate, and a broadcast
multiply and sum over the top-k slots) against the package's ``take_rows`` and
``slot_sum`` (mxfp8_a2a/moe/permute.py, slot_sum.py).

    python benchmarks/bench_moe_rows.py [--shape 8192x8x2048 ...] [--iters 30] [--json out.json]

Shapes are TOKENSxTOPKxHIDDEN (bf16 rows); tokens go to 32 random experts and are sorted by
them, as dispatch sorts them. Steps: dispatch's gather of k copies per token, a permutation
of the rows (dispatch's regroup, combine's inverse), combine's gather and weighted sum
(forward+backward, and forward alone). CUDA events around each call, median of --iters after
5 warm-up calls; "max |diff|" compares the two outputs. On CPU the timings only check that
the script runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import report, warm_gpu

from mxfp8_a2a.moe.permute import take_rows
from mxfp8_a2a.moe.slot_sum import slot_sum

DEFAULT_SHAPES = ["8192x8x2048", "4096x8x7168"]  # bench_moe_layer.py's per-rank shapes


def _ms(fn, iters: int, cuda: bool) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def bench_shape(text: str, iters: int, device: torch.device) -> list[dict]:
    t, k, h = (int(v) for v in text.lower().split("x"))
    n, dt = t * k, torch.bfloat16
    order = torch.sort(torch.randint(0, 32, (n,), device=device), stable=True).indices
    inv, perm = _inverse(order), torch.randperm(n, device=device)
    pinv = _inverse(perm)
    x = torch.randn(t, h, device=device, dtype=dt, requires_grad=True)
    rows = torch.randn(n, h, device=device, dtype=dt, requires_grad=True)
    w = torch.rand(t, k, device=device, requires_grad=True)
    g_rows = torch.randn(n, h, device=device, dtype=dt)
    g_tok = torch.randn(t, h, device=device, dtype=dt)

    def torch_tail():
        slots = rows[inv].view(t, k, h)
        return (slots * w.unsqueeze(-1).to(dt)).sum(1)

    steps = {
        "gather x, k copies per token": (
            lambda: x[order // k], lambda: take_rows(x, order // k, inv, k), (x,), g_rows),
        "permutation of the rows": (
            lambda: rows[perm], lambda: take_rows(rows, perm, pinv), (rows,), g_rows),
        "combine's gather + weighted sum": (
            torch_tail, lambda: slot_sum(rows, inv.view(t, k), w), (rows, w), g_tok),
    }  # fmt: skip
    cuda, out = device.type == "cuda", []
    # forward bytes: rows written and read (gathers), rows read and tokens written (the sum)
    moved = dict.fromkeys(steps, 2 * n * h * 2)
    moved["combine's gather + weighted sum"] = (n + t) * h * 2
    for name, (ref, ours, inputs, grad) in steps.items():
        diff = (ref().float() - ours().float()).abs().max().item()
        for label, fn in (("torch", ref), ("mxfp8_a2a", ours)):
            fb = _ms(lambda f=fn, i=inputs, g=grad: torch.autograd.grad(f(), i, g), iters, cuda)
            with torch.no_grad():
                fwd = _ms(fn, iters, cuda)
            out.append(
                {"shape": text, "step": name, "impl": label, "fwd+bwd ms": fb, "fwd ms": fwd,
                 "fwd GB/s": moved[name] / fwd / 1e6, "max |diff|": diff}
            )  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", action="append", help="TOKENSxTOPKxHIDDEN (repeatable)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", help="write the results to this JSON file")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = args.shape or (DEFAULT_SHAPES if device.type == "cuda" else ["64x4x256"])
    if device.type == "cuda":
        warm_gpu()  # the first case timed is torch's: not on a cold GPU
    results = []
    for text in shapes:
        results += bench_shape(text, args.iters, device)
    report(results, args.json)


if __name__ == "__main__":
    main()
