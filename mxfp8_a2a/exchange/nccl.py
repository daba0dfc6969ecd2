"""The NCCL transport: quantize_packed, one all_to_all_single of packed rows,
dequantize_packed.

Only the rows that leave the rank go on the wire; the rows a rank sends itself go through
the round-trip kernel straight into their place in the output while the others are on the
wire (on CUDA from KEEP_LOCAL_MIN_ELEMENTS elements up; below that the extra launch costs
more host time than it saves GPU time). Over gloo (CPU tensors) the same steps run with the
torch references. Works for any group NCCL or gloo serves, inter-node included.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _config
from .._common import e4m3_gpu_error
from .rows import dequantize_into, quantize_into, roundtrip_into, wire_row
from .transport import Transport, device_error


def keeps_local(n: int, k: int, device: torch.device) -> bool:
    """Whether the n rows a rank sends itself skip the wire (always on CPU; on CUDA when
    there are enough of them to repay the extra kernel launch)."""
    return n > 0 and (device.type != "cuda" or n * k >= _config.KEEP_LOCAL_MIN_ELEMENTS)


def _binding(pg: dist.ProcessGroup):
    """The process group's own alltoall_base (its binding: not public API), or None where this
    torch has none (all_to_all then makes the public call)."""
    return getattr(pg, "alltoall_base", None)


def all_to_all(out, inp, out_splits, in_splits, group, async_op: bool) -> dist.Work | None:
    """all_to_all_single through the process group object: the Python wrapper's argument
    checks and logging cost host time that small exchanges cannot spare.

    async_op=True returns the Work to wait on (NCCL runs on its own stream, so a cast can run
    beside it); False orders the collective on the caller's stream (NCCL in torch >= 2.8
    then launches it there, without cross-stream events: less latency when nothing runs
    beside it) and returns None."""
    pg = group if group is not None else dist.group.WORLD
    fast = _binding(pg)
    if fast is None:  # the public call
        work = dist.all_to_all_single(out, inp, out_splits, in_splits, group, async_op=async_op)
        return work if async_op else None
    opts = dist.AllToAllOptions()
    opts.asyncOp = async_op
    work = fast(out, inp, out_splits, in_splits, opts)
    if async_op:
        return work
    if work is not None:  # what all_to_all_single does for a synchronous call
        work.wait()
    return None


class NcclTransport(Transport):
    """``transport="nccl"`` (the default): any group, CUDA tensors over NCCL or CPU tensors
    over gloo. Stateless; CUDA-graph capturable."""

    name, capturable = "nccl", True

    def check(self, device: torch.device, group: dist.ProcessGroup | None) -> None:
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"x must be a CPU (gloo) or CUDA (NCCL) tensor, got {device}")
        problem = device_error(device, group) or e4m3_gpu_error(device)
        if problem is not None:
            raise ValueError(problem)

    def exchange(self, x, output_splits, input_splits, group, scaling_mode):
        rank, k = dist.get_rank(group), x.shape[1]
        x_at, o_at = sum(input_splits[:rank]), sum(output_splits[:rank])
        n = input_splits[rank] if keeps_local(input_splits[rank], k, x.device) else 0
        out = x.new_empty((sum(output_splits), k))
        send_splits, recv_splits = list(input_splits), list(output_splits)
        send_splits[rank] -= n
        recv_splits[rank] -= n
        row = wire_row(k)
        send = torch.empty((x.shape[0] - n, row), dtype=torch.uint8, device=x.device)
        recv = torch.empty((out.shape[0] - n, row), dtype=torch.uint8, device=x.device)
        quantize_into(x, send, scaling_mode, (x_at, n))
        # asynchronous only when the kept rows' round trip runs beside the collective
        work = all_to_all(recv, send, recv_splits, send_splits, group, async_op=n > 0)
        if n:
            roundtrip_into(x[x_at : x_at + n], out[o_at : o_at + n], scaling_mode, True)
        if work is not None:
            work.wait()
        dequantize_into(recv, out, (o_at, n))
        return out


NCCL = NcclTransport()


def resolve(transport: str | Transport) -> Transport:
    """The Transport for a ``transport`` argument: "nccl" or a Transport instance."""
    if isinstance(transport, Transport):
        return transport
    if transport == "nccl":
        return NCCL
    raise ValueError(
        f"transport must be 'nccl' or a Transport object (e.g. mxfp8_a2a.CopyEngineTransport"
        f"(group)), got {transport!r}"
    )
