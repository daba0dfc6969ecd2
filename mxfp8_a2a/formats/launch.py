"""Launching the cast kernels with little host work.

``kernel[grid](...)`` (Triton's public launch) binds and specializes every argument in
Python on each call: 30-35 us of host time per launch on the H200 machines' CPUs (triton 3.6;
35 us for an empty kernel of 18 arguments, 2026-12-02), where the compiled kernel's own
launcher took about 13 us when this path was written (by 2026-12-01). An exchange launches
two or three kernels, and small exchanges are bound by host time. So, on the Triton versions
in ``FAST_TRITON`` (the ones this path has run on, on a GPU), :func:`launch` keeps the
``CompiledKernel`` that the first ``kernel[grid](...)`` returned (alive in the cache) and calls
its C launcher directly, with tensors passed as their addresses: ``CompiledKernel.run``'s
positional convention is Triton's internal one, hence the version gate. With Triton's launch
hooks set (a profiler) it goes through ``compiled[grid](...)``, which builds the hooks'
metadata. Everywhere else, under the interpreter, and with ``MXFP8_A2A_PUBLIC_LAUNCH=1`` in the
environment, every launch is the public ``kernel[grid](...)``.

The cache key holds what Triton specializes a kernel on: for each tensor its dtype and
whether its address is 16-byte aligned, for each int whether it equals 1, is a multiple of
16 and fits 32 bits, plus the constexpr values and num_warps. It assumes Triton's compile
settings (environment, knobs) do not change after the first launch in the process. At most
``CACHE_SIZE`` kernels are kept (all dropped when full); :func:`clear_cache` drops them.
"""

from __future__ import annotations

import os

import torch
import triton
from triton import knobs

from .._common import cdiv, interpreted

FAST_TRITON = ("3.6.",)  # triton versions whose CompiledKernel launch ran on a GPU here
CACHE_SIZE = 256
PUBLIC_LAUNCH_ENV = "MXFP8_A2A_PUBLIC_LAUNCH"

_COMPILED: dict[tuple, object] = {}
# the current stream's handle without building a torch.cuda.Stream (~3 us less per launch);
# torch's public current_stream() where the private accessor is missing
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def fast_launch_enabled() -> bool:
    """Whether launches reuse the CompiledKernel (see the module docstring)."""
    return triton.__version__.startswith(FAST_TRITON) and os.environ.get(PUBLIC_LAUNCH_ENV) != "1"


def clear_cache() -> None:
    """Drop every kept CompiledKernel (Triton's own cache keeps the binaries)."""
    _COMPILED.clear()


def _arg_key(a: object) -> object:
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, int) and not isinstance(a, bool):
        return a == 1, a % 16 == 0, -(2**31) <= a < 2**31
    return a


def launch(
    kernel, grid: int | tuple[int, ...], args: tuple, consts: dict, num_warps: int, **options
) -> None:
    """``kernel[grid](*args, **consts, num_warps=num_warps, **options)``, through the cache.

    grid: programs along x, or a tuple of up to three sizes; args: the runtime arguments in
    the kernel's order; consts: its constexpr parameters, in the kernel's order after them;
    options: further compile options (e.g. ``maxnreg``), part of the key.
    """
    grid = (grid,) if isinstance(grid, int) else tuple(grid)
    device = args[0].device
    if device.type != "cuda" or interpreted(kernel) or not fast_launch_enabled():
        _check_order(kernel, args, consts)  # (the cached path relies on it: tested everywhere)
        kernel[grid](*args, **consts, num_warps=num_warps, **options)
        return
    # the kernel object itself in the key: alive as long as its entry
    key = (kernel, device.index, num_warps, *options.items(), *consts.values(),
           *map(_arg_key, args))  # fmt: skip
    compiled = _COMPILED.get(key)
    if compiled is None:
        _check_order(kernel, args, consts)
        if len(_COMPILED) >= CACHE_SIZE:
            _COMPILED.clear()
        _COMPILED[key] = kernel[grid](*args, **consts, num_warps=num_warps, **options)
        return
    gx, gy, gz = (*grid, 1, 1)[:3]
    if _raw_stream is not None:
        stream = _raw_stream(device.index)
    else:
        stream = torch.cuda.current_stream(device).cuda_stream
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if _hook_set(enter) or _hook_set(leave):
        compiled[(gx, gy, gz)](*args, *consts.values(), stream=stream)
        return
    values = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
    compiled.run(
        gx, gy, gz, stream, compiled.function, compiled.packed_metadata, None, enter, leave,
        *values, *consts.values(),
    )  # fmt: skip


def _check_order(kernel, args: tuple, consts: dict) -> None:
    names = list(kernel.arg_names)
    if len(args) + len(consts) != len(names) or names[len(args) :] != list(consts):
        raise AssertionError(
            f"{kernel.__name__}: {len(args)} arguments and constexprs {list(consts)} are not "
            f"the kernel's parameters {names}"
        )


def _hook_set(hook: object) -> bool:
    """Whether a Triton launch hook is set: None or an empty HookChain (by version) is not."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch_tiles(
    kernel, n_groups: int, args: tuple, consts: dict, num_warps: int, max_programs: int | None
) -> None:
    """:func:`launch` a cast kernel over cdiv(n_groups, consts["BLOCK_G"]) tiles of blocks of
    32, on at most ``max_programs`` programs (None: one per tile); programs loop over tiles."""
    n_tiles = cdiv(n_groups, consts["BLOCK_G"])
    launch(kernel, min(n_tiles, max_programs or n_tiles), args, consts, num_warps)
