"""Test set-up: without CUDA, Triton kernels run on CPU tensors through the interpreter.

TRITON_INTERPRET must be set before triton.jit decorates the kernels, so before
mxfp8_a2a is imported. With CUDA present the kernels are compiled and CPU-kernel cases skip.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_make_parametrize_id(config, val, argname):
    """Readable test ids for dtypes ("bfloat16", not "dtype0"), so that -k can pick them."""
    if isinstance(val, torch.dtype):
        return str(val).removeprefix("torch.")
    return None
