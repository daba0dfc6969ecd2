"""Can two processes on ONE GPU run all_to_all_single on CUDA tensors? Tries each backend
torch offers here (gloo with CUDA tensors; NCCL, which refuses two ranks on one device) at 2
ranks with uneven splits and prints what each did.

    python3 scripts/gloo_cuda_probe.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, backend: str, port: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group(backend, rank=rank, world_size=2, device_id=None)
        torch.cuda.set_device(0)
        splits = [1 + rank, 2 + rank]  # rows to rank 0, rank 1
        x = torch.full((sum(splits), 4), float(rank), device="cuda")
        out_splits = [1 + 0 if rank == 0 else 2 + 0, 1 + 1 if rank == 0 else 2 + 1]
        y = torch.empty(sum(out_splits), 4, device="cuda")
        dist.all_to_all_single(y, x, out_splits, splits)
        torch.cuda.synchronize()
        want = torch.cat([torch.full((out_splits[r], 4), float(r), device="cuda") for r in (0, 1)])
        q.put((rank, "ok" if torch.equal(y, want) else f"wrong {y[:, 0].tolist()}"))
        dist.destroy_process_group()
    except Exception as e:  # report, do not hang the probe
        q.put((rank, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))


def main() -> None:
    ctx = mp.get_context("spawn")
    for i, backend in enumerate(("gloo", "nccl")):
        q = ctx.Queue()
        procs = [ctx.Process(target=worker, args=(r, backend, 29600 + i, q)) for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        got = sorted(q.get() for _ in range(q.qsize()))
        print(f"{backend} with CUDA tensors, 2 ranks on one GPU: {got or 'no answer (hang)'}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
