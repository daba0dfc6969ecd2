#!/usr/bin/env bash
# On one GPU: the per-leg wire measurement (examples/train_lm.py, --size gpu) for the seeds
# given, the four configurations each, one JSON per run in OUTDIR, then the table and plot of
# every run found there. Plan it against the device's 10-minute command limit: one seed (four
# runs) per call; STEPS=200 first to time a run, then the full 2000.
#   [STEPS=2000] [PARALLEL=1] [RUN_TIMEOUT=seconds] scripts/wire_convergence.sh OUTDIR SEED...
set -uo pipefail
out=${1:?usage: [STEPS=N] scripts/wire_convergence.sh OUTDIR SEED [SEED...]}
shift
here=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$here" PYTHONUNBUFFERED=1
mkdir -p "$out"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
  torch.cuda.get_device_name())' | tee "$out/versions.txt"
run() {  # one configuration: exchange precision seed
  local name="lm_${1}_${2}_${3}"
  timeout "${RUN_TIMEOUT:-3600}" python3 "$here/examples/train_lm.py" --size gpu --compile \
    --seed "$3" --exchange "$1" --precision "$2" --steps "${STEPS:-2000}" --log-every 50 \
    --json "$out/$name.json" 2>&1 | tr '\r' '\n' > "$out/$name.txt"
  tail -2 "$out/$name.txt"
}
for seed in "${@:?give at least one seed}"; do
  for cfg in "bf16 bf16" "mxfp8_to_experts bf16" "mxfp8 bf16" "mxfp8_to_experts fp8_rowwise_gw_hp"; do
    # PARALLEL=1: the seed's four runs at once (one GPU, time-sliced; fills the gaps small
    # kernels leave and compiles on four cores at a time)
    if [[ -n "${PARALLEL:-}" ]]; then run $cfg "$seed" & else run $cfg "$seed"; fi
  done
  wait
done
python3 "$here/scripts/plot_curves.py" "$out"/lm_*.json --out "$out/lm_curves.png" \
  | tee "$out/table.txt"
