"""Launch configurations of the cast kernels, in one place.

Each kernel program handles ``BLOCK_G`` blocks of 32 elements. Values picked by
``scripts/tune_cast.py`` on an NVIDIA H200 (torch 2.11, triton 3.6), shapes 131072x5120,
8192x5120 and 2048x7168 (2026-11-30, raw output not kept): at 131072x5120 the packed
quantize / dequantize ran at 4290 / 4077 GB/s with BLOCK_G 256, against 4247 / 4101 with
128, 3947 / 3995 with 64 and 2911 / 3946 with 32. The interpreter (CPU) uses small
blocks so that tests stay quick.
"""

from typing import NamedTuple

QUANTIZE_BLOCK_G = 256
QUANTIZE_NUM_WARPS = 4
DEQUANTIZE_BLOCK_G = 256
DEQUANTIZE_NUM_WARPS = 4
# The round trip reads and writes like the two casts; their values, not tuned on their own.
ROUNDTRIP_BLOCK_G = 256
ROUNDTRIP_NUM_WARPS = 4

INTERPRET_BLOCK_G = 16

# The NCCL transport (mxfp8_a2a/exchange/nccl.py). Rows a rank sends itself skip the wire
# (one round-trip kernel, overlapped with the collective) from this many elements up; below
# it the extra launch (~15-20 us of host time) costs more than the GPU time it saves.
KEEP_LOCAL_MIN_ELEMENTS = 4 << 20
# That round trip runs beside the collective and must leave whole SMs free for NCCL: a NCCL
# block takes (nearly) a whole SM's registers, so it cannot start on an SM where any cast
# program is resident. Measured on 2x H200, 131072x5120 (torch.profiler timeline, 2026-11-30):
# with a full grid the NCCL kernel started only as the round trip's programs retired. So
# the round trip runs one program per SM on all but BESIDE_COMM_FREE_SMS of them, each large
# enough to keep its SM's memory pipe busy: on an H200 (100 programs) 1024 blocks and 32
# warps moved 2.8-3.0 TB/s, 256 blocks and 8 warps 1.4-2.1 TB/s; 48 free SMs measured best of
# 32/48/64 in the exchange (sweeps of 2026-11-30, in git history before the redesign).
BESIDE_COMM_FREE_SMS = 48
BESIDE_COMM_BLOCK_G = 1024
BESIDE_COMM_NUM_WARPS = 32
# Automatic row ranges of the copy-engine transport (CopyEngineTransport(row_ranges=None)):
# about COPY_ENGINE_RANGE_BYTES of wire bytes per range for the busiest (sender, receiver)
# pair, at most COPY_ENGINE_MAX_RANGES. bench_a2a.py on 2x H200 (NVLink, 5120 columns,
# BENCHMARKS.md): 65536 tokens per rank (173 MB to the peer) and fewer ran best in one range,
# 131072 tokens (346 MB) in two; three and four ranges were slower there.
COPY_ENGINE_RANGE_BYTES = 128 << 20
COPY_ENGINE_MAX_RANGES = 2

