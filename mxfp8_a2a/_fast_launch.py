"""Launch Triton kernels with less host work than ``kernel[grid](...)``.

``kernel[grid](...)`` binds and specializes every argument on each call (about 30 us of
host time per launch on the H200 machines' CPUs, against 13 us for the compiled kernel's
own launcher: scripts/host_cost.py, BENCHMARKS.md). The exchange launches two or three
kernels per call and small exchanges are bound by host time, so :func:`launch` keeps the
``CompiledKernel`` that the first ``kernel[grid](...)`` returned and calls it directly
afterwards. Its cache key holds everything Triton specializes on: for each tensor its
dtype and whether its address is 16-byte aligned, for each int whether it equals 1, is a
multiple of 16 and fits 32 bits, plus the constexpr values and num_warps. So a kernel is
reused only for arguments Triton itself would have compiled it for.

Kernels under the interpreter (TRITON_INTERPRET=1) go through ``kernel[grid](...)``.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import triton
from triton import knobs

from ._common import interpreted

_COMPILED: dict[tuple, object] = {}
# the current CUDA stream's handle without building a torch.cuda.Stream (~3 us less per call)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _arg_key(a: object) -> object:
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, int) and not isinstance(a, bool):
        return a == 1, a % 16 == 0, -(2**31) <= a < 2**31
    return a


def _keys_and_values(args: tuple) -> tuple[list, list]:
    """(:func:`_arg_key` of each argument, the argument with tensors as their addresses),
    in one pass: the C launcher takes an address as it is, and skips the driver query it
    makes for each tensor."""
    keys, values = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            p = a.data_ptr()
            keys.append((a.dtype, p % 16 == 0))
            values.append(p)
        else:
            keys.append(_arg_key(a))
            values.append(a)
    return keys, values


def launch(kernel, grid: int, args: tuple, consts: dict, num_warps: int) -> None:
    """``kernel[(grid,)](*args, **consts, num_warps=num_warps)``, through the cache.

    args: the runtime arguments in the kernel's order; consts: its constexpr parameters, in
    the kernel's order after them. A cached kernel is launched through its C launcher
    directly (what ``CompiledKernel[grid](...)`` does, without building a closure per call)
    unless Triton's launch hooks are set (e.g. by a profiler).
    """
    device = args[0].device
    if device.type != "cuda" or interpreted(kernel):
        kernel[(grid,)](*args, **consts, num_warps=num_warps)
        return
    keys, values = _keys_and_values(args)
    # id(kernel): the kernels are module-level objects, alive as long as the cache
    key = (id(kernel), device.index, num_warps, *consts.values(), *keys)
    compiled = _COMPILED.get(key)
    if compiled is None:
        names = list(kernel.arg_names)
        if names[len(args) :] != list(consts):
            raise AssertionError(f"constexprs {list(consts)} are not the tail of {names}")
        compiled = _COMPILED[key] = kernel[(grid,)](*args, **consts, num_warps=num_warps)
        _record(compiled, grid, args, consts)
        return
    _record(compiled, grid, args, consts)
    stream = _current_stream(device.index)
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if _active(enter) or _active(leave):
        compiled[(grid, 1, 1)](*args, *consts.values(), stream=stream)
        return
    compiled.run(
        grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, enter, leave,
        *values, *consts.values(),
    )  # fmt: skip


def _current_stream(index: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def hooks_active() -> bool:
    """Whether Triton's launch hooks are set (a profiler): replays then stay off."""
    return _active(knobs.runtime.launch_enter_hook) or _active(knobs.runtime.launch_exit_hook)


def _active(hook: object) -> bool:
    """Whether a Triton launch hook is set: None or an empty HookChain (by version) is not."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch_tiles(
    kernel, n_groups: int, args: tuple, consts: dict, num_warps: int, max_programs: int | None
) -> None:
    """:func:`launch` a cast kernel over cdiv(n_groups, consts["BLOCK_G"]) tiles of blocks of
    32, on at most ``max_programs`` programs (None: one per tile); programs loop over tiles."""
    n_tiles = triton.cdiv(n_groups, consts["BLOCK_G"])
    launch(kernel, min(n_tiles, max_programs or n_tiles), args, consts, num_warps)


# ---------------------------------------------------------------------------- replays
# A call that launches the same kernels with the same arguments every time, up to the
# addresses of a few tensors (the exchange for one shape and one set of splits), records
# its launches once and then replays them: the recorded C-launcher arguments with new base
# addresses, and none of the argument checks, keys or grid arithmetic in between.

_RECORDING = threading.local()


def _record(compiled, grid: int, args: tuple, consts: dict) -> None:
    launches = getattr(_RECORDING, "launches", None)
    if launches is not None:
        launches.append((compiled, grid, args, tuple(consts.values())))


@contextlib.contextmanager
def recording():
    """Collect (compiled kernel, grid, args, constexpr values) of every CUDA launch made
    through :func:`launch` in this thread inside the block; yields the list."""
    launches: list = []
    _RECORDING.launches = launches
    try:
        yield launches
    finally:
        _RECORDING.launches = None


class Replay:
    """Recorded launches, issued again with new base tensors.

    Each tensor argument of a recorded launch is stored as (base index, byte offset) into
    the ``bases`` it was recorded with, so a replay with new bases of the same shapes and
    16-byte alignment gives the same launches on the new data; an empty tensor keeps its
    recorded address (no kernel touches it). :meth:`build` returns None when a non-empty
    argument lies in none of the bases (the launches cannot be replayed).
    """

    def __init__(self, steps: list) -> None:
        self.steps = steps

    @staticmethod
    def _locate(t: torch.Tensor, bases: tuple[torch.Tensor, ...]) -> tuple[int, int] | None:
        p = t.data_ptr()
        for i, b in enumerate(bases):
            start = b.data_ptr()
            if start <= p < start + b.numel() * b.element_size():
                return i, p - start
        return None

    @classmethod
    def build(cls, launches: list, bases: tuple[torch.Tensor, ...]) -> Replay | None:
        steps = []
        for compiled, grid, args, consts in launches:
            values, slots = [], []
            for j, a in enumerate(args):
                if isinstance(a, torch.Tensor) and a.numel() == 0:
                    values.append(a.data_ptr())  # nothing read or written there
                elif isinstance(a, torch.Tensor):
                    where = cls._locate(a, bases)
                    if where is None:
                        return None
                    slots.append((j, *where))
                    values.append(0)
                else:
                    values.append(a)
            values.extend(consts)  # the C launcher takes the constexprs too, and skips them
            meta = compiled.packed_metadata
            steps.append((compiled.run, compiled.function, meta, grid, values, slots))
        return cls(steps)

    def __call__(self, addresses: tuple[int, ...], device_index: int) -> None:
        """Issue the launches on the current stream, base i at ``addresses[i]`` (the caller
        keeps the bases' shapes and 16-byte alignment as recorded)."""
        stream = _current_stream(device_index)
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        for run, function, metadata, grid, values, slots in self.steps:
            values = list(values)
            for j, base, offset in slots:
                values[j] = addresses[base] + offset
            run(grid, 1, 1, stream, function, metadata, None, enter, leave, *values)
