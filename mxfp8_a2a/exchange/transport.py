"""The interface every transport implements, and how a ``transport`` argument resolves.

A transport moves the rows of one MXFP8 exchange: given x [T, K] (rows grouped by
destination rank) and both ranks' splits, it returns [sum(output_splits), K] in x's dtype,
each row dequantize(quantize(row sent)) bit for bit. How the bytes travel (a NCCL
collective, copy engines into symmetric memory, device code) is its own business. Argument
checks, cross-rank validation and autograd live in the exchange (api.py, checks.py), not
here; a new transport is one new file with one subclass.
"""

from __future__ import annotations

import abc

import torch
import torch.distributed as dist


class Transport(abc.ABC):
    """Base class of the exchange's transports.

    Subclasses set ``name`` (for messages), implement :meth:`check` and :meth:`exchange`,
    and override :meth:`setting` if ranks must agree on a parameter. Cross-rank checks
    compare the class (by its qualified name) and ``setting()``.
    """

    name: str = ""
    capturable: bool = False  # whether exchange() can run under CUDA graph capture

    def setting(self) -> int:
        """An int every rank must agree on besides the class (e.g. a row-range count)."""
        return 0

    @abc.abstractmethod
    def check(self, device: torch.device, group: dist.ProcessGroup | None) -> None:
        """Raise a ValueError naming the fix unless this transport can serve tensors on
        ``device`` in ``group``. Called on every rank before any collective."""

    @abc.abstractmethod
    def exchange(
        self,
        x: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup | None,
        scaling_mode: str,
    ) -> torch.Tensor:
        """x [T, K] -> [sum(output_splits), K] in x's dtype (checked arguments)."""


def device_error(device: torch.device, group: dist.ProcessGroup | None) -> str | None:
    """What is wrong with exchanging tensors of ``device`` over ``group``, or None: a tensor
    off CUDA on a group whose only backend is NCCL (a group made with "cpu:gloo,cuda:nccl"
    exchanges CPU tensors over gloo)."""
    if device.type == "cuda" or not dist.is_initialized():  # (no group: nothing to take it)
        return None
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "cpu:" not in backend and "gloo" not in backend:
        return (
            f"x is on {device}, and the group's backend (NCCL) takes CUDA tensors; move x to "
            "its GPU or pass a gloo group"
        )
    return None
