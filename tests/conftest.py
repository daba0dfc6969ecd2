"""Test set-up: without CUDA, Triton kernels run on CPU tensors through the interpreter.

TRITON_INTERPRET must be set before triton.jit decorates the kernels, so before
mxfp8_a2a is imported. With CUDA present the kernels are compiled and CPU-kernel cases skip.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_make_parametrize_id(config, val, argname):
    """Readable test ids for dtypes ("bfloat16", not "dtype0"), so that -k can pick them."""
    if isinstance(val, torch.dtype):
        return str(val).removeprefix("torch.")
    return None


@pytest.fixture(scope="module")
def group_of_one():
    """A gloo process group of one rank in this process (on a free port), for the module."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
