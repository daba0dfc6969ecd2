"""Run a function on N spawned processes (gloo on CPU, or NCCL with one GPU each).

Every worker gets (rank, world_size, *args); a worker's exception fails the test with its
traceback, a worker that dies (a signal, gloo's abort) fails it at once, and a run that
outlives ``timeout`` (a hang) is killed and fails the test.

Spawning a process group costs seconds per rank on a small CPU machine (each rank imports
torch and Triton), more than most cases take. So a run with the default process group
settings goes to a kept group of that size and backend: its ranks run one case after
another, each as if in a fresh process (the default RNG reseeded, the environment and
torch.compile's caches reset). A group whose case fails, dies or hangs is killed; the next
run spawns a new one. Runs that break their group on purpose (``pg_timeout``,
``finish=False``), change module state (``fresh=True``) or need more than KEEP_MAX_WORLD
ranks get a group of their own.
"""

from __future__ import annotations

import atexit
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

KEEP_GROUPS = 4  # kept process groups (by size and backend): 1 to 4 ranks, about 0.4 GB each
KEEP_MAX_WORLD = 4  # larger groups (a test or two) get one of their own


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank, world, port, backend, pg_timeout) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # ranks share the cores
    extra = {} if pg_timeout is None else {"timeout": datetime.timedelta(seconds=pg_timeout)}
    dist.init_process_group(backend, rank=rank, world_size=world, **extra)


def _worker(rank, world, port, backend, fn, args, queue, pg_timeout, finish):
    """One run in a group of its own."""
    try:
        _init(rank, world, port, backend, pg_timeout)
        result = fn(rank, world, *args)
        if finish:
            dist.barrier()
            dist.destroy_process_group()
        queue.put((0, rank, "ok", result))
    except BaseException:
        queue.put((0, rank, "error", traceback.format_exc()))


def _serve(rank, world, port, backend, tasks, queue):
    """A kept group's rank: runs (number, fn, args) from ``tasks`` until None."""
    try:
        _init(rank, world, port, backend, None)
    except BaseException:
        queue.put((-1, rank, "error", traceback.format_exc()))
        return
    seed, env = torch.initial_seed(), dict(os.environ)
    while (task := tasks.get()) is not None:
        number, fn, args = task
        torch.manual_seed(seed)  # as in a fresh process
        torch.compiler.reset()
        from mxfp8_a2a.moe import checks

        checks._GROUPS.clear()  # (configurations the group agreed on: per process)
        try:
            result = fn(rank, world, *args)
            dist.barrier()
            queue.put((number, rank, "ok", result))
        except BaseException:
            queue.put((number, rank, "error", traceback.format_exc()))
        os.environ.clear()
        os.environ.update(env)
    dist.destroy_process_group()


class _Group:
    """Spawned ranks and the queue their results come back on."""

    def __init__(self, world, backend, fn=None, args=(), pg_timeout=None, finish=True):
        ctx = mp.get_context("spawn")
        self.queue = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)] if fn is None else None
        port = _free_port()
        self.procs = [
            ctx.Process(
                target=_serve if fn is None else _worker,
                args=(r, world, port, backend, self.tasks[r], self.queue)
                if fn is None
                else (r, world, port, backend, fn, args, self.queue, pg_timeout, finish),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        self.number = 0

    def submit(self, fn, args) -> int:
        self.number += 1
        for t in self.tasks:
            t.put((self.number, fn, args))
        return self.number

    def collect(self, number: int, timeout: float) -> tuple[dict, list]:
        """Results by rank of run ``number``, or the errors that ended it."""
        world = len(self.procs)
        results, errors = {}, []
        deadline = time.monotonic() + timeout
        dead_since: float | None = None
        while len(results) < world and not errors:
            try:
                got, rank, status, payload = self.queue.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(self.procs) if r not in results and p.exitcode]
                if dead:  # wait a moment for results still in the pipe
                    dead_since = dead_since or time.monotonic()
                    if time.monotonic() - dead_since > 2.0:
                        codes = {r: self.procs[r].exitcode for r in dead}
                        errors.append(f"rank(s) died without a result (exit codes {codes})")
                elif time.monotonic() > deadline:
                    errors.append(
                        f"timed out after {timeout} s (a hang?); finished ranks: {sorted(results)}"
                    )
                continue
            if status != "ok":
                errors.append(f"rank {rank}:\n{payload}")
            elif got == number:
                results[rank] = payload
        return results, errors

    def close(self, wait: float) -> None:
        for p in self.procs:
            p.join(timeout=wait)
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=1)


_KEPT: dict[tuple[int, str], _Group] = {}


@atexit.register
def _close_kept() -> None:
    while _KEPT:
        _, group = _KEPT.popitem()
        for t in group.tasks:
            t.put(None)
        group.close(wait=5)


def run_distributed(
    fn: Callable,
    world: int,
    *args,
    backend: str = "gloo",
    timeout: float = 240.0,
    pg_timeout: float | None = None,
    finish: bool = True,
    fresh: bool = False,
) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return the results by rank.

    pg_timeout: the process group's collective timeout in seconds (default: torch's), for
    workers that expect a collective to time out. finish=False: no closing barrier (for
    workers that leave the group broken on purpose). fresh=True: for workers that change
    module state (patch a function, say). These, and groups of more than KEEP_MAX_WORLD
    ranks, get a group of their own; other runs share a kept one (see the module's
    docstring)."""
    if pg_timeout is not None or not finish or fresh or world > KEEP_MAX_WORLD:
        group = _Group(world, backend, fn, args, pg_timeout, finish)
        errors = ["interrupted"]
        try:
            results, errors = group.collect(0, timeout)
        finally:
            group.close(wait=0.1 if errors else 5)
    else:
        key = (world, backend)
        group = _KEPT.pop(key, None) or _Group(world, backend)
        try:
            results, errors = group.collect(group.submit(fn, args), timeout)
        except BaseException:  # an interrupt, pytest-timeout
            group.close(wait=0.1)
            raise
        if errors:
            group.close(wait=0.1)
        else:
            _KEPT[key] = group  # the most recently used last
            if len(_KEPT) > KEEP_GROUPS:
                _close_kept_group(next(iter(_KEPT)))
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]


def _close_kept_group(key) -> None:
    group = _KEPT.pop(key)
    for t in group.tasks:
        t.put(None)
    group.close(wait=5)
