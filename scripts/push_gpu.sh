#!/usr/bin/env bash
# On one GPU: the push transport's tests (W ranks emulated; one rank through real symmetric
# memory), the static path's kernel tests, then bench_push.py; logs in OUTDIR.
#   scripts/push_gpu.sh OUTDIR [EXTRA_TEST_FILES...]
set -uo pipefail
out=${1:?usage: scripts/push_gpu.sh OUTDIR [tests...]}
shift
here=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$here" PYTHONUNBUFFERED=1
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$out/gpu.txt"
timeout 240 python3 -m pytest -q -rs --timeout 200 -p no:cacheprovider "$here/tests/test_static_push.py" \
  > "$out/push_tests.txt" 2>&1; tail -25 "$out/push_tests.txt"
for t in tests/test_rows.py tests/test_plan.py "$@"; do
  timeout 150 python3 -m pytest -q -rs -x --timeout 140 -p no:cacheprovider "$here/$t" 2>&1 | tail -6 \
    | tee -a "$out/static_tests.txt"
done
timeout 150 python3 "$here/benchmarks/bench_push.py" --json "$out/push.json" 2>&1 | tee "$out/push.txt"
