"""torch._scaled_grouped_mm emulated on CPU (its meta checks, the checks of its CUDA source,
the product in fp32), as a custom op whose fake is torch's meta: what the grouped_mm tests
put in place of the GPU op to run the CUDA FP8 path on CPU tensors."""

from __future__ import annotations

import torch


def _meta(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs):
    """torch._scaled_grouped_mm on CPU: its meta checks (layouts, dtypes, scale shapes), the
    checks only its CUDA source has (16-element trailing dimensions, 16-byte data pointers,
    the device asserts on offsets), then the product in fp32 with ``(acc * sa) * sb``."""
    torch._scaled_grouped_mm(
        *map(_meta, (a, b, scale_a, scale_b)), offs=_meta(offs), out_dtype=torch.bfloat16
    )
    assert a.shape[-1] % 16 == 0 and b.shape[-2] % 16 == 0 and b.shape[-1] % 16 == 0
    assert a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
    ends = offs.tolist()
    bounds = list(zip([0] + ends[:-1], ends, strict=True))
    if b.dim() == 2:  # 2-D x 2-D: groups along the contraction axis
        k_dim, n_dim = a.shape[0], b.shape[1]
        out = torch.empty(len(ends), k_dim, n_dim)
        for e, (lo, hi) in enumerate(bounds):
            assert hi > lo, "a group must not be empty (asserted by torch <= 2.10 kernels)"
            assert e == len(ends) - 1 or (hi - lo) % 16 == 0, "TMA: 16-byte group starts"
            assert hi <= a.shape[1] and hi <= b.shape[0]
            acc = a[:, lo:hi].float() @ b[lo:hi].float()
            sa, sb = scale_a[e * k_dim : (e + 1) * k_dim], scale_b[e * n_dim : (e + 1) * n_dim]
            out[e] = acc * sa[:, None] * sb[None, :]
        return out.to(torch.bfloat16)
    out = torch.empty(a.shape[0], b.shape[2])
    for e, (lo, hi) in enumerate(bounds):
        assert 0 <= lo <= hi <= a.shape[0]
        out[lo:hi] = (a[lo:hi].float() @ b[e].float()) * scale_a[lo:hi, None] * scale_b[e][None]
    return out.to(torch.bfloat16)


@torch.library.custom_op("mxfp8_a2a_test::scaled_grouped_mm", mutates_args=())
def _emulated_op(
    a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    return emulated_scaled_grouped_mm(a, b, sa, sb, offs)


@_emulated_op.register_fake
def _(a, b, sa, sb, offs):
    return torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16)
