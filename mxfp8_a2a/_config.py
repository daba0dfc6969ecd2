"""Launch configurations of the cast kernels, in one place.

Each kernel program handles ``BLOCK_G`` blocks of 32 elements. Values picked by
``scripts/tune_cast.py`` on an NVIDIA H200 (torch 2.11, triton 3.6), shapes 131072x5120,
8192x5120 and 2048x7168; see BENCHMARKS.md. The interpreter (CPU) uses small blocks so
that tests stay quick.
"""

QUANTIZE_BLOCK_G = 256
QUANTIZE_NUM_WARPS = 4
DEQUANTIZE_BLOCK_G = 256
DEQUANTIZE_NUM_WARPS = 4

INTERPRET_BLOCK_G = 16

# Pipelined exchange (mxfp8_a2a/_pipeline.py). Rows a (sender, receiver) pair exchanges are
# split into chunks of about PIPELINE_CHUNK_BYTES wire bytes, at most PIPELINE_MAX_CHUNKS;
# while chunks are in flight the cast kernels keep PIPELINE_RESERVED_SMS multiprocessors
# free for the communication kernels. First values, to be set from bench_a2a sweeps.
PIPELINE_CHUNK_BYTES = 64 << 20
PIPELINE_MAX_CHUNKS = 8
PIPELINE_RESERVED_SMS = 16
PIPELINE_PROGRAMS_PER_SM = 8

# Per-group FP8 scaling (mxfp8_a2a/per_group_scales.py). First values, measured once on
# H200 (BENCHMARKS.md, about 1.1 TB/s effective at (16640, 8192)); scripts/tune_per_group.py
# sweeps them. The interpreter uses small tiles.
ROWWISE_BLOCK_N = 8
ROWWISE_BLOCK_C = 512
ROWWISE_NUM_WARPS = 4
COLWISE_BLOCK_M = 64
COLWISE_BLOCK_K = 128
INTERPRET_ROWWISE = (8, 32)
INTERPRET_COLWISE = (16, 32)
