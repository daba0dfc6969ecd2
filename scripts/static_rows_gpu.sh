#!/usr/bin/env bash
# On one GPU: the static dispatch's kernel tests, its kernels one by one, the layer's
# rows-only graph replay with a kernel profile, then the layer's graph and compile tests;
# logs in OUTDIR.   scripts/static_rows_gpu.sh OUTDIR [TILE...]  (STATIC_ROWS_TILE values)
set -uo pipefail
out=${1:?usage: scripts/static_rows_gpu.sh OUTDIR [TILE...]}
shift
tiles=${*:-2048}
here=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$here" PYTHONUNBUFFERED=1
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
timeout 150 python3 -m pytest -q -rs -x --timeout 140 -p no:cacheprovider "$here/tests/test_plan.py" \
  "$here/tests/test_rows.py" 2>&1 | tail -12 | tee "$out/static_tests.txt"
targs=""
for t in $tiles; do targs="$targs --tile $t"; done
timeout 120 python3 "$here/benchmarks/bench_static_kernels.py" $targs --json "$out/static_kernels.json" \
  2>&1 | tee "$out/static_kernels.txt"
timeout 120 torchrun --nproc-per-node=1 "$here/benchmarks/bench_moe_layer.py" --iters 20 --warmup 5 \
  --variant "static mxfp8, rows only (graph)" --profile 30 --json "$out/moe_layer_static_rows.json" 2>&1 \
  | grep -v '^W1' > "$out/moe_layer_static_rows.txt"
tail -4 "$out/moe_layer_static_rows.txt"
timeout "${GRAPH_TESTS_S:-150}" python3 -m pytest -q -rs --timeout 140 -p no:cacheprovider \
  "$here/tests/test_static_gpu.py" 2>&1 | tail -8 | tee -a "$out/static_tests.txt"
