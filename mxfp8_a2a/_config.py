"""Launch configurations of the cast kernels, in one place.

Each kernel program handles ``BLOCK_G`` blocks of 32 elements. Values picked by
``scripts/tune_cast.py`` on an NVIDIA H200 (torch 2.11, triton 3.6), shapes 131072x5120,
8192x5120 and 2048x7168; see BENCHMARKS.md. The interpreter (CPU) uses small blocks so
that tests stay quick.
"""

QUANTIZE_BLOCK_G = 64
QUANTIZE_NUM_WARPS = 4
DEQUANTIZE_BLOCK_G = 64
DEQUANTIZE_NUM_WARPS = 4

INTERPRET_BLOCK_G = 16
