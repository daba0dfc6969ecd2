"""Packed rows in and out of exchange buffers, shared by the transports.

A wire row is the packed MXFP8 row (K e4m3 bytes, then K/32 scale bytes) padded to a
multiple of 16 bytes, so that every row of a buffer starts 16-byte aligned and the kernels
move 16 bytes per access. On CUDA the Triton casts write and read the buffers in place; on
CPU (gloo) the torch references do the same.
"""

from __future__ import annotations

import torch

from .. import _config
from .._common import sm_count
from ..formats.dequantize import _launch as _dequantize_launch
from ..formats.dequantize import dequantize_reference
from ..formats.packing import pack, packed_row_bytes, unpack
from ..formats.quantize import _launch as _quantize_launch
from ..formats.quantize import quantize_reference
from ..formats.roundtrip import _launch as _roundtrip_launch
from ..formats.roundtrip import quantize_dequantize_reference

Gap = tuple[int, int]


def wire_row(k: int) -> int:
    """Bytes of one wire row of K columns: packed_row_bytes(K) rounded up to 16."""
    return -(-packed_row_bytes(k) // 16) * 16


def beside_comm_programs(device: torch.device) -> int | None:
    """Grid cap of a cast that runs beside communication kernels (BESIDE_COMM_* in
    _config.py), None on CPU."""
    if device.type != "cuda":
        return None
    return max(sm_count(device) - _config.BESIDE_COMM_FREE_SMS, 1)


def _beside(programs: int | None) -> tuple[int | None, int | None]:
    if programs is None:
        return None, None
    return _config.BESIDE_COMM_BLOCK_G, _config.BESIDE_COMM_NUM_WARPS


def quantize_into(x: torch.Tensor, buf: torch.Tensor, mode: str, gap: Gap = (0, 0)) -> None:
    """buf (uint8 [M - n, >= packed row]) <- packed rows of x [M, K] without rows
    [at, at + n) (gap = (at, n))."""
    k = x.shape[1]
    if x.device.type == "cuda":
        row = buf.stride(0)
        _quantize_launch(x, buf, buf[:, k:], row, row, mode, gap)
        return
    at, n = gap
    rows = torch.cat([x[:at], x[at + n :]]) if n else x
    buf[:, : packed_row_bytes(k)].copy_(pack(*quantize_reference(rows, mode)))


def dequantize_into(buf: torch.Tensor, out: torch.Tensor, gap: Gap = (0, 0)) -> None:
    """out [M, K] rows outside [at, at + n) <- the dequantized packed rows of buf, in order."""
    if out.device.type == "cuda":
        row, k = buf.stride(0), out.shape[1]
        _dequantize_launch(buf, buf[:, k:], row, row, out, gap)
        return
    at, n = gap
    y = dequantize_reference(*unpack(buf[:, : packed_row_bytes(out.shape[1])]), out.dtype)
    out[:at] = y[:at]
    out[at + n :] = y[at:]


def roundtrip_into(x: torch.Tensor, out: torch.Tensor, mode: str, beside_comm: bool) -> None:
    """out [n, K] <- dequantize(quantize(x [n, K])) in x's dtype; ``beside_comm``: launched
    with the configuration of casts that run beside a collective."""
    if x.device.type != "cuda":
        out.copy_(quantize_dequantize_reference(x, mode))
        return
    programs = beside_comm_programs(x.device) if beside_comm else None
    _roundtrip_launch(x, out, mode, programs, *_beside(programs))
