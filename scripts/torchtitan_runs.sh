#!/usr/bin/env bash
# On a machine of 2, 4 or 8 GPUs: torchtitan's trainer on its deepseek_v3 debug model at
# expert-parallel degree EP, torchtitan's own dispatcher against mxfp8_a2a.torchtitan's with
# each wire, for the seeds given; a log and a JSON per run in OUTDIR (training loss per step,
# tokens/s), then the table and plot of the runs (scripts/plot_curves.py).
#   TORCHTITAN_DIR=<a torchtitan 0.3.0 checkout> [STEPS=300] [EP=2] \
#     scripts/torchtitan_runs.sh OUTDIR SEED [SEED...]
# The checkout provides what the debug config reads (tests/assets/tokenizer, the c4_test
# data); torchtitan itself comes from the mxfp8_a2a[torchtitan] extra.
set -uo pipefail
out=${1:?usage: TORCHTITAN_DIR=DIR [STEPS=N] [EP=N] scripts/torchtitan_runs.sh OUTDIR SEED...}
shift
here=$(cd "$(dirname "$0")/.." && pwd)
tt=${TORCHTITAN_DIR:?set TORCHTITAN_DIR to a torchtitan 0.3.0 checkout}
ep=${EP:-2}
mkdir -p "$out"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
for seed in "${@:?give at least one seed}"; do
  for wire in torchtitan bf16 mxfp8_to_experts mxfp8; do
    flag=()
    [[ $wire != torchtitan ]] && flag=(--override.imports "mxfp8_a2a.torchtitan.mxfp8_dispatch={\"wire\": \"$wire\"}")
    name="tt_${wire}_ep${ep}_${seed}"
    (cd "$tt" && torchrun --nproc-per-node="$ep" -m torchtitan.train --module deepseek_v3 \
      --config deepseek_v3_debugmodel --parallelism.expert_parallel_degree "$ep" \
      --training.disable_cuda_graphs --training.steps "${STEPS:-300}" --debug.seed "$seed" \
      --checkpoint.no-enable "${flag[@]}") > "$out/$name.txt" 2>&1
    python3 "$here/scripts/torchtitan_log.py" "$out/$name.txt" --wire "$wire" --seed "$seed" \
      --ep "$ep" --json "$out/$name.json"
  done
done
python3 "$here/scripts/plot_curves.py" "$out"/tt_*.json --baseline bf16/torchtitan --out "$out/tt_curves.png" | tee "$out/table.txt"
