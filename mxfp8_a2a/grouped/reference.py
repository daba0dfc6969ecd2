"""Plain-torch definitions of the per-group FP8 scaling (jagged MoE tensors), the
behaviour the kernels match bit for bit.

Scales are multipliers: scale = 448 / max(amax, 1e-12), amax in the input dtype, the
division in float64 rounded to float32 (optionally rounded down to a power of two);
data = clamp(x * scale, -448, 448) in fp32, cast to e4m3 (NaN stays NaN). An empty group
gets scale fp32(448 / 1e-12).

Offsets: group g covers [e[g-1], e[g]) (e[-1] = 0) of the group axis (length ``extent``),
where e is offs clamped into [0, extent] and made non-decreasing by a running maximum. For
valid offsets (non-decreasing, in range, offs[-1] == extent) that is offs itself; bad ones
(with validate=False) give this defined partition, identical in every backend. Indices past
e[-1] belong to no group: their data is 0. No groups (empty offs): all data 0, scales (0, n).
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


def empty_group_scale(round_scales_to_power_of_2: bool, inverse: bool) -> float:
    """The scale of a group without elements (amax 0), or with ``inverse`` its reciprocal."""
    s = scales_from_amax(torch.zeros(()), round_scales_to_power_of_2)
    return (s.reciprocal() if inverse else s).item()


def _to_e4m3(y: torch.Tensor) -> torch.Tensor:
    y = torch.where(y.isnan(), float("nan"), y.clamp(-448.0, 448.0))  # canonical NaN
    return y.to(torch.float8_e4m3fn)


def group_bounds(offs: torch.Tensor, extent: int) -> list[tuple[int, int]]:
    """[(start, end)] of each group: offs clamped into [0, extent], running maximum."""
    ends = offs.to(torch.int64).clamp(0, extent)
    ends = (ends.cummax(0).values if ends.numel() else ends).tolist()
    return list(zip([0, *ends][: len(ends)], ends, strict=True))


DATA_LAYOUTS = ("row_major", "column_major")


def empty_data(shape, data_layout: str, device) -> torch.Tensor:
    """A 2-D uint8 tensor of ``shape``: "row_major" (contiguous) or "column_major" (its .t()
    contiguous)."""
    if data_layout not in DATA_LAYOUTS:
        raise ValueError(f"data_layout must be one of {DATA_LAYOUTS}, got {data_layout!r}")
    if data_layout == "column_major":
        return torch.empty(shape[::-1], dtype=torch.uint8, device=device).t()
    return torch.empty(shape, dtype=torch.uint8, device=device)


def per_group_colwise_reference(
    x: torch.Tensor,
    offs: torch.Tensor,
    round_scales_to_power_of_2: bool = False,
    data_layout: str = "row_major",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loop over groups of rows: x (M, K), offs int32 [G] -> (e4m3 (M, K) in ``data_layout``,
    fp32 (G, K))."""
    data = empty_data(x.shape, data_layout, x.device).zero_().view(torch.float8_e4m3fn)
    scales = []
    for lo, hi in group_bounds(offs, x.shape[0]):
        part = x[lo:hi]
        amax = part.abs().amax(0) if hi > lo else x.new_zeros(x.shape[1])
        s = scales_from_amax(amax.float(), round_scales_to_power_of_2)
        data[lo:hi] = _to_e4m3(part.float() * s)
        scales.append(s)
    return data, torch.stack(scales) if scales else x.new_zeros(
        (0, x.shape[1]), dtype=torch.float32
    )


def per_group_rowwise_reference(
    x: torch.Tensor,
    offs: torch.Tensor,
    round_scales_to_power_of_2: bool = False,
    data_layout: str = "row_major",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loop over groups of columns: x (N, M), offs int32 [G] -> (e4m3 (N, M) in
    ``data_layout``, fp32 (G, N))."""
    swapped = "column_major" if data_layout == "row_major" else "row_major"
    if data_layout not in DATA_LAYOUTS:
        raise ValueError(f"data_layout must be one of {DATA_LAYOUTS}, got {data_layout!r}")
    data, scales = per_group_colwise_reference(x.t(), offs, round_scales_to_power_of_2, swapped)
    return data.t(), scales


def padded_length(m: int, n_groups: int) -> int:
    """The token axis of padded_token_reference's data: room for every group to start on a
    multiple of 16 and hold at least 16 tokens."""
    return (m + 15) // 16 * 16 + 16 * n_groups


def padded_token_reference(
    x: torch.Tensor, offs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K), groups of rows -> (e4m3 (K, cap) row-major: per_group_rowwise_reference of
    x.t() with each group's tokens moved to start on a multiple of 16, max(16, round_up(size,
    16)) wide, zeros between; its scales fp32 (G, K); the padded end offsets int32 [G], the
    last one cap = padded_length(M, G))."""
    m, k = x.shape
    cap = padded_length(m, offs.numel())
    data, scales = per_group_rowwise_reference(x.t(), offs)
    out = torch.zeros((k, cap), dtype=torch.uint8, device=x.device)
    ends, p = [], 0
    for lo, hi in group_bounds(offs, m):
        out[:, p : p + hi - lo] = data[:, lo:hi].view(torch.uint8)
        p += max(16, (hi - lo + 15) // 16 * 16)
        ends.append(p)
    if ends:
        ends[-1] = cap
    pad = torch.tensor(ends, dtype=torch.int32, device=x.device)
    return out.view(torch.float8_e4m3fn), scales, pad


def expert_column_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (E, K, N) -> (e4m3 (E, K, N), each expert column-major, strides (N*K, 1, K); scales
    fp32 (E, N)): per_group_colwise_reference of w.reshape(E*K, N) with groups of K rows."""
    e, k, n = w.shape
    offs = torch.arange(1, e + 1, dtype=torch.int32) * k
    data, scales = per_group_colwise_reference(w.reshape(e * k, n), offs)
    out = torch.empty((e, n, k), dtype=torch.uint8, device=w.device).transpose(1, 2)
    out.copy_(data.view(torch.uint8).view(e, k, n))
    return out.view(torch.float8_e4m3fn), scales
