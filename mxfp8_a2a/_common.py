"""Argument checks and backend selection shared by the public functions."""

from __future__ import annotations

import functools
import os

import torch

SCALING_MODES = ("rceil", "floor")
BACKENDS = ("auto", "triton", "torch")
BLOCK = 32
E4M3_MAX = 448.0  # largest finite e4m3fn value


def check_scaling_mode(scaling_mode: str) -> None:
    if scaling_mode not in SCALING_MODES:
        raise ValueError(f"scaling_mode must be one of {SCALING_MODES}, got {scaling_mode!r}")


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, as triton.cdiv on the host without its per-call cost (a
    ConstexprFunction call: 3.5-10 us on triton 3.9 / 3.6, against 0.05 us here)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n for n >= 1 (0 for n <= 0), as triton.next_power_of_2
    on the host, without its per-call cost."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


# what Triton's decorator read when this package's kernels were defined (at its import)
INTERPRET_AT_IMPORT = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreted(kernel) -> bool:
    """True when ``kernel`` was decorated while TRITON_INTERPRET=1 (runs on CPU tensors).
    Under torch.compile: the setting at import (torch 2.11's Dynamo cannot trace the kernel
    object's type)."""
    if torch.compiler.is_compiling():
        return INTERPRET_AT_IMPORT
    return type(kernel).__name__ == "InterpretedFunction"


def kernels_run_on(device: torch.device, kernel) -> bool:
    """Whether ``kernel`` runs on tensors of ``device``: CUDA, or CPU under the Triton
    interpreter (elsewhere the callers take their plain-torch reference)."""
    return device.type == "cuda" or interpreted(kernel)


def resolve_backend(backend: str, device: torch.device, kernel) -> str:
    """Map ``backend`` ("auto", "triton", "torch") to "triton" or "torch" for ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    # Under torch.compile the kernel object cannot be inspected; a misconfigured setup then
    # fails at the launch instead of here.
    if backend == "triton" and not torch.compiler.is_compiling():
        if device.type == "cpu" and not interpreted(kernel):
            raise RuntimeError(
                "backend='triton' got CPU tensors, but Triton kernels run on CPU only in "
                "interpreter mode: set TRITON_INTERPRET=1 before importing mxfp8_a2a, move "
                "the tensors to CUDA, or use backend='torch'"
            )
        if device.type == "cuda" and interpreted(kernel):
            raise RuntimeError(
                "backend='triton' got CUDA tensors while TRITON_INTERPRET=1 is set; unset it "
                "to run compiled kernels"
            )
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"backend='triton' supports CPU and CUDA tensors, got {device}")
    return backend


def check_float_input(x: torch.Tensor, name: str = "x") -> int:
    """Check a bf16/fp32 tensor of shape [..., K], K % 32 == 0; return K."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"{name} must be bfloat16 or float32, got {x.dtype}; cast it with .to()")
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension, got a scalar")
    k = x.shape[-1]
    if k % BLOCK != 0:
        raise ValueError(
            f"{name}.shape[-1] (K={k}) must be a multiple of {BLOCK}; pad the last dimension"
        )
    return k


def check_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")


# the most blocks of 32 a cast launch covers: its int32 block index (tile * BLOCK_G + lane)
# must not wrap for the last tile at the largest BLOCK_G in _config (1024)
MAX_BLOCKS = 2**31 - 1024


def block_count(rows: int, k: int, name: str) -> int:
    """Blocks of 32 in ``rows`` rows of K values (what a cast kernel's grid covers); at most
    MAX_BLOCKS (2**31 - 1024), so that the kernels' int32 block index does not wrap."""
    n = rows * (k // BLOCK)
    if n > MAX_BLOCKS:
        raise ValueError(f"{name} has {n} blocks of 32; at most {MAX_BLOCKS} are supported")
    return n


@functools.cache
def capability(device: torch.device) -> tuple[int, int]:
    """Compute capability (major, minor) of a CUDA device (cached)."""
    return torch.cuda.get_device_capability(device)


# Triton's e4m3 type, which every FP8 kernel here converts through, needs sm_89 or newer
E4M3_GPU_FROM = (8, 9)


def e4m3_gpu_error(device: torch.device) -> str | None:
    """Why the FP8 (e4m3) kernels cannot run on ``device``, or None (CPU, or sm_89+; and
    while torch.compile traces, where the launchers inside the custom ops check at run time)."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return None
    major, minor = capability(device)
    if (major, minor) >= E4M3_GPU_FROM:
        return None
    return (
        f"the MXFP8/FP8 kernels need a GPU of compute capability 8.9 or newer (L4, L40, H100, "
        f"H200, B200: Triton has no e4m3 type before), and {device} is sm_{major}{minor}: send "
        "bf16 instead (exchange='bf16' in dispatch, combine and ExpertParallelMoE; "
        "precision='bf16' in grouped_mm), or run the casts with backend='torch'"
    )


def check_e4m3_gpu(device: torch.device) -> None:
    """RuntimeError with e4m3_gpu_error's reason where the FP8 kernels cannot run."""
    problem = e4m3_gpu_error(device)
    if problem is not None:
        raise RuntimeError(problem)


def hw_e8m0(device: torch.device) -> bool:
    """Whether kernels on ``device`` take the hardware e8m0 conversion (sm_100+)."""
    return device.type == "cuda" and capability(device)[0] >= 10


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., W] as [rows, W] (a view where t's strides allow; W = 0 works, unlike
    reshape(-1, W))."""
    return t.reshape(t.shape[:-1].numel(), t.shape[-1])


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """t.contiguous(), spelled as a clone (which fake CUDA tensors on a CPU-only build of
    torch also run, so that tests can trace CUDA paths there)."""
    return t if t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)
