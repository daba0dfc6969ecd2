"""Plain-torch definitions of the per-group FP8 scaling (jagged MoE tensors), the
behaviour the kernels match bit for bit.

Scales are multipliers: scale = 448 / max(amax, 1e-12), amax in the input dtype, the
division in float64 rounded to float32 (optionally rounded down to a power of two);
data = clamp(x * scale, -448, 448) in fp32, cast to e4m3 (NaN stays NaN). An empty group
gets scale fp32(448 / 1e-12).
"""

from __future__ import annotations

import torch

EPS = 1e-12


def scales_from_amax(amax: torch.Tensor, round_scales_to_power_of_2: bool) -> torch.Tensor:
    """fp32 scales 448 / max(amax, 1e-12) (float64 division), optionally rounded down to a
    power of two (by the exponent, so exact)."""
    s = (448.0 / amax.double().clamp(min=EPS)).float()
    if round_scales_to_power_of_2:
        _, e = torch.frexp(s)
        s = torch.where(s.isnan() | (s == 0), s, torch.ldexp(torch.ones_like(s), e - 1))
    return s


def _to_e4m3(y: torch.Tensor) -> torch.Tensor:
    y = torch.where(y.isnan(), float("nan"), y.clamp(-448.0, 448.0))  # canonical NaN
    return y.to(torch.float8_e4m3fn)


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends, strict=True))


def per_group_colwise_reference(
    x: torch.Tensor, offs: torch.Tensor, round_scales_to_power_of_2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loop over groups of rows: x (M, K), offs int32 [G] -> (e4m3 (M, K), fp32 (G, K))."""
    data = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = []
    for lo, hi in _bounds(offs):
        part = x[lo:hi]
        amax = part.abs().amax(0) if hi > lo else x.new_zeros(x.shape[1])
        s = scales_from_amax(amax.float(), round_scales_to_power_of_2)
        data[lo:hi] = _to_e4m3(part.float() * s)
        scales.append(s)
    return data, torch.stack(scales) if scales else x.new_zeros(
        (0, x.shape[1]), dtype=torch.float32
    )


def per_group_rowwise_reference(
    x: torch.Tensor, offs: torch.Tensor, round_scales_to_power_of_2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loop over groups of columns: x (N, M), offs int32 [G] -> (e4m3 (N, M), fp32 (G, N))."""
    data, scales = per_group_colwise_reference(x.t(), offs, round_scales_to_power_of_2)
    return data.t(), scales