# Per-group FP8 scaling (mxfp8_a2a/grouped/), see the kernels' comments there.
# Row-block kernel (kernels.py; groups along the contiguous axis of x and of the data, e.g.
# rowwise scales of a row-major x): one program per work item (a block of rows, one group);
# the launcher picks the block (a power of two) so that an item holds about ``item`` elements
# for a group of average width. Tiles span the whole group along the columns (a power of two
# from ``min_group`` to ``max_class``) times ``tile`` / that rows; wider groups loop (two
# passes) over tiles of ``tile`` elements.
# Values: best of scripts/tune_per_group.py on an H200 (torch 2.11, triton 3.6), x (16640,
# 8192) bf16 with 1/16/64 groups (BENCHMARKS.md: the per-group kernels). The best worst
# case of three interleaved rounds (110.9 / 138.7 / 142.5 us); a widest class of 256
# measured 134 us at 16 groups but 150 at 64.
# Registers: capped at 64 per thread (72-80 by the compiler's choice): 8 programs of 4 warps
# per SM instead of 6-7, no spills; three interleaved rounds over three offset draws (H200,
# 2026-11-30): 101.5-102.1 / 111.2-113.1 / 122.7-131.3 us at 1 / 16 / 64 groups, against
# 111.0-114.4 / 134.1-138.2 / 135.5-142.5 uncapped; 56 measured within 4% of 64, 48 and 40
# slower at 64 groups (150-201 us).
#
# Colwise kernels (kernels_colwise.py; every other layout, e.g. colwise scales of a row-major
# x with row- or column-major data, the grad_w operands of a grouped GEMM, the forward's
# weights): an amax launch over tiles of ``block_other`` x ``amax_rows`` and a cast launch over
# tiles of ``block_other`` x ``cast_rows`` of the destination, both ``sub`` rows at a time.
# Values: the best of 8 tried by scripts/tune_per_group.py --kind colwise on an H200
# (2026-12-01, torch 2.11, triton 3.6), (16640, 8192) bf16 at 1/16/64 groups: 239/246/273 us
# with column-major data, 226/229/247 us row-major, against 256/277/312 and 239/257/281 us for
# the former (128, 128, 64, 32, 4). Longer amax tiles (256 -> 512 rows) help most; sub 16 or
# 64, 8 warps and 64- or 256-wide strips were slower (benchmarks/results/2026-12-01/
# tune_colwise.txt). Those tiles starve small launches: the 8192x2048x8x16x768 experts'
# weights [16, 2048, 768] per column took 243 us with them (384 programs) against 107 us with
# 128-row tiles (1536 programs), hence ``min_programs``. Then software pipelining: Triton
# pipelines only loads that feed a dot unless the loop asks (tl.range num_stages), so both
# launches had one load in flight per program. 3 stages in both, the best of 7 (3 interleaved
# rounds, the fastest of each; tune_colwise_stages_rounds.txt, whose 3/3 rows ran with 1024
# amax rows: at this shape min_programs halves them to 512, the same launch as this tiling):
# 191/203/230 us column-major and 181/185/203 us row-major (1.8-2.3 TB/s effective), against
# 239/243/270 and 225/230/247 for none in the same run; 2/0, 4/0, 3/2 and 2/2 stages in
# between; a 64- or 80-register cap slower in one noisy round (tune_colwise_stages.txt). At
# the MoE benchmark's shapes this tiling against none (compare_colwise_stages.txt, 5 rounds):
# 17-21% faster, except [16, 2048, 768] weights (equal). (Single timings of one call on this
# machine vary by up to 1.8x between repeats, hence rounds: timing_spread.txt,
# alloc_probe.txt.)
# Replaced: the chunk kernel (one launch, each tile read twice by programs a lag of tickets
# apart, the second read meant to hit L2): 223-300 us in the same layouts at its best tiling
# of nine, 1.4-1.8 TB/s, and unable to write the padded and per-expert layouts the grouped
# GEMMs need.


# Per-row scales (grouped/row_scales.py: one scale per row, the rowwise operands of the FP8
# grouped GEMMs): whole rows in registers, ROW_SCALES_TILE elements per program (rows of the
# power of two >= the width), rows wider than ROW_SCALES_MAX_WIDTH through the row-block
# kernel. H200, min over 3 interleaved rounds (benchmarks/bench_row_scales.py,
# results/2026-12-02/row_scales.txt), row-block kernel -> tile 8192 at 4 warps: [65536, 768]
# 113 -> 42 us, [32768, 2048] 64 -> 53 us, [65536, 2048] 100 -> 99 us, [32768, 7168] 170 ->
# 166 us; 8 warps the same within 1 us, tile 16384 at 8 warps 2-105% slower.
ROW_SCALES_TILE = 8192
ROW_SCALES_NUM_WARPS = 4
ROW_SCALES_MAX_WIDTH = 8192

