"""Process-group set-up for scripts started with torchrun."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_from_torchrun() -> torch.device:
    """Join the torchrun group: NCCL with one GPU per process where CUDA is present (the GPU
    is LOCAL_RANK), gloo on CPU otherwise. Returns the device to put tensors on."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")
