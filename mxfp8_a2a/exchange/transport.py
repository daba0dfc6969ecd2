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


def resolve(transport: str | Transport) -> Transport:
    """The Transport for a ``transport`` argument: "nccl" or a Transport instance."""
    from .nccl import NCCL  # nccl.py imports this module

    if isinstance(transport, Transport):
        return transport
    if transport == "nccl":
        return NCCL
    raise ValueError(
        f"transport must be 'nccl' or a Transport object (e.g. mxfp8_a2a.CopyEngineTransport"
        f"(group)), got {transport!r}"
    )
