"""Per-group FP8 scaling of jagged tensors: torch loop vs Triton direct vs Triton transpose.

    python benchmarks/bench_per_group_scales.py [--json out.json]

x (16640, 8192) bf16; per_group_rowwise_scales with groups along dim 1 (random jagged end
offsets, multiples of 16), and per_group_colwise_scales with groups along dim 0. "GB/s":
effective, the fewest bytes any method must move (x read once, data and scales written
once) over its time, so methods compare directly. "raw GB/s": the bytes each method reads
and writes (x read twice for groups too long for one tile, the transpose's copy
included). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import do_bench_ms, versions, warm_gpu, write_json
from tabulate import tabulate

from mxfp8_a2a import _config, per_group_colwise_scales, per_group_rowwise_scales
from mxfp8_a2a.grouped.reference import per_group_colwise_reference, per_group_rowwise_reference

N, M = 16640, 8192
FAST = dict(validate=False)  # no host read of offs: the kernels alone
# Warm-up of each kernel timing. The torch loop before it keeps the GPU mostly idle (launch-
# bound), and with 50 ms of warm-up the first kernel timed after it measured up to 20% slow
# on an H200 against repeated timings (BENCHMARKS.md); 250 ms of steady work comes first.
WARMUP_MS = 250


def jagged_offsets(total: int, n_groups: int, g: torch.Generator) -> torch.Tensor:
    cuts = torch.randperm(total // 16 - 1, generator=g)[: n_groups - 1].add(1).mul(16).sort().values
    return torch.cat([cuts, torch.tensor([total])]).to(torch.int32).cuda()


def kernel_bytes(ends: list[int], n_other: int, group_dim: int, elem: int = 2) -> int:
    """Bytes the per-group kernel reads and writes: each group's x once (twice when it is
    longer than the largest size class of the GPU tiling; for rowwise the second read mostly
    hits L2), its e4m3 data and fp32 scales once."""
    tiling = _config.per_group_tiling(group_dim, interpreted=False)
    longest = tiling.min_group << (tiling.n_classes - 1)
    align = 16 if group_dim == 1 else 1  # rowwise tiles start on 16-element boundaries
    total, start = 0, 0
    for end in ends:
        reads = 1 if end - start // align * align <= longest else 2
        total += n_other * ((end - start) * (reads * elem + 1) + 4)
        start = end
    return total


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_per_group_scales.py needs a CUDA GPU")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, M, dtype=torch.bfloat16).cuda()
    elems = N * M
    # On a freshly started H200 the first rowwise timing measured 138 us at 1 group against
    # 102 us in two later runs on the same machine (BENCHMARKS.md): the kernel runs first.
    whole = torch.tensor([M], dtype=torch.int32, device="cuda")
    warm_gpu(lambda: per_group_rowwise_scales(x, whole, **FAST))
    rows = []
    for n_groups in (1, 16, 64):
        # rowwise: groups along dim 1 (M)
        offs = jagged_offsets(M, n_groups, g)
        t_loop = do_bench_ms(lambda offs=offs: per_group_rowwise_reference(x, offs), rep_ms=200)
        t_direct = do_bench_ms(
            lambda o=offs: per_group_rowwise_scales(x, o, method="direct", **FAST), WARMUP_MS
        )
        t_tr = do_bench_ms(
            lambda o=offs: per_group_rowwise_scales(x, o, method="transpose", **FAST), WARMUP_MS
        )
        t_checked = do_bench_ms(lambda o=offs: per_group_rowwise_scales(x, o), WARMUP_MS)
        # colwise: groups along dim 0 (N)
        offs0 = jagged_offsets(N, n_groups, g)
        t_col_loop = do_bench_ms(lambda o=offs0: per_group_colwise_reference(x, o), rep_ms=200)
        t_col = do_bench_ms(lambda o=offs0: per_group_colwise_scales(x, o, **FAST), WARMUP_MS)
        t_col_checked = do_bench_ms(lambda o=offs0: per_group_colwise_scales(x, o), WARMUP_MS)
        minimal = 3 * elems + 4 * n_groups * N
        ends = offs.tolist()
        raw_direct = kernel_bytes(ends, N, group_dim=1)
        raw_tr = 4 * elems + kernel_bytes(ends, N, group_dim=0)  # copy, then colwise
        raw_col = kernel_bytes(offs0.tolist(), M, group_dim=0)
        rows.append(
            {
                "n_groups": n_groups,
                "torch loop us": t_loop * 1e3,
                "direct us": t_direct * 1e3,
                "transpose us": t_tr * 1e3,
                "direct GB/s": minimal / t_direct / 1e6,
                "transpose GB/s": minimal / t_tr / 1e6,
                "direct raw GB/s": raw_direct / t_direct / 1e6,
                "transpose raw GB/s": raw_tr / t_tr / 1e6,
                "direct speedup": t_loop / t_direct,
                "transpose speedup": t_loop / t_tr,
                "validated us": t_checked * 1e3,
                "colwise loop us": t_col_loop * 1e3,
                "colwise us": t_col * 1e3,
                "colwise GB/s": minimal / t_col / 1e6,
                "colwise raw GB/s": raw_col / t_col / 1e6,
                "colwise speedup": t_col_loop / t_col,
                "colwise validated us": t_col_checked * 1e3,
            }
        )
    info = versions()
    print(" ".join(f"{k}={v}" for k, v in info.items()), f"shape={N}x{M} bf16")
    print(tabulate(rows, headers="keys", floatfmt=".2f"))
    print(
        "GB/s: effective, 3 bytes per element + 4 per scale over each method's time; raw "
        "GB/s: the bytes each method moves. "
        "direct/transpose/colwise: validate=False (no host sync); validated: the defaults "
        "(method auto = direct, validate=True: one host read of offs per call)."
    )
    write_json(args.json, {"versions": info, "shape": [N, M], "results": rows})


if __name__ == "__main__":
    main()
