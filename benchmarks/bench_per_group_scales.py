"""Per-group FP8 scaling of jagged tensors in every layout: torch loop vs each kernel method.

    python benchmarks/bench_per_group_scales.py [--json out.json] [--check] [--groups 1 16 64]

x (16640, 8192) bf16, row-major, random jagged end offsets on 16-element boundaries. Layouts:

- grad_w colwise: per_group_colwise_scales(x, offs, data_layout="column_major"), groups along
  the 16640 tokens: the A / B operands of the 2-D x 2-D torch._scaled_grouped_mm (x^T as a
  row-major (K, M), grad_out column-major (M, N));
- grad_w rowwise(x.t()): the same, spelled per_group_rowwise_scales(x.t(), offs) on the
  transposed view (row-major data of x.t());
- colwise contiguous: per_group_colwise_scales(x, offs), row-major data;
- rowwise contiguous: per_group_rowwise_scales(x, offs), groups along the 8192 columns.

Methods: "auto" (what the library picks from the strides), "direct" and "transpose" (the two
kernels, results identical; see per_group_scales.py). "GB/s": effective, the fewest bytes any
method must move (x read once, data and scales written once) over its time, so methods compare
directly. All kernel timings use validate=False (no host read of offs). --check compares every
method's bits with the reference at full size. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import Help, do_bench_ms, versions, warm_gpu, write_json
from tabulate import tabulate

from mxfp8_a2a import per_group_colwise_scales, per_group_rowwise_scales
from mxfp8_a2a.grouped.reference import per_group_colwise_reference, per_group_rowwise_reference

M, K = 16640, 8192  # tokens x hidden
METHODS = ("auto", "direct", "transpose")
# Warm-up of each kernel timing. The torch loop before it keeps the GPU mostly idle (launch-
# bound), and with 50 ms of warm-up the first kernel timed after it measured slow on an H200
# against repeated timings; 250 ms of steady work comes first.
WARMUP_MS = 250


def jagged_offsets(total: int, n_groups: int, g: torch.Generator) -> torch.Tensor:
    cuts = torch.randperm(total // 16 - 1, generator=g)[: n_groups - 1].add(1).mul(16).sort().values
    return torch.cat([cuts, torch.tensor([total])]).to(torch.int32).cuda()


LAYOUT_NAMES = [
    "grad_w colwise",
    "grad_w rowwise(x.t())",
    "colwise contiguous",
    "rowwise contiguous",
]


def layouts(x: torch.Tensor) -> list[tuple[str, object, object, torch.Tensor, int, str]]:
    """(name, function, reference, input, group-axis length, data layout)."""
    col, row = per_group_colwise_scales, per_group_rowwise_scales
    col_ref, row_ref = per_group_colwise_reference, per_group_rowwise_reference
    cases = [
        (col, col_ref, x, M, "column_major"),
        (row, row_ref, x.t(), M, "row_major"),
        (col, col_ref, x, M, "row_major"),
        (row, row_ref, x, K, "row_major"),
    ]
    return [(name, *case) for name, case in zip(LAYOUT_NAMES, cases, strict=True)]


def same(a, b) -> bool:
    return a[0].stride() == b[0].stride() and torch.equal(
        a[0].view(torch.uint8), b[0].view(torch.uint8)
    ) and torch.equal(a[1].nan_to_num(), b[1].nan_to_num())  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    p.add_argument("--json", help="write the results to this JSON file")
    p.add_argument("--check", action="store_true", help="compare bits with the reference")
    p.add_argument("--groups", type=int, nargs="+", default=[1, 16, 64],
                   help="numbers of jagged groups to time")  # fmt: skip
    p.add_argument(
        "--layout", action="append", choices=LAYOUT_NAMES, help="only these layouts (repeatable)"
    )
    p.add_argument("--no-loop", action="store_true", help="skip the torch loop timings")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_per_group_scales.py needs a CUDA GPU")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, dtype=torch.bfloat16).cuda()
    # On a freshly started H200 the first timing measured 138 us against 102 us in later
    # runs on the same machine (2026-12-01): steady work first.
    whole = torch.tensor([K], dtype=torch.int32).cuda()
    warm_gpu(lambda: per_group_rowwise_scales(x, whole, validate=False))
    rows, failures = [], []
    offsets = {(n, total): jagged_offsets(total, n, g) for n in args.groups for total in (M, K)}
    for name, fn, ref, xin, total, layout in layouts(x):
        if args.layout and name not in args.layout:
            continue
        for n_groups in args.groups:
            offs = offsets[n_groups, total]
            n_other = x.numel() // total
            minimal = 3 * x.numel() + 4 * n_groups * n_other
            row = {"layout": name, "groups": n_groups}
            want = ref(xin, offs, False, layout) if args.check else None
            if not args.no_loop:
                t = do_bench_ms(
                    lambda o=offs, f=ref, a=xin, d=layout: f(a, o, False, d), rep_ms=200
                )
                row["torch loop us"] = t * 1e3
            for method in METHODS:
                call = lambda f=fn, a=xin, o=offs, m=method, d=layout: f(  # noqa: E731
                    a, o, method=m, data_layout=d, validate=False
                )
                if args.check and not same(call(), want):
                    failures.append(f"{name} groups={n_groups} method={method}")
                t = do_bench_ms(call, WARMUP_MS)
                row[f"{method} us"] = t * 1e3
                row[f"{method} GB/s"] = minimal / t / 1e6
                if "torch loop us" in row:
                    row[f"{method} vs loop"] = row["torch loop us"] / row[f"{method} us"]
            rows.append(row)
            print(row, flush=True)
    info = versions()
    print(" ".join(f"{k}={v}" for k, v in info.items()), f"shape={M}x{K} bf16")
    print(tabulate(rows, headers="keys", floatfmt=".1f"))
    print(
        "GB/s: effective, 3 bytes per element + 4 per scale over each method's time. "
        "All kernel timings: validate=False (no host sync)."
    )
    if args.check:
        print("check:", "every method matched the reference bit for bit" if not failures else "")
        for f in failures:
            print("MISMATCH", f)
    write_json(
        args.json,
        {"versions": info, "shape": [M, K], "results": rows, "check_failures": failures},
    )
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
