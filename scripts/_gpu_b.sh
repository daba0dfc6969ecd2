set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
S="--shape 256x5120 --shape 2048x5120 --shape 8192x5120 --shape 32768x5120 --shape 131072x5120"
timeout 150 torchrun --nproc-per-node=2 benchmarks/bench_a2a.py $S --chunks 1 --chunks 2 --chunks 4 --chunks auto --json $OUT/nvlink.json --plot $OUT/a2a_equal.png 2>&1 | grep -v '^W1' > $OUT/nvlink.txt
grep -E "x5120 " $OUT/nvlink.txt | cut -c1-75
NCCL_P2P_DISABLE=1 timeout 120 torchrun --nproc-per-node=2 benchmarks/bench_a2a.py --shape 2048x5120 --shape 8192x5120 --shape 131072x5120 --chunks 1 --chunks 4 --json $OUT/p2p.json 2>&1 | grep -v '^W1' > $OUT/p2p.txt
grep -E "x5120 " $OUT/p2p.txt | cut -c1-75
timeout 60 torchrun --nproc-per-node=2 benchmarks/bench_a2a.py --splits skewed --shape 8192x5120 --shape 131072x5120 --chunks 1 --chunks 4 --json $OUT/skewed.json 2>&1 | grep -v '^W1' > $OUT/skewed.txt
grep -E "x5120 " $OUT/skewed.txt | cut -c1-75
timeout 230 python3 -m pytest -q -x -rs --timeout 200 tests/test_a2a.py tests/test_moe.py 2>&1 | tail -15 > $OUT/tests.txt
tail -4 $OUT/tests.txt
