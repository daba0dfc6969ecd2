#!/usr/bin/env bash
# Sweep the exchange's chunk count on a GPU node (NVLink, then NCCL through host memory),
# then configurations of the casts beside the collectives (BESIDE: FREE_SMS,BLOCK_G,NUM_WARPS
# each, default "48,256,8 64,256,8"; see scripts/tune_beside.py).
#   scripts/pipeline_sweep.sh OUTDIR
set -uo pipefail
out=${1:?usage: scripts/pipeline_sweep.sh OUTDIR}
here=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$here" PYTHONUNBUFFERED=1
n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
mkdir -p "$out"
bench() { timeout 200 torchrun --nproc-per-node="$n" "$here/benchmarks/bench_a2a.py" "$@" 2>&1 | grep -v '^W1'; }
shapes="--shape 256x5120 --shape 2048x5120 --shape 8192x5120 --shape 32768x5120 --shape 131072x5120"
bench $shapes --chunks 1 --chunks 2 --chunks 4 --chunks 8 --chunks auto --json "$out/sweep.json" \
  > "$out/sweep.txt"
NCCL_P2P_DISABLE=1 bench --shape 8192x5120 --shape 131072x5120 --chunks 1 --chunks 2 --chunks 4 \
  --chunks 8 --json "$out/p2p.json" > "$out/p2p.txt"
for b in ${BESIDE:-48,256,8 64,256,8}; do
  bench --shape 131072x5120 --chunks 1 --chunks 4 --beside "$b" > "$out/beside_${b//,/_}.txt"
done
tail -80 "$out/sweep.txt"; tail -30 "$out/p2p.txt"; grep -h "131072x5120" "$out"/beside_*.txt
