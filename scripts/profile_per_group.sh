#!/usr/bin/env bash
# Profile one launch of the per-group scaling kernel with Nsight Compute, if the machine
# has it: throughput vs peak (DRAM, SM issue), warp stall reasons, registers, occupancy.
#
#   scripts/profile_per_group.sh OUTDIR [N_GROUPS] [rowwise|colwise|colwise_rowmajor]
#
# x (16640, 8192) bf16 with N_GROUPS (default 1) jagged groups, as in the benchmark: rowwise
# (row-block kernel, groups along the 8192 columns), colwise (colwise kernels, the grad_w layout:
# column-major data), colwise_rowmajor (colwise kernels, row-major data).
# Writes OUTDIR/ncu_<layout>_<groups>.txt (the details page); prints its headline lines.
set -uo pipefail
out=${1:?usage: scripts/profile_per_group.sh OUTDIR [N_GROUPS] [rowwise|colwise|colwise_rowmajor]}
groups=${2:-1}
layout=${3:-rowwise}
here=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
if [[ -z "$ncu_bin" ]]; then
  echo "no ncu on this machine" >&2
  exit 1
fi
prog=$(cat <<PY
import sys, torch
sys.path.insert(0, "$here/benchmarks")
from bench_per_group_scales import M, K, jagged_offsets
from mxfp8_a2a import per_group_colwise_scales, per_group_rowwise_scales
g = torch.Generator().manual_seed(0)
x = torch.randn(M, K, dtype=torch.bfloat16).cuda()
if "$layout" == "rowwise":
    offs = jagged_offsets(K, $groups, g)
    fn = lambda: per_group_rowwise_scales(x, offs, validate=False)
else:
    offs = jagged_offsets(M, $groups, g)
    layout = "row_major" if "$layout" == "colwise_rowmajor" else "column_major"
    fn = lambda: per_group_colwise_scales(x, offs, data_layout=layout, validate=False)
for _ in range(3):
    fn()
torch.cuda.synchronize()
PY
)
report="$out/ncu_${layout}_${groups}"
# Profile the third call: the first compiles the kernels, the second warms the caches (the
# colwise layouts launch two kernels per call, an amax and a cast: both of the third call).
n=1; skip=2
[[ $layout == colwise* ]] && n=2 && skip=4
"$ncu_bin" --kernel-name regex:"_row_block_kernel|_amax_kernel|_cast_kernel" --launch-skip $skip --launch-count $n \
  --set full --clock-control none -f -o "$report" python3 -c "$prog" > "$report.log" 2>&1 || tail -20 "$report.log"
"$ncu_bin" --import "$report.ncu-rep" --page details > "$report.txt" 2>&1
grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Executed Ipc Active|Executed Instructions |L1/TEX Hit|L2 Hit|Warp Cycles Per Issued|Block Limit Registers" "$report.txt" | head -24
