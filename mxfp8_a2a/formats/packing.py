"""The packed wire layout: one uint8 row per token, K e4m3 bytes then K/32 scale bytes.

A packed tensor has shape [..., K + K // 32] and dtype uint8. It is what the exchange
sends, so data and scales travel in one collective.
"""

from __future__ import annotations

import torch

from .._common import BLOCK


def packed_row_bytes(k: int) -> int:
    """Bytes per packed row for ``k`` elements (k % 32 == 0): k + k // 32."""
    if k % BLOCK != 0:
        raise ValueError(f"k ({k}) must be a multiple of {BLOCK}")
    return k + k // BLOCK


def k_from_packed_row_bytes(row_bytes: int) -> int:
    """Inverse of :func:`packed_row_bytes`; raises when ``row_bytes`` is not 33 * n."""
    if row_bytes % (BLOCK + 1) != 0:
        raise ValueError(
            f"packed.shape[-1] ({row_bytes}) must be K + K/32 = 33 * (K/32) bytes for some "
            "K multiple of 32; was the tensor made by quantize_packed?"
        )
    return row_bytes // (BLOCK + 1) * BLOCK


def pack(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Join ``data`` (float8_e4m3fn [..., K]) and ``scales`` (float8_e8m0fnu [..., K/32]).

    Returns uint8 [..., K + K/32].
    """
    if data.dtype != torch.float8_e4m3fn:
        raise TypeError(f"data must be float8_e4m3fn, got {data.dtype}")
    if scales.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"scales must be float8_e8m0fnu, got {scales.dtype}")
    k = data.shape[-1]
    if k % BLOCK != 0 or scales.shape != (*data.shape[:-1], k // BLOCK):
        raise ValueError(
            f"scales must have shape {(*data.shape[:-1], k // BLOCK)} for data of shape "
            f"{tuple(data.shape)}, got {tuple(scales.shape)}"
        )
    return torch.cat([data.view(torch.uint8), scales.view(torch.uint8)], dim=-1)


def unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split uint8 [..., K + K/32] into (float8_e4m3fn [..., K], float8_e8m0fnu [..., K/32]).

    The results are contiguous; they may share packed's storage (one row, or a 1-D packed),
    so clone them before writing into packed.
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    k = k_from_packed_row_bytes(packed.shape[-1])
    data = packed[..., :k].contiguous().view(torch.float8_e4m3fn)
    scales = packed[..., k:].contiguous().view(torch.float8_e8m0fnu)
    return data, scales
