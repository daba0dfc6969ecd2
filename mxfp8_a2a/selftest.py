"""A quick check after install, one command, under 2 minutes on 2 CPU cores:

    python -m mxfp8_a2a.selftest

Two processes on gloo (CPU tensors; no GPU needed) check, and rank 0 prints one line each:

1. the cast: quantize, dequantize and the one-pass round trip by the Triton kernels equal the
   plain-torch reference bit for bit (on a CUDA GPU where there is one, else in Triton's CPU
   interpreter), and the round trip's error is within MXFP8's rounding (< 2**-4 of a row's max);
2. an exchange at 2 ranks: each rank receives the rows sent to it, as quantize -> dequantize of
   them, and the gradient returns as MXFP8 of the gradient;
3. the MoE layer at 2 ranks, host-synced and static dispatch: forward and backward, the MXFP8
   wires within MXFP8's rounding of the bf16 wires (> 20 dB), the gradients finite and
   non-zero, and the static dispatch equal to the host-synced one when no row is dropped.

Exit status 0 when all pass; a failure prints its rank's traceback and exits non-zero. The full
suite (``python -m pytest -q tests``, a source checkout) checks far more: see README.md.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Signal to quantization-noise ratio in dB."""
    return float(10 * torch.log10(ref.square().sum() / (got - ref).square().sum().clamp_min(1e-30)))


def check_cast(device: torch.device) -> str:
    import mxfp8_a2a as mx

    x = torch.randn(64, 256, device=device, dtype=torch.bfloat16) * 3
    x[0, :32] = 0  # an all-zero block
    x[1, :32] *= 1e4  # a block of large values
    data, scales = mx.quantize(x, backend="triton")
    ref_data, ref_scales = mx.quantize_reference(x)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8)), "quantize != reference"
    assert torch.equal(scales.view(torch.uint8), ref_scales.view(torch.uint8)), "scales differ"
    back = mx.dequantize(data, scales, out_dtype=x.dtype, backend="triton")
    assert torch.equal(back, mx.dequantize_reference(ref_data, ref_scales, out_dtype=x.dtype))
    assert torch.equal(mx.quantize_dequantize(x, backend="triton"), back), "round trip differs"
    err = ((back - x).abs().amax(-1) / x.abs().amax(-1)).max().item()
    assert err < 2**-4, f"round-trip error {err} of a row's max, MXFP8 allows < 2**-4"
    where = "the GPU" if device.type == "cuda" else "Triton's CPU interpreter"
    return f"ok  cast: Triton kernels on {where} equal the reference; error {err:.4f} of max"


def check_exchange(rank: int) -> str:
    import mxfp8_a2a as mx

    torch.manual_seed(rank)
    input_splits = [3 + rank + d for d in range(WORLD)]  # rows for rank d, uneven
    output_splits = mx.compute_output_splits(input_splits)
    assert output_splits == [3 + s + rank for s in range(WORLD)], output_splits
    x = torch.randn(sum(input_splits), 256, requires_grad=True)
    y = mx.to_mxfp8_a2a_dequant(x, output_splits, input_splits)
    everyone = [torch.empty(sum(3 + s + d for d in range(WORLD)), 256) for s in range(WORLD)]
    dist.all_gather_object(everyone, x.detach())  # (uneven shapes: as objects)
    want = [xs.split([3 + s + d for d in range(WORLD)])[rank] for s, xs in enumerate(everyone)]
    assert torch.equal(y, mx.quantize_dequantize(torch.cat(want))), "rows arrived wrong"
    (2 * y).sum().backward()  # the gradient of each row: 2, exact in MXFP8
    assert torch.equal(x.grad, torch.full_like(x, 2.0)), "gradient came back wrong"
    return f"ok  exchange: {WORLD} ranks on gloo, uneven splits, forward and backward exact"


def check_layer(rank: int) -> str:
    import mxfp8_a2a as mx

    torch.manual_seed(100 + rank)
    x = torch.randn(32, 256)
    static = dict(max_tokens=32, capacity_factor=2.0)
    outs, grads = {}, {}
    for name, kw in [
        ("synced bf16", dict(exchange="bf16")),
        ("synced mxfp8", dict(exchange="mxfp8")),
        ("static bf16", dict(exchange="bf16", **static)),
        ("static mxfp8", dict(exchange="mxfp8", **static)),
    ]:
        layer = mx.ExpertParallelMoE(256, 512, 4 * WORLD, 2, seed=0, **kw)
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.square().mean().backward()
        for g in (xi.grad, layer.w1.grad, layer.w2.grad, layer.router.grad):
            assert g is not None and g.isfinite().all() and g.abs().sum() > 0, f"{name}: grads"
        if "static" in name:
            mx.check_no_drops(layer.dispatch_stats)
        outs[name], grads[name] = out.detach(), xi.grad
    for wire in ("bf16", "mxfp8"):
        torch.testing.assert_close(outs[f"static {wire}"], outs[f"synced {wire}"])
        torch.testing.assert_close(grads[f"static {wire}"], grads[f"synced {wire}"])
    db = min(_sqnr(outs["synced bf16"], outs["synced mxfp8"]),
             _sqnr(grads["synced bf16"], grads["synced mxfp8"]))  # fmt: skip
    assert db > 20, f"MXFP8 wires {db:.1f} dB from bf16 ones (want > 20)"
    return (f"ok  layer: {WORLD} ranks, host-synced and static dispatch, forward and backward; "
            f"MXFP8 wires {db:.1f} dB from bf16, static = synced")  # fmt: skip


def _rank(rank: int, store_path: str) -> None:
    store = dist.FileStore(store_path, WORLD)
    timeout = datetime.timedelta(seconds=120)  # a hang fails instead of waiting forever
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    try:
        if rank == 0:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            _say(rank, check_cast(device))
        _say(rank, check_exchange(rank))
        _say(rank, check_layer(rank))
    finally:
        dist.destroy_process_group()


def main() -> int:
    import mxfp8_a2a as mx

    start = time.perf_counter()
    print(f"mxfp8_a2a {mx.__version__}, torch {torch.__version__}, "
          f"{'CUDA' if torch.cuda.is_available() else 'CPU only'}")  # fmt: skip
    if not torch.cuda.is_available():  # the ranks run the kernels in Triton's interpreter
        os.environ["TRITON_INTERPRET"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(_rank, args=(os.path.join(tmp, "store"),), nprocs=WORLD)
        except mp.ProcessRaisedException as e:
            print(f"FAILED:\n{e}", file=sys.stderr)
            return 1
    print(f"all passed in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
