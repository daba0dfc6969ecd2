"""Run a function on N spawned processes (gloo on CPU, or NCCL with one GPU each).

Every worker gets (rank, world_size, *args); a worker's exception fails the test with its
traceback, a worker that dies (a signal, gloo's abort) fails it at once, and a run that
outlives ``timeout`` (a hang) is killed and fails the test.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import socket
import time
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


def _worker(rank, world, port, backend, fn, args, queue, pg_timeout, finish):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        extra = {} if pg_timeout is None else {"timeout": datetime.timedelta(seconds=pg_timeout)}
        dist.init_process_group(backend, rank=rank, world_size=world, **extra)
        result = fn(rank, world, *args)
        if finish:
            dist.barrier()
            dist.destroy_process_group()
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def run_distributed(
    fn: Callable,
    world: int,
    *args,
    backend: str = "gloo",
    timeout: float = 240.0,
    pg_timeout: float | None = None,
    finish: bool = True,
) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return the results by rank.

    pg_timeout: the process group's collective timeout in seconds (default: torch's), for
    workers that expect a collective to time out. finish=False: no closing barrier (for
    workers that leave the group broken on purpose)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world, port, backend, fn, args, queue, pg_timeout, finish),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = time.monotonic() + timeout
    dead_since: float | None = None
    try:
        while len(results) < world and not errors:
            try:
                rank, status, payload = queue.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode]
                if dead:  # wait a moment for results still in the pipe
                    dead_since = dead_since or time.monotonic()
                    if time.monotonic() - dead_since > 2.0:
                        codes = {r: procs[r].exitcode for r in dead}
                        errors.append(f"rank(s) died without a result (exit codes {codes})")
                elif time.monotonic() > deadline:
                    errors.append(
                        f"timed out after {timeout} s (a hang?); finished ranks: {sorted(results)}"
                    )
                continue
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]
