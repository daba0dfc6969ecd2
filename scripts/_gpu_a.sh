set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 330 python3 -m pytest -q -x -rs --timeout 200 tests/test_cast_kernels.py tests/test_a2a.py tests/test_moe.py 2>&1 | tail -25 > $OUT/tests.txt
tail -4 $OUT/tests.txt
timeout 100 torchrun --nproc-per-node=2 scripts/host_cost.py --shape 256x5120 --shape 8192x5120 2>&1 | grep -v '^W1' > $OUT/host_cost.txt
grep -A20 "us per call" $OUT/host_cost.txt | grep -v "^ "
timeout 150 torchrun --nproc-per-node=2 benchmarks/bench_a2a.py --shape 256x5120 --shape 8192x5120 --shape 131072x5120 --chunks 1 --chunks 2 --chunks 4 --iters 15 --json $OUT/sweep.json 2>&1 | grep -v '^W1' > $OUT/sweep.txt
grep -E "shape|x5120" $OUT/sweep.txt | cut -c1-110