# Combine's weighted slot sum (moe/slot_sum.py): BLOCK_T tokens per program, the hidden axis
# in BLOCK_H tiles (forward: one tile per program; backward: a loop over them). H200,
# 2026-12-02, fwd+bwd over random permutations (results/2026-12-02/dispatch_combine_rows_first.txt)
# at 8192x8x2048 / 4096x8x7168: (4, 1024, 4 warps) 0.844 / 0.767 ms; of 7 others, (2, 2048,
# 8) 0.641 / 0.905, (2, 1024, 4) 1.015 / 0.613, (16, 256, 4) 0.675 / 0.877: none better at both.
SLOT_SUM_BLOCK_T = 4
SLOT_SUM_BLOCK_H = 1024
SLOT_SUM_NUM_WARPS = 4
INTERPRET_SLOT_SUM_BLOCK_T = 2
# The static dispatch/combine's row kernels (moe/static_kernels.py, the backward too, which
# was not in the sweep): programs of about STATIC_ROWS_TILE elements, rows of at most
# STATIC_ROWS_BLOCK_H columns. H200 sweep, 2026-12-04, bf16 rows, T x k x H of 16384x8x7168,
# 8192x8x2048, 32768x4x5120, 65536x2x768, both wires, 16 (tile, BLOCK_H, warps) choices:
STATIC_ROWS_TILE = 2048  # slot_sum_decode 2.5-3.1 TB/s (mxfp8), 1.3-2.3 at 8192; others +-10%
STATIC_ROWS_BLOCK_H = 2048  # 1024 at this tile: up to 12% slower (H = 2048, mxfp8)
STATIC_ROWS_NUM_WARPS = 4  # as fast as 2 warps at tile 1024; 8 at tile 4096 no faster
INTERPRET_STATIC_ROWS_TILE = 4096  # one program for most test calls: the interpreter's cost
# is per program (test_static_rows.py shrinks it, to run several along the rows)
INTERPRET_STATIC_ROWS_BLOCK_H = 64  # small: tests of 96 and 160 columns run several tiles
# The static dispatch's plan kernels (moe/static_plan.py), not swept (each launch is a few us):
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


ROWWISE_TILING = RowBlockTiling(
    tile=4096, item=8192, min_group=32, max_class=512, num_warps=4, maxnreg=64
)  # fmt: skip
COLWISE_TILING = ColwiseTiling(
    block_other=128, amax_rows=512, cast_rows=128, sub=32, num_warps=4, min_programs=2048,
    amax_stages=3, cast_stages=3,
)  # fmt: skip
# The interpreter (CPU tests): few classes, so that tests of a few hundred rows run every
# class and the loop; small colwise tiles, so that they run several strips and chunks.
INTERPRET_ROWWISE_TILING = RowBlockTiling(1024, 1024, 16, 128, 4)
INTERPRET_COLWISE_TILING = ColwiseTiling(16, 32, 16, 8, 4)


def per_group_tiling(group_dim: int, interpreted: bool) -> RowBlockTiling | ColwiseTiling:
    """Tiling of the kernel for groups along dim ``group_dim`` (1: the row-block kernel,
    0: the colwise kernels)."""
    if interpreted:
        return INTERPRET_ROWWISE_TILING if group_dim == 1 else INTERPRET_COLWISE_TILING
    return ROWWISE_TILING if group_dim == 1 else COLWISE_TILING


# Both FP8 copies of expert weights in two reads (grouped/weight_scales.py): the row kernel
# holds whole rows like row_scales (ROW_SCALES_TILE elements per step) and takes
# WEIGHT_SCALES_ROWS rows of one expert per program, halved while the launch has fewer than
# WEIGHT_SCALES_MIN_PROGRAMS programs (one atomic max per column per program), with
# WEIGHT_SCALES_STAGES loads in flight. H200, fastest of 3 interleaved rounds
# (benchmarks/bench_weight_scales.py, results/2026-12-02/weight_scales_sweep.txt), the row
# kernel's time at [32, 7168, 2048] / [32, 2048, 7168]: 429 / 460 us without pipelining,
# 442 / 473 at 2 stages, 361 / 375 at 3 (row_scales alone: 321 / 320); 32 rows per program
# 553 / 494; the column amax reduced per row block instead of per tile: the same at these
# shapes, 49 -> 90 us at [16, 2048, 768].
WEIGHT_SCALES_ROWS = 128
WEIGHT_SCALES_MIN_PROGRAMS = 1024
WEIGHT_SCALES_NUM_WARPS = 4
WEIGHT_SCALES_STAGES = 3
# grouped_mm's FP8 forward makes both copies at once (and keeps grad_x's for the backward)
# for weights of this many elements up; smaller ones are cast per use as before. Same runs:
# at [32, 7168, 2048] (470M elements) the one pass takes 697 us of kernels against 882 us
# for the casts apart, and the experts' step replayed from a CUDA graph 283-381 us less
# (experts_step_ab_*.txt); at [16, 2048, 768] (25M) 70 against 64 us, and the eager
# 8192x2048 steps were not faster (2348-2413 us graphed either way).
WEIGHT_SCALES_IN_FORWARD_FROM = 1 << 26
# Dispatch's counts message has this many count columns per rank whatever num_experts is,
# so that ranks that disagree on it get an error, not mismatched collectives; more local
# experts than this take a second counts all-to-all (and host sync) after the check.
DISPATCH_INLINE_COUNTS = 32
