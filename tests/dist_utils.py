"""Run a function on N spawned processes (gloo on CPU, or NCCL with one GPU each).

Every worker gets (rank, world_size, *args); a worker's exception fails the test with its
traceback, and a run that outlives ``timeout`` (a hang) is killed and fails the test.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# gloo on CPU everywhere; NCCL where there are at least 2 GPUs
BACKENDS = [
    pytest.param("gloo", id="gloo"),
    pytest.param(
        "nccl",
        id="nccl",
        marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
    ),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, backend, fn, args, queue):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world)
        result = fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def run_distributed(
    fn: Callable, world: int, *args, backend: str = "gloo", timeout: float = 240.0
) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return the results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, backend, fn, args, queue), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
    except Exception:
        errors.append(f"timed out after {timeout} s (a hang?); finished ranks: {sorted(results)}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]
