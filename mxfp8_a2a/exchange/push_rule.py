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


def _probe(device) -> tuple[torch.device | None, tuple, str | None]:
    """(the device, _this_rank of it, None), or (None, a placeholder, the error) where
    ``device`` is not one this process can use: gathered, so every rank raises alike."""
    try:
        dev = _device(device)
        return dev, _this_rank(dev), None
    except Exception as e:  # (a bad device string, CUDA absent: this rank's alone)
        return None, (socket.gethostname(), None, None), f"device={device!r}: {e}"


def device_errors(errors: list) -> str | None:
    """The ranks' device errors (each rank's _probe error in ``errors``) as one text."""
    bad = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    return "; ".join(bad) + "; pass a device every rank can use" if bad else None


def push_unavailable(
    group: dist.ProcessGroup | None, device: torch.device | str | None = None
) -> str | None:
    """Why the push transport cannot serve ``group`` on ``device`` (None: it can): every rank
    on one host, on a GPU of its own, with peer access to every GPU its process sees, and
    torch symmetric memory present. A collective (all_gather_object) when the group has more
    than one rank; the same answer on every rank. A ``device`` that one rank cannot use
    raises the same ValueError on every rank."""
    _, me, error = _probe(device)
    peers = _gather(group, (me, error))
    if (problem := device_errors([e for _, e in peers])) is not None:
        raise ValueError(f"push_unavailable: {problem}")
    return _verdict([p for p, _ in peers])
