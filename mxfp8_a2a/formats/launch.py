"""Launching the Triton kernels: Triton's public ``kernel[grid](...)``.

A cached launch through Triton's CompiledKernel internals (triton 3.6 only) once saved host
time per launch; on one H200 it saved under 10% of an eager MoE layer step with bf16 experts
(BENCHMARKS.md), so every launch is the public one. CUDA graphs and torch.compile remove
host time.
"""

from __future__ import annotations

from .._common import cdiv


def launch(
    kernel, grid: int | tuple[int, ...], args: tuple, consts: dict, num_warps: int, **options
) -> None:
    """``kernel[grid](*args, **consts, num_warps=num_warps, **options)``.

    grid: programs along x, or a tuple of up to three sizes; args: the runtime arguments in
    the kernel's order; consts: its constexpr parameters by name; options: further compile
    options (e.g. ``maxnreg``).
    """
    grid = (grid,) if isinstance(grid, int) else tuple(grid)
    kernel[grid](*args, **consts, num_warps=num_warps, **options)


def launch_tiles(
    kernel, n_groups: int, args: tuple, consts: dict, num_warps: int, max_programs: int | None
) -> None:
    """:func:`launch` a cast kernel over cdiv(n_groups, consts["BLOCK_G"]) tiles of blocks of
    32, on at most ``max_programs`` programs (None: one per tile); programs loop over tiles."""
    n_tiles = cdiv(n_groups, consts["BLOCK_G"])
    launch(kernel, min(n_tiles, max_programs or n_tiles), args, consts, num_warps)
