#!/usr/bin/env bash
# Sweep the exchange's chunk count on a GPU node (NVLink, then NCCL through host memory).
#   scripts/pipeline_sweep.sh OUTDIR
set -uo pipefail
out=${1:?usage: scripts/pipeline_sweep.sh OUTDIR}
here=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$here" PYTHONUNBUFFERED=1
n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
mkdir -p "$out"
shapes="--shape 256x5120 --shape 2048x5120 --shape 8192x5120 --shape 32768x5120 --shape 131072x5120"
timeout 300 torchrun --nproc-per-node="$n" "$here/benchmarks/bench_a2a.py" $shapes \
  --chunks auto --chunks 1 --chunks 2 --chunks 4 --chunks 8 --json "$out/sweep.json" 2>&1 \
  | grep -v '^W1' > "$out/sweep.txt"
NCCL_P2P_DISABLE=1 timeout 240 torchrun --nproc-per-node="$n" "$here/benchmarks/bench_a2a.py" \
  --shape 8192x5120 --shape 131072x5120 --chunks auto --chunks 1 --chunks 4 --chunks 8 \
  --json "$out/p2p.json" 2>&1 | grep -v '^W1' > "$out/p2p.txt"
tail -60 "$out/sweep.txt"; tail -30 "$out/p2p.txt"
