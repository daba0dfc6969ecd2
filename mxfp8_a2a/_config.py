"""Launch configurations and thresholds of the kernels, in one place: each value with one
line of why. Values marked H200 were the fastest measured on an NVIDIA H200 (torch 2.11,
triton 3.6); how they were measured is in the git history of this file and BENCHMARKS.md.
``INTERPRET_*`` values are for the Triton interpreter (CPU tests): small, so tests are quick.
"""

from typing import NamedTuple

# The casts (formats/): each program handles BLOCK_G blocks of 32 elements.
QUANTIZE_BLOCK_G = 256  # H200: 4.3 TB/s at 131072x5120; 128 within 1%, 32 and 64 slower
QUANTIZE_NUM_WARPS = 4  # with BLOCK_G 256 (scripts/tune_cast.py)
DEQUANTIZE_BLOCK_G = 256  # H200: 4.1 TB/s at 131072x5120; 64 and 128 within 2%
DEQUANTIZE_NUM_WARPS = 4  # with BLOCK_G 256 (scripts/tune_cast.py)
ROUNDTRIP_BLOCK_G = 256  # reads and writes like the two casts: their value, not tuned apart
ROUNDTRIP_NUM_WARPS = 4  # the casts' value
INTERPRET_BLOCK_G = 16  # small blocks: several programs per test tensor

# The NCCL transport (exchange/nccl.py).
# Rows a rank sends itself skip the wire (one round-trip kernel beside the collective):
KEEP_LOCAL_MIN_ELEMENTS = 4 << 20  # below, its launch (15-20 us host) costs more than it saves
BESIDE_COMM_FREE_SMS = 48  # SMs a cast beside a collective leaves to NCCL (H200: best of 32-64)
BESIDE_COMM_BLOCK_G = 1024  # one program per SM, large enough to keep its memory pipe busy
BESIDE_COMM_NUM_WARPS = 32  # H200: 2.8-3.0 TB/s against 1.4-2.1 at 256 blocks and 8 warps
# Automatic row ranges of the copy-engine transport (CopyEngineTransport(row_ranges=None)).
COPY_ENGINE_RANGE_BYTES = 128 << 20  # 2x H200: one range best up to 173 MB, two at 346 MB
COPY_ENGINE_MAX_RANGES = 2  # three and four ranges were slower on 2x H200

# Per-row scales (grouped/row_scales.py): whole rows in registers, TILE elements a program.
ROW_SCALES_TILE = 8192  # H200: 42-166 us against the row-block kernel's 64-170; 16384 slower
ROW_SCALES_NUM_WARPS = 4  # 8 warps the same within 1 us
ROW_SCALES_MAX_WIDTH = 8192  # wider rows go through the row-block kernel

# The static dispatch/combine's row kernels (moe/row_kernels.py): programs of about TILE
# elements, rows of at most BLOCK_H columns.
STATIC_ROWS_TILE = 2048  # slot_sum_decode 2.5-3.1 TB/s (mxfp8), 1.3-2.3 at 8192; others +-10%
STATIC_ROWS_BLOCK_H = 2048  # 1024 at this tile: up to 12% slower (H = 2048, mxfp8)
STATIC_ROWS_NUM_WARPS = 4  # as fast as 2 warps at tile 1024; 8 at tile 4096 no faster
INTERPRET_STATIC_ROWS_TILE = 4096  # one program for most test calls (per-program cost)
INTERPRET_STATIC_ROWS_BLOCK_H = 64  # small: tests of 96 and 160 columns run several tiles
# slot_sum_decode_backward (moe/row_kernels_backward.py): (least H, elements per program, next
# slot's row read a slot ahead), the first that fits; H200 2026-12-04, us per call (H 7168 /
# 2048): tile 2048 with prefetch 354 / 151, without 417 / 170; tile 4096: 332 / 194, 302 / 178
STATIC_BACKWARD_TILES = ((4096, 4096, False), (0, 2048, True))
# The static dispatch's plan kernels (moe/plan.py), not swept (each launch is a few us):
STATIC_PLAN_TILE = 4096  # elements x buckets per program of the send plan: 32 int32 per thread
STATIC_PLAN_BLOCK = 1024  # rows per program of the elementwise plan kernels: 8 per thread
STATIC_PLAN_NUM_WARPS = 4  # the one-program kernels hold [W, L] tables only


