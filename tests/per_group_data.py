"""Shared inputs and checks of the per-group scaling tests (test_per_group_scales.py,
test_per_group_tiling.py): group offsets of several kinds, data with special values in
rows of many magnitudes, and the bit-for-bit comparison against the reference."""

from __future__ import annotations

import torch
from helpers import bits

LAYOUTS = ("row_major", "column_major")


def make_offsets(total: int, n_groups: int, g: torch.Generator, kind: str) -> torch.Tensor:
    """int32 group ends over ``total`` rows: "uneven", "with_empty" (several empty groups),
    "one_holds_all" (every group but the last empty) or "aligned" (multiples of 16)."""
    if kind == "one_holds_all":
        ends = [0] * (n_groups - 1) + [total]
    elif kind == "with_empty":
        cuts = sorted(torch.randint(0, total + 1, (n_groups - 1,), generator=g).tolist())
        cuts[: len(cuts) // 3] = [cuts[0]] * (len(cuts) // 3)  # several empty groups
        ends = cuts + [total]
    elif kind == "aligned":  # multiples of 16, as MoE token counts often are
        cuts = sorted(torch.randint(0, total // 16 + 1, (n_groups - 1,), generator=g).tolist())
        ends = [16 * c for c in cuts] + [total]
    else:  # uneven
        ends = sorted(torch.randint(0, total + 1, (n_groups - 1,), generator=g).tolist()) + [total]
    return torch.tensor(ends, dtype=torch.int32)


def make_input(shape, dtype, device, g):
    """Random rows of magnitudes 2^-20 .. 2^19 with NaN, +-inf, zeros, tiny, huge and
    subnormal values planted in the first rows."""
    x = torch.randn(shape, generator=g) * torch.exp2(
        torch.randint(-20, 20, (shape[0], 1), generator=g).float()
    )
    x[0, 0] = float("nan")
    x[1 % shape[0], 2] = float("inf")
    x[2 % shape[0], :] = 0.0
    x[3 % shape[0], 5:9] = 1e-13
    x[4 % shape[0], 3] = -float("inf")  # in a row without NaN: -inf * 0 scale is NaN
    x[5 % shape[0], 6] = 3e38  # huge
    x[6 % shape[0], 7] = 1e-40  # fp32 subnormal (bf16 keeps it)
    return x.to(dtype).to(device)


def assert_same(got, want):
    """Same bits, shape and memory layout (strides) of the data; same scales."""
    (dg, sg), (dw, sw) = got, want
    assert dg.shape == dw.shape and dg.stride() == dw.stride(), (dg.stride(), dw.stride())
    assert torch.equal(bits(dg), bits(dw))
    torch.testing.assert_close(sg, sw, rtol=0, atol=0, equal_nan=True)  # NaN's sign is free
