"""Where the time of a small exchange goes: host time per call against GPU time per call.

    torchrun --nproc-per-node=2 scripts/host_cost.py [--shape 256x5120] [--calls 100]

For each step of the bf16 and MXFP8 exchanges, three numbers in microseconds (max over ranks):
  host  - wall clock of --calls back-to-back calls / calls, no synchronization in between
          (what the CPU spends to launch one call);
  gpu   - CUDA events around the same calls queued behind a long sleep kernel, so the GPU
          runs them back to back (what one call costs the GPU when the host is ahead);
  cold  - the benchmark's method: barrier, device sync, events around one call (median);
  behind 50 ms sleep - host time of one call queued behind a 50 ms GPU sleep: about 50000
          when the call waits for the GPU.
Then a cProfile of the MXFP8 forward on rank 0 (top functions by cumulative and by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
import torch.distributed as dist
import triton

import mxfp8_a2a as mx
from mxfp8_a2a._launch import init_from_torchrun
from mxfp8_a2a.dequantize import dequantize_packed
from mxfp8_a2a.quantize import quantize_packed


def _max(v: float, device: torch.device) -> float:
    t = torch.tensor([v], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def measure(fn, calls: int, device: torch.device) -> tuple[float, ...]:
    for _ in range(5):
        fn()
    dist.barrier()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(host * calls * 4e3))  # ~2 GHz clock: twice the host time
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    gpu = start.elapsed_time(end) / calls * 1e3
    cold = []
    for _ in range(20):
        dist.barrier()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        cold.append(s.elapsed_time(e) * 1e3)
    cold.sort()
    # one call queued behind a 50 ms sleep: its host time shows whether it waits for the GPU
    dist.barrier()
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)
    t0 = time.perf_counter()
    fn()
    blocked = (time.perf_counter() - t0) * 1e6
    torch.cuda.synchronize()
    return tuple(_max(v, device) for v in (host, gpu, cold[len(cold) // 2], blocked))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", action="append")
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--cprofile-chunks", type=int, default=1, help="chunks of the profiled forward")
    args = p.parse_args()
    device = init_from_torchrun()
    for shape in args.shape or ["256x5120"]:
        run_shape(shape, args.calls, device, args.cprofile_chunks)
    dist.destroy_process_group()


def _async_opts() -> dist.AllToAllOptions:
    opts = dist.AllToAllOptions()
    opts.asyncOp = True
    return opts


def _direct_quantize(x: torch.Tensor):
    """Launch the quantize kernel through JITFunction.run, or through the CompiledKernel
    that run returned (no argument binding or specialization on the host)."""
    from mxfp8_a2a import _config
    from mxfp8_a2a.quantize import _capability, _quantize_kernel

    k = x.shape[1]
    row = mx.packed_row_bytes(k)
    out = torch.empty((x.shape[0], row), dtype=torch.uint8, device=x.device)
    n_groups = x.shape[0] * k // 32
    block_g, warps = _config.QUANTIZE_BLOCK_G, _config.QUANTIZE_NUM_WARPS
    grid = (triton.cdiv(n_groups, block_g),)
    args = [x, out, out[:, k:], n_groups, k // 32, 0, 0, x.stride(0), 1, row, row]
    hw_e8m0 = _capability(x.device) >= 10
    consts = dict(RCEIL=True, BLOCK_G=block_g, SOFT=False, HW_E8M0=hw_e8m0, INT64=False)
    compiled = _quantize_kernel[grid](*args, **consts, num_warps=warps)
    runner = compiled[(grid[0], 1, 1)]
    all_args = args + list(consts.values())

    def launch(cached: bool) -> None:
        if cached:
            runner(*all_args)
        else:
            _quantize_kernel[grid](*args, **consts, num_warps=warps)

    return launch


def run_shape(shape: str, calls: int, device: torch.device, cprofile_chunks: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, dim = (int(v) for v in shape.split("x"))
    splits = [tokens // world] * world
    splits[rank] += tokens - sum(splits)
    out_splits = mx.compute_output_splits(splits)
    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)
    y = torch.empty(sum(out_splits), dim, device=device, dtype=torch.bfloat16)
    packed = quantize_packed(x)
    recv = packed.new_empty((sum(out_splits), packed.shape[1]))
    launch = _direct_quantize(x)
    steps = {
        "quantize kernel[grid](...)": lambda: launch(False),
        "quantize CompiledKernel": lambda: launch(True),
        "torch.empty": lambda: torch.empty_like(x),
        "bf16 all_to_all_single": lambda: dist.all_to_all_single(y, x, out_splits, splits),
        "quantize_packed": lambda: quantize_packed(x),
        "uint8 all_to_all_single": lambda: dist.all_to_all_single(recv, packed, out_splits, splits),
        "dequantize_packed": lambda: dequantize_packed(recv),
        "alltoall_base (async, wait)": lambda: dist.group.WORLD.alltoall_base(
            recv, packed, out_splits, splits, _async_opts()
        ).wait(),
        "quantize_dequantize": lambda: mx.quantize_dequantize(x),
        "a2a, fresh recv": lambda: dist.all_to_all_single(
            torch.empty_like(recv), packed, out_splits, splits
        ),
        "quantize + a2a": lambda: dist.all_to_all_single(
            recv, quantize_packed(x), out_splits, splits
        ),
        "torch copy + a2a": lambda: (
            packed.copy_(recv),
            dist.all_to_all_single(recv, packed, out_splits, splits),
        ),
        "a2a + dequantize": lambda: (
            dist.all_to_all_single(recv, packed, out_splits, splits),
            dequantize_packed(recv),
        ),
        "mxfp8 fwd (chunks=1)": lambda: mx.to_mxfp8_a2a_dequant(x, out_splits, splits),
        "mxfp8 fwd (chunks=4)": lambda: mx.to_mxfp8_a2a_dequant(x, out_splits, splits, chunks=4),
        "4 x alltoall_base (async)": lambda: [
            w.wait()
            for w in [
                dist.group.WORLD.alltoall_base(recv, packed, out_splits, splits, _async_opts())
                for _ in range(4)
            ]
        ],
    }
    rows = []
    with torch.no_grad():
        for name, fn in steps.items():
            rows.append((name, *measure(fn, calls, device)))
    if rank == 0:
        print(f"\n{shape}, world {world}: us per call (max over ranks)")
        print(f"{'step':28s} {'host':>9s} {'gpu':>9s} {'cold':>9s} {'behind 50 ms sleep':>19s}")
        for name, h, g, c, b in rows:
            print(f"{name:28s} {h:9.1f} {g:9.1f} {c:9.1f} {b:19.1f}")
    prof = cProfile.Profile()
    with torch.no_grad():
        prof.enable()
        for _ in range(calls):
            mx.to_mxfp8_a2a_dequant(x, out_splits, splits, chunks=cprofile_chunks)
        prof.disable()
    torch.cuda.synchronize()
    if rank == 0:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
        pstats.Stats(prof).sort_stats("tottime").print_stats(40)


if __name__ == "__main__":
    main()
