"""Helpers for scripts started with torchrun (and the tests): process-group set-up, CUDA
graph capture."""

from __future__ import annotations

import os
from collections.abc import Callable

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


def capture_graph(fn: Callable[[], object], warmup: int = 3) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, fn's outputs inside it): fn run ``warmup`` times on a side stream (as capture
    wants: lazy set-up and allocator state settle outside the graph), then captured once.
    Replaying the graph rewrites those outputs in place."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