class RowBlockTiling(NamedTuple):
    tile: int
    item: int
    min_group: int
    max_class: int
    num_warps: int
    maxnreg: int = 0  # registers per thread at most (ptxas .maxnreg); 0: the compiler's choice

    @property
    def n_classes(self) -> int:
        return (self.max_class // self.min_group).bit_length()


class ColwiseTiling(NamedTuple):
    block_other: int
    amax_rows: int
    cast_rows: int
    sub: int
    num_warps: int
    min_programs: int = 0  # tiles shrink (rows halved, to 4 * sub) until a launch has this many
    amax_stages: int = 0  # loads in flight per program (tl.range num_stages); 0: one at a time
    cast_stages: int = 0


# Per-group FP8 scaling (grouped/kernels.py: groups along the contiguous axis, one program
# per block of rows of one group; kernels_colwise.py: every other layout, an amax launch
# and a cast launch over tiles). H200, x (16640, 8192) bf16 at 1/16/64 groups
# (scripts/tune_per_group.py):
# 102 / 111 / 123 us at 1 / 16 / 64 groups; without the register cap 111 / 134 / 136:
ROWWISE_TILING = RowBlockTiling(
    tile=4096, item=8192, min_group=32, max_class=512, num_warps=4, maxnreg=64
)  # fmt: skip
# 181-230 us (1.8-2.3 TB/s), the best of those tried; min_programs: small launches fill SMs.
# One launch with the cast re-reading x from L2 (tickets over column windows; in this file's
# history) ran 194-245 us: ncu read 503 MB of HBM at 1 group, L2 kept ~15% of the re-read.
# Group strips held on chip (register tiles in size classes: 255 registers, 12.5% occupancy)
# or re-read from L2 by a persistent kernel ran 185-2173 us
# (benchmarks/results/2026-12-04/per_group_strided_sweep.txt):
COLWISE_TILING = ColwiseTiling(
    block_other=128, amax_rows=512, cast_rows=128, sub=32, num_warps=4, min_programs=2048,
    amax_stages=3, cast_stages=3,
)  # fmt: skip
# The interpreter: few classes, so that tests of a few hundred rows run every class and
# the loop; small colwise tiles, so that they run several strips and chunks.
INTERPRET_ROWWISE_TILING = RowBlockTiling(1024, 1024, 16, 128, 4)
INTERPRET_COLWISE_TILING = ColwiseTiling(16, 32, 16, 8, 4)


def per_group_tiling(group_dim: int, interpreted: bool) -> RowBlockTiling | ColwiseTiling:
    """Tiling of the kernel for groups along dim ``group_dim`` (1: the row-block kernel,
    0: the colwise kernels)."""
    if interpreted:
        return INTERPRET_ROWWISE_TILING if group_dim == 1 else INTERPRET_COLWISE_TILING
    return ROWWISE_TILING if group_dim == 1 else COLWISE_TILING


# Both FP8 copies of expert weights in two reads (grouped/weight_scales.py): ROWS rows of
# one expert a program, halved while a launch has fewer than MIN_PROGRAMS programs.
WEIGHT_SCALES_ROWS = 128  # H200: 361 / 375 us at two expert shapes; 32 rows 553 / 494
WEIGHT_SCALES_MIN_PROGRAMS = 1024  # enough programs for every SM (each: one atomic max a column)
WEIGHT_SCALES_NUM_WARPS = 4  # with 128 rows (see above)
WEIGHT_SCALES_STAGES = 3  # H200: 361 / 375 us against 429 / 460 unpipelined and 442 / 473 at 2
# grouped_mm's forward makes both copies at once for weights of this many elements up:
WEIGHT_SCALES_IN_FORWARD_FROM = 1 << 26  # H200: 697 against 882 us at 470M; 70 against 64 at 25M

# Dispatch (moe/dispatch_synced.py, dispatch_static.py).
# Count columns of dispatch's counts message, whatever num_experts is (more local experts:
DISPATCH_INLINE_COUNTS = 32  # a second all-to-all): ranks that disagree get an error, not a hang
