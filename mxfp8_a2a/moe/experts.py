"""GroupedExperts: one rank's share of a MoE layer's experts, as their own module.

Its own module so that data parallelism can treat the experts apart from the rest of a
model (they differ between the ranks of the expert-parallel group; see
:mod:`mxfp8_a2a.moe.parallel`). Each expert is drawn from a generator seeded by the layer's
seed and its global index, so a rank builds only its experts, in the requested device and
dtype, and every expert-parallel size builds the same model.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch

from ..grouped import gemm as grouped_mm_module
from ..grouped.fp8_rowwise import Fp8Weights, fp8_rowwise_weights
from ..grouped.gemm import grouped_mm


def expert_generator(seed: int, index: int) -> torch.Generator:
    """The CPU generator of expert ``index`` (global) of a layer built with ``seed``."""
    if not 0 <= seed < 2**31:
        raise ValueError(f"seed must be in [0, 2**31), got {seed}")
    # a CPU generator keeps only the low 32 bits of its seed: a hash of both mixes them in
    digest = hashlib.blake2b(f"expert {seed} {index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


ACTIVATIONS = ("gelu", "swiglu")


def draw_expert(
    hidden: int, ffn: int, seed: int, index: int, activation: str = "gelu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``index``'s weights, fp32 on CPU: w1 [hidden, ffn] ("gelu") or [hidden, 2 * ffn]
    ("swiglu": the gate's columns, then the up projection's, drawn after w2), w2 [ffn, hidden]."""
    g = expert_generator(seed, index)
    w1 = torch.randn(hidden, ffn, generator=g) * hidden**-0.5
    w2 = torch.randn(ffn, hidden, generator=g) * ffn**-0.5
    if activation == "swiglu":
        w1 = torch.cat([w1, torch.randn(hidden, ffn, generator=g) * hidden**-0.5], 1)
    return w1, w2


