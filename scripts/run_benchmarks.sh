#!/usr/bin/env bash
# Run the benchmark suite on a GPU node; all JSON and logs (and plots, where matplotlib is
# installed) go into one folder.
#
#   scripts/run_benchmarks.sh OUTDIR [NPROC]
#
# NPROC defaults to the number of GPUs. Runs: the one-GPU benchmarks (casts, push, per-row
# and per-group scales, host time per call, the MoE layer and its row movement at one
# rank); with NPROC >= 2 the exchange benchmark over NVLink/PCIe as NCCL chooses (equal
# splits with CUDA graphs, skewed and hot splits; with NPROC = 2 also the copy-engine
# transport), and again with NCCL_P2P_DISABLE=1 (NCCL through host memory: a stand-in for
# an inter-node link).
set -euo pipefail
out=${1:?usage: scripts/run_benchmarks.sh OUTDIR [NPROC]}
nproc=${2:-$(python3 -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
run() { echo "+ $*" >&2; "$@"; }
plot() {  # --plot FILE where matplotlib is installed (bench_a2a refuses --plot without it)
  if python3 -c 'import matplotlib' 2>/dev/null; then echo --plot "$1"; fi
}
b="$here/benchmarks"
run python3 "$b/bench_cast.py" --json "$out/cast.json" 2>&1 | tee "$out/cast.txt"
run python3 "$b/bench_push.py" --json "$out/push.json" 2>&1 | tee "$out/push.txt"
run python3 "$b/bench_row_scales.py" --json "$out/row_scales.json" 2>&1 | tee "$out/row_scales.txt"
run python3 "$b/bench_per_group_scales.py" --json "$out/per_group.json" 2>&1 | tee "$out/per_group.txt"
run torchrun --nproc-per-node=1 "$b/bench_host_time.py" --shape 256x5120 --shape 8192x5120 \
  --json "$out/host_time.json" 2>&1 | tee "$out/host_time.txt"
run torchrun --nproc-per-node=1 "$b/bench_moe_layer.py" --iters 10 --warmup 3 \
  --json "$out/moe_layer.json" 2>&1 | tee "$out/moe_layer.txt"
if (( nproc < 2 )); then
  echo "one GPU: the exchange benchmarks need two or more" >&2
  exit 0
fi
transports=(--transport nccl)
(( nproc == 2 )) && transports+=(--transport copy_engine)
for splits in equal skewed hot; do
  extra=(); [[ $splits == equal ]] && extra=(--graphs)
  run torchrun --nproc-per-node="$nproc" "$b/bench_a2a.py" --splits "$splits" "${extra[@]}" \
    "${transports[@]}" --json "$out/a2a_${splits}.json" $(plot "$out/a2a_${splits}.png") \
    2>&1 | tee "$out/a2a_${splits}.txt"
done
NCCL_P2P_DISABLE=1 run torchrun --nproc-per-node="$nproc" "$b/bench_a2a.py" --graphs \
  --json "$out/a2a_p2p_disabled.json" $(plot "$out/a2a_p2p_disabled.png") 2>&1 \
  | tee "$out/a2a_p2p_disabled.txt"
