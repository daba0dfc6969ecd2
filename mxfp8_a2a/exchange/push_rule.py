"""Whether the push transport (push.py) can serve a process group: the rule behind
``transport="auto"`` and :func:`mxfp8_a2a.static_transport`, the same answer on every rank."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist


def _device(device) -> torch.device:
    """``device`` (default: the current CUDA device, else the CPU) with its index."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _symm_mem():
    """torch.distributed._symmetric_memory where it has what PushBuffer uses, else None."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:  # (a torch build without it)
        return None
    return symm_mem if all(hasattr(symm_mem, f) for f in ("empty", "rendezvous")) else None


def _gather(group: dist.ProcessGroup | None, value) -> list:
    """Every rank's ``value`` (all_gather_object; a group of one rank gathers nothing)."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out


def _this_rank(device: torch.device) -> tuple:
    """(host, GPU uuid, why not, or None) of this rank: on a CUDA GPU with peer access to
    every other GPU this process sees, torch symmetric memory present."""
    if device.type != "cuda":
        return socket.gethostname(), None, f"tensors on {device}, not on a CUDA GPU"
    if _symm_mem() is None:
        return socket.gethostname(), None, "this torch has no torch.distributed._symmetric_memory"
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", device.index))
    for j in range(torch.cuda.device_count()):
        if j != device.index and not torch.cuda.can_device_access_peer(device, j):
            return socket.gethostname(), uuid, f"no peer access from {device} to cuda:{j}"
    return socket.gethostname(), uuid, None


def _verdict(peers: list) -> str | None:
    """Why not, from every rank's _this_rank (the same answer on every rank), or None."""
    reasons = [f"rank {r}: {why}" for r, (_, _, why) in enumerate(peers) if why]
    if len({host for host, _, _ in peers}) > 1:
        reasons.append(f"the ranks are on {len({h for h, _, _ in peers})} hosts")
    gpus = [uuid for _, uuid, _ in peers if uuid is not None]
    if len(set(gpus)) < len(gpus):
        reasons.append("two ranks share a GPU")
    return "; ".join(reasons) or None


def push_unavailable(
    group: dist.ProcessGroup | None, device: torch.device | str | None = None
) -> str | None:
    """Why the push transport cannot serve ``group`` on ``device`` (None: it can): every rank
    on one host, on a GPU of its own, with peer access to every GPU its process sees, and
    torch symmetric memory present. A collective (all_gather_object) when the group has more
    than one rank; the same answer on every rank."""
    return _verdict(_gather(group, _this_rank(_device(device))))
