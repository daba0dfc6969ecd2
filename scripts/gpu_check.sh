#!/usr/bin/env bash
# On a GPU machine: GPU tests, tuning sweeps and benchmarks, logs in OUTDIR.
#   [TESTS='tests/test_a2a.py ...' | PART=1|2] [TEST_FILE_TIMEOUT=300] scripts/gpu_check.sh OUTDIR [tests|tune|bench|cast|pergroup|grouped|static|ab|host|nodes|all]...
# bench: the whole suite (scripts/run_benchmarks.sh, into OUTDIR/bench); cast, pergroup: the one-GPU parts
# (pergroup adds the timing-spread probe and the per-group tiling sweep); grouped: grouped_mm's
# GPU tests, the MoE layer benchmark (one rank), the FP8 experts piece by piece, their colwise
# pieces per tiling in rounds and the kernels' own time (gpu_time.py); host: host time per
# exchange call; static: the static dispatch's GPU tests and the MoE layer benchmark (one
# rank, sync and static paths, eager and graph replay).
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUTDIR [stage...]}
shift
stages=${*:-all}
here=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1  # (carried packages after the repo)
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "nccl", torch.cuda.nccl.version())' | tee -a "$out/gpu.txt"
has() { [[ " $stages " == *" $1 "* || " $stages " == *" all "* ]]; }
if has tests; then
  # TESTS picks files (relative to the repo), e.g. to split a run over two calls: on one
  # GPU the whole folder takes far longer than one call (its two-process tests take seconds
  # each; the per-group file compiles for minutes on a fresh machine). One pytest per file,
  # each with its own timeout, so that one slow file leaves the others' results.
  # PART=1 or PART=2 (when TESTS is unset): the suite in two device calls, each within one
  # call's 10 minutes: the kernel files (Triton compiles for the GPU), then the layer and
  # distributed ones (on 2 CPU cores, 2026-12-05: 315 s and 243 s of the suite).
  part1="cast_kernels per_group_scales per_group_tiling row_scales weight_scales grouped_mm
    grouped_mm_gpu grouped_mm_trailing torch_gemms moe_experts rows plan
    static_gpu reference launch compile_targets"
  if [[ -z "${TESTS:-}" && -n "${PART:-}" ]]; then
    TESTS=""
    for f in $(cd "$here" && echo tests/test_*.py); do
      n=${f#tests/test_}; n=${n%.py}
      if [[ " $(echo $part1) " == *" $n "* ]]; then [[ $PART == 1 ]] && TESTS+=" $f"
      else [[ $PART == 2 ]] && TESTS+=" $f"; fi
    done
  fi
  : > "$out/tests.txt"
  # each file's whole log in OUTDIR/<file>.log; tests.txt: its failures and summary line
  for t in ${TESTS:-$(cd "$here" && echo tests/test_*.py)}; do
    echo "== $t" >> "$out/tests.txt"
    log="$out/$(basename "$t" .py).log"
    timeout "${TEST_FILE_TIMEOUT:-300}" python3 -m pytest -q -rs --timeout 240 -p no:cacheprovider \
      "$here/$t" > "$log" 2>&1
    grep -E "^(FAILED|ERROR) " "$log" >> "$out/tests.txt"
    tail -1 "$log" >> "$out/tests.txt"
  done
  cat "$out/tests.txt"
fi
if has tune; then
  timeout 200 python3 "$here/scripts/tune_cast.py" --json "$out/tune.json" 2>&1 | tee "$out/tune.txt" | tail -50
fi
if has cast; then
  timeout 120 python3 "$here/benchmarks/bench_cast.py" --json "$out/cast.json" 2>&1 | tee "$out/cast.txt"
  timeout 120 python3 "$here/benchmarks/bench_push.py" --json "$out/push.json" 2>&1 | tee "$out/push.txt"
  timeout 240 python3 "$here/benchmarks/bench_row_scales.py" --tile 8192 --warps 4 --tile 8192 \
    --warps 8 --tile 16384 --warps 8 --json "$out/row_scales.json" 2>&1 | tee "$out/row_scales.txt"
fi
if has pergroup; then
  timeout 80 python3 "$here/scripts/timing_spread.py" --rounds 8 --json "$out/timing_spread.json" > "$out/timing_spread.txt" 2>&1
  tail -3 "$out/timing_spread.txt"
  timeout 150 python3 "$here/benchmarks/bench_per_group_scales.py" --json "$out/per_group.json" 2>&1 | tee "$out/per_group.txt"
  timeout 300 python3 "$here/scripts/tune_per_group.py" --json "$out/tune_per_group.json" > "$out/tune_per_group.txt" 2>&1
  tail -5 "$out/tune_per_group.txt"
fi
if has grouped; then
  timeout 200 python3 -m pytest -q -rs "$here/tests/test_grouped_mm_gpu.py" 2>&1 | tail -15 | tee "$out/grouped_tests.txt"
  timeout 200 torchrun --nproc-per-node=1 "$here/benchmarks/bench_moe_layer.py" --iters 10 --warmup 3 \
    --json "$out/moe_layer.json" 2>&1 | grep -v '^W1' | tee "$out/moe_layer.txt"
  timeout 90 python3 "$here/scripts/profile_grouped_mm.py" --json "$out/grouped_mm_pieces.json" \
    > "$out/grouped_mm_pieces.txt" 2>&1
  grep -E "experts|per column|padded" "$out/grouped_mm_pieces.txt"
  timeout 120 python3 "$here/scripts/compare_colwise_tilings.py" --json "$out/compare_colwise.json" > "$out/compare_colwise.txt" 2>&1
  tail -14 "$out/compare_colwise.txt"
  timeout 150 python3 "$here/scripts/gpu_time.py" --json "$out/gpu_time.json" > "$out/gpu_time.txt" 2>&1
  tail -14 "$out/gpu_time.txt"
fi
if has static; then
  timeout 300 python3 -m pytest -q -rs --timeout 280 -p no:cacheprovider "$here/tests/test_static_gpu.py" \
    "$here/tests/test_rows.py" "$here/tests/test_grouped_mm_trailing.py" 2>&1 | tail -8 | tee "$out/static_tests.txt"
  timeout 280 torchrun --nproc-per-node=1 "$here/benchmarks/bench_moe_layer.py" --iters 10 --warmup 3 \
    --json "$out/moe_layer_static.json" 2>&1 | grep -v '^W1' | tee "$out/moe_layer_static.txt"
fi
if [[ " $stages " == *" ab "* ]]; then  # (not in "all": it needs BEFORE)
  # eager layer timings of another checkout (BEFORE=DIR, e.g. build/before from
  # `git archive <commit> | tar -x -C build/before`, carried to the device) and of this one,
  # alternated AB_REPEATS (3) times in one call: both paths' eager speed, before and after
  before=${BEFORE:?ab needs BEFORE=DIR, another checkout of the repository}
  vs=(--variant sync-bf16 --variant sync-mxfp8 --variant static-bf16 --variant static-mxfp8)
  for i in $(seq "${AB_REPEATS:-3}"); do
    for tree in "$before" "$here"; do
      name=$([[ $tree == "$here" ]] && echo after || echo before)
      PYTHONPATH="$tree" timeout 150 torchrun --nproc-per-node=1 "$tree/benchmarks/bench_moe_layer.py" \
        --iters 10 --warmup 3 "${vs[@]}" --json "$out/ab_${name}_$i.json" 2>&1 | grep -v '^W1' \
        | tee "$out/ab_${name}_$i.txt"
    done
  done
fi
if has host; then
  # host time per exchange call (one rank per GPU)
  n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  timeout 150 torchrun --nproc-per-node="$n" "$here/benchmarks/bench_host_time.py" --shape 256x5120 \
    --shape 8192x5120 --json "$out/host_time.json" 2>&1 | grep -v '^W1' | tee "$out/host_time.txt"
fi
if [[ " $stages " == *" nodes "* ]]; then  # (not in "all": it needs 4+ GPUs)
  # node-aware dispatch on NCCL, the host's GPUs as 2 emulated nodes: bytes against the model,
  # flat vs node-aware time at DeepSeek-V3's layer shape (both hops on NVLink here)
  n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  timeout 300 torchrun --nproc-per-node="$n" "$here/benchmarks/bench_nodes.py" --check $((n / 2)) \
    --time --json "$out/nodes.json" 2>&1 | grep -v '^W1' | tee "$out/nodes.txt"
fi
if has bench; then
  # its own folder: the suite writes the one-GPU stages' file names too
  timeout 590 "$here/scripts/run_benchmarks.sh" "$out/bench" 2>&1 | grep -v '^W1' | tail -80
fi
