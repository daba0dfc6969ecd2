#!/usr/bin/env bash
# One GPU: torchtitan's block with each dispatcher, dispatch + combine against the byte bound
# (and one profiled step per variant under ncu), two processes on one GPU. Logs in OUTDIR.
#   PYTHONPATH=<carried torchtitan> scripts/gpu_issue63.sh OUTDIR
set -uo pipefail
out=${1:?usage: scripts/gpu_issue63.sh OUTDIR}
here=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$out/gpu.txt"
b="$here/benchmarks"
timeout 200 torchrun --nproc-per-node=1 "$b/bench_dispatch_bound.py" --json "$out/dispatch_bound.json" \
  2>&1 | grep -v '^W1' | tee "$out/dispatch_bound.txt"
timeout 240 torchrun --nproc-per-node=1 "$b/bench_torchtitan.py" --json "$out/torchtitan.json" \
  2>&1 | grep -v '^W1' | tee "$out/torchtitan.txt"
timeout 60 python3 "$here/scripts/gloo_cuda_probe.py" 2>&1 | tail -4 | tee "$out/probe.txt"
timeout 150 ncu --clock-control none --profile-from-start off --csv --metrics \
  gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
  torchrun --nproc-per-node=1 "$b/bench_dispatch_bound.py" --ncu-step > "$out/ncu.csv" 2> "$out/ncu.err"
tail -3 "$out/ncu.err"; wc -l "$out/ncu.csv"
# torchtitan's checks on CUDA tensors at one rank (NCCL)
timeout 200 python3 -m pytest -q -rs --timeout 190 -p no:cacheprovider "$here/tests/test_torchtitan_gpu.py" \
  > "$out/test_torchtitan_gpu.log" 2>&1
tail -5 "$out/test_torchtitan_gpu.log"