class GroupedExperts(torch.nn.Module):
    """Experts ``first`` .. ``first + count - 1`` of a layer: MLPs hidden -> ffn -> hidden,
    ``activation`` "gelu" (gelu(x @ w1) @ w2, w1 [count, hidden, ffn]) or "swiglu"
    ((silu(x @ w1[:, :, :ffn]) * (x @ w1[:, :, ffn:])) @ w2, w1 [count, hidden, 2 * ffn]:
    gate and up projection in one GEMM), w2 [count, ffn, hidden] (Parameters on ``device``
    in ``dtype``, default fp32). ``precision`` picks the grouped GEMMs (see
    :func:`mxfp8_a2a.grouped_mm`). On device "meta" nothing is drawn."""

    def __init__(
        self,
        hidden: int,
        ffn: int,
        first: int,
        count: int,
        *,
        precision: str = "bf16",
        activation: str = "gelu",
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.first, self.precision, self.activation = first, precision, activation
        kw = {"device": device, "dtype": dtype or torch.float32}
        width = 2 * ffn if activation == "swiglu" else ffn
        self.w1 = torch.nn.Parameter(torch.empty(count, hidden, width, **kw))
        self.w2 = torch.nn.Parameter(torch.empty(count, ffn, hidden, **kw))
        if self.w1.device.type != "meta":
            with torch.no_grad():
                for i in range(count):  # one expert's fp32 draw at a time on the host
                    w1, w2 = draw_expert(hidden, ffn, seed, first + i, activation)
                    self.w1[i].copy_(w1)
                    self.w2[i].copy_(w2)
        self._fp8_weights: dict[tuple, tuple[tuple, Fp8Weights]] | None = None
        # set by data parallelism (mxfp8_a2a.moe.parallel): the weights' gradient times this
        self.grad_scale = 1.0

    def extra_repr(self) -> str:
        count, ffn, hidden = self.w2.shape
        return (f"experts {self.first}..{self.first + count - 1}, {hidden} -> {ffn} -> {hidden}, "
                f"{self.activation}")  # fmt: skip

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """x [N, hidden], rows grouped by local expert with end offsets ``offs`` (int32
        [count] on x's device; rows past offs[-1] give zeros) -> act(x @ w1[e]) @ w2[e]
        [N, hidden] in x's dtype (act: gelu, or swiglu of the two halves)."""
        w1, w2 = self.w1, self.w2
        if self.grad_scale != 1.0:
            w1, w2 = _ScaleGrad.apply(w1, self.grad_scale), _ScaleGrad.apply(w2, self.grad_scale)
        w1, w2 = w1.to(x.dtype), w2.to(x.dtype)
        h = grouped_mm(x, w1, offs, precision=self.precision, fp8_weights=self._reused("w1", w1))
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = torch.nn.functional.silu(gate) * up
        else:
            h = torch.nn.functional.gelu(h)
        return grouped_mm(h, w2, offs, precision=self.precision, fp8_weights=self._reused("w2", w2))

    @contextlib.contextmanager
    def fp8_weight_reuse(self) -> Iterator[None]:
        """See :meth:`ExpertParallelMoE.fp8_weight_reuse`."""
        if self._fp8_weights is not None:
            raise RuntimeError("ExpertParallelMoE.fp8_weight_reuse() is already active")
        self._fp8_weights = {}
        try:
            yield
        finally:
            self._fp8_weights = None

    def _reused(self, name: str, w: torch.Tensor) -> Fp8Weights | None:
        """The block's FP8 casts of parameter ``name`` (w: it in the activations' dtype)."""
        if torch.compiler.is_compiling():  # first: no guard on the block's state
            return None
        if self._fp8_weights is None or torch.is_inference_mode_enabled():
            return None  # (casts made in inference mode could not be saved for backward)
        if grouped_mm_module.gemm_path(w, self.precision) != "scaled":
            return None
        key = (name, w.dtype, w.device)
        if key not in self._fp8_weights:
            self._fp8_weights[key] = self._seen(name), fp8_rowwise_weights(w)
        if (problem := self.stale_fp8_casts()) is not None:
            raise ValueError(problem)
        return self._fp8_weights[key][1]

    def _seen(self, name: str) -> tuple:
        param = getattr(self, name)
        # torch's in-place counter (not public API; without it, only storage changes show)
        return param.data_ptr(), getattr(param, "_version", None)

    def stale_fp8_casts(self) -> str | None:
        """What is wrong with fp8_weight_reuse's casts (a weight changed since its cast), or
        None. Host-only: ExpertParallelMoE asks before its dispatch."""
        for (name, *_), (seen, _) in (self._fp8_weights or {}).items():
            if seen != self._seen(name):
                return (
                    f"ExpertParallelMoE: {name} changed (in place, or its storage) inside "
                    f"fp8_weight_reuse(), so its FP8 casts would be stale; step the optimizer "
                    f"after the block, not inside it"
                )
        return None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward (a view), gradient times ``scale``."""

    @staticmethod
    def forward(ctx, w, scale):
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def draw_router(hidden: int, num_experts: int, seed: int) -> torch.Tensor:
    """The router of a layer built with ``seed``: fp32 [hidden, num_experts] on CPU."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(hidden, num_experts, generator=g) * hidden**-0.5


def init_moe_weights(
    hidden: int, ffn: int, num_experts: int, seed: int, activation: str = "gelu"
) -> dict[str, torch.Tensor]:
    """All experts' weights as one rank of a group of one builds them, fp32 on CPU: router
    [H, E], w1 [E, H, F] (swiglu: [E, H, 2F]), w2 [E, F, H] (the single-process definition
    tests compare to)."""
    experts = [draw_expert(hidden, ffn, seed, e, activation) for e in range(num_experts)]
    return {
        "router": draw_router(hidden, num_experts, seed),
        "w1": torch.stack([w1 for w1, _ in experts]),
        "w2": torch.stack([w2 for _, w2 in experts]),
    }
