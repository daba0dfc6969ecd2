#!/usr/bin/env bash
# Run the full benchmark suite on a GPU node; all JSON, logs and plots go into one folder.
#
#   scripts/run_benchmarks.sh OUTDIR [NPROC]
#
# NPROC defaults to the number of GPUs. Runs: the cast and per-group benchmarks (one GPU), the exchange
# benchmark over NVLink/PCIe as NCCL chooses, and again with NCCL_P2P_DISABLE=1 (NCCL through
# host memory: a stand-in for an inter-node link), equal and skewed splits.
set -euo pipefail
out=${1:?usage: scripts/run_benchmarks.sh OUTDIR [NPROC]}
nproc=${2:-$(python3 -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
run() { echo "+ $*" >&2; "$@"; }
run python3 "$here/benchmarks/bench_cast.py" --json "$out/cast.json" 2>&1 | tee "$out/cast.txt"
run python3 "$here/benchmarks/bench_per_group_scales.py" --json "$out/per_group.json" 2>&1 | tee "$out/per_group.txt"
for splits in equal skewed; do
  graphs=(); [[ $splits == equal ]] && graphs=(--graphs)
  run torchrun --nproc-per-node="$nproc" "$here/benchmarks/bench_a2a.py" --splits "$splits" "${graphs[@]}" \
    --json "$out/a2a_${splits}.json" --plot "$out/a2a_${splits}.png" 2>&1 | tee "$out/a2a_${splits}.txt"
done
NCCL_P2P_DISABLE=1 run torchrun --nproc-per-node="$nproc" "$here/benchmarks/bench_a2a.py" \
  --json "$out/a2a_p2p_disabled.json" --plot "$out/a2a_p2p_disabled.png" 2>&1 | tee "$out/a2a_p2p_disabled.txt"
