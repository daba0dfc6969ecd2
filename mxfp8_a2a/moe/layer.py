"""ExpertParallelMoE: a MoE layer on dispatch/combine (softmax top-k router, gelu expert MLPs).

A real layer, not only an example: the training script and the MoE benchmark build on it.
Its experts run as two grouped GEMMs (:func:`mxfp8_a2a.grouped_mm`) over the rows dispatch
returns, with dispatch's end offsets on the device (no per-expert host list; on CUDA with
bf16 activations or precision="fp8_rowwise" nothing reads them on the host). Its weights are
drawn for all experts from one seed and sliced, so every world size builds the same model
(tests compare against a single-process definition).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from ..exchange.transport import Transport
from ..grouped import gemm as grouped_mm_module
from ..grouped.fp8_rowwise import Fp8Weights, fp8_rowwise_weights
from ..grouped.gemm import PRECISIONS, grouped_mm
from .dispatch import EXCHANGES, combine, dispatch, dispatch_reporting
from .static_dispatch import STAT_NAMES, capacity_for, combine_static, dispatch_static


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing: logits [T, E] -> (weights fp32 [T, k] summing to 1, ids [T, k])."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


class ExpertParallelMoE(torch.nn.Module):
    """A MoE layer with experts spread over the ranks of ``group``.

    router: a Parameter [hidden, num_experts] (logits = x @ router, no bias), the same on
    every rank (its gradient is this rank's tokens' only: sum it over the ranks); experts:
    this rank's L = num_experts / world experts, gelu MLPs hidden -> ffn -> hidden, weights
    w1 [L, hidden, ffn] and w2 [L, ffn, hidden]. Forward: x [..., hidden] -> the same shape
    (leading dimensions flattened into tokens). ``exchange`` picks "mxfp8"
    or "bf16" for dispatch and combine, ``transport`` how the MXFP8 exchanges move rows
    ("nccl" or a Transport object, see :func:`dispatch`). ``precision`` picks the experts'
    grouped GEMMs: "bf16" (unscaled, in the activations' dtype), "fp8_rowwise" (e4m3
    operands with rowwise fp32 scales on sm_90+ GPUs, the plain-torch reference on CPU;
    hidden and ffn multiples of 16) or "fp8_rowwise_gw_hp" (the same with the weights'
    gradients unscaled in bf16; bf16 activations); see :func:`mxfp8_a2a.grouped_mm`.
    Parameters are drawn from ``seed`` for all experts and sliced, so every world size builds
    the same model.

    ``capacity_factor`` or ``capacity`` (rows per rank pair) switches to the static dispatch
    (:func:`mxfp8_a2a.dispatch_static`): no host sync, fixed shapes, so the layer's forward
    and backward can be captured in one CUDA graph or compiled with fullgraph=True; rows
    past the capacity are dropped (its docstring gives the rule). ``capacity_factor`` sets
    ceil(factor * T * top_k / W) from the T of each call (every rank must then pass the
    same T). ``align``: rows per expert block rounded up to it. The buffer
    ``dispatch_stats`` (int64 [3], on the layer's device) accumulates the rows dropped, the
    largest capacity needed and the ids out of range, without a sync;
    ``mx.check_no_drops(layer.dispatch_stats, group)`` reads it where the caller chooses.
    """

    def __init__(
        self,
        hidden: int,
        ffn: int,
        num_experts: int,
        top_k: int,
        group: dist.ProcessGroup | None = None,
        *,
        exchange: str = "mxfp8",
        transport: str | Transport = "nccl",
        precision: str = "bf16",
        seed: int = 0,
        capacity_factor: float | None = None,
        capacity: int | None = None,
        align: int = 16,
    ):
        super().__init__()
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
        if type(top_k) is not int or not 0 <= top_k <= num_experts:
            raise ValueError(
                f"top_k must be an int in [0, num_experts={num_experts}], got {top_k!r}"
            )
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if precision != "bf16" and (hidden % 16 or ffn % 16):
            raise ValueError(
                f"precision={precision!r} needs hidden and ffn multiples of 16, got {hidden} "
                f"and {ffn}"
            )
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if num_experts % world:
            raise ValueError(
                f"num_experts ({num_experts}) must be a multiple of the group size ({world})"
            )
        self.num_experts, self.top_k, self.group = num_experts, top_k, group
        self.static = capacity_factor is not None or capacity is not None
        if capacity_factor is not None and capacity is not None:
            raise ValueError("pass capacity_factor or capacity, not both")
        if capacity_factor is not None:
            capacity_for(1, 1, 1, capacity_factor)  # its check of the factor
        if capacity is not None and (type(capacity) is not int or capacity < 0):
            raise ValueError(f"capacity must be an int >= 0 (rows per rank pair), got {capacity!r}")
        if self.static and not (isinstance(transport, str) and transport == "nccl"):
            raise ValueError("the static dispatch (capacity_factor / capacity) runs over NCCL/gloo "
                             "only: leave transport='nccl'")  # fmt: skip
        self.capacity_factor, self.capacity, self.align = capacity_factor, capacity, align
        self.register_buffer("dispatch_stats", torch.zeros(len(STAT_NAMES), dtype=torch.int64),
                             persistent=False)  # fmt: skip
        self.exchange, self.precision = exchange, precision
        full = init_moe_weights(hidden, ffn, num_experts, seed)
        local = slice(rank * num_experts // world, (rank + 1) * num_experts // world)
        self.transport = transport
        self.router = torch.nn.Parameter(full["router"])
        self.w1 = torch.nn.Parameter(full["w1"][local].clone())
        self.w2 = torch.nn.Parameter(full["w2"][local].clone())
        self._fp8_weights: dict[tuple, tuple[tuple, Fp8Weights]] | None = None  # fp8_weight_reuse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] (floating, on the parameters' device) -> the same shape in x's
        dtype. An x that is not raises a ValueError: on every rank (from dispatch) for the
        host-synced dispatch, on this rank for the static one."""
        if isinstance(x, torch.Tensor) and x.dim() > 2:  # [batch, seq, hidden] and the like
            return self.forward(x.reshape(-1, x.shape[-1])).view(x.shape)
        problem = self._input_error(x)
        if problem is not None and self.static:  # (no sync to tell the other ranks)
            raise ValueError(problem)
        if problem is not None:  # no routing: dispatch tells every rank, then raises
            dispatch_reporting(
                x, None, self.num_experts, self.group, self.exchange, self.transport, problem
            )
        weights, ids = route(x @ self.router.to(x.dtype), self.top_k)
        if self.static:
            return self._forward_static(x, weights, ids)
        ex, _, handle = dispatch(
            x, ids, self.num_experts, self.group, exchange=self.exchange, transport=self.transport
        )
        return combine(self.experts(ex, handle.expert_offsets), weights, handle)

    def _forward_static(self, x, weights, ids) -> torch.Tensor:
        world = dist.get_world_size(self.group)
        cap = self.capacity
        if cap is None:
            cap = capacity_for(x.shape[0], self.top_k, world, self.capacity_factor)
        ex, offs, handle = dispatch_static(
            x, ids, self.num_experts, cap, self.group, exchange=self.exchange, align=self.align
        )
        with torch.no_grad():  # dropped and bad ids add up, the capacity needed is a max
            s, new = self.dispatch_stats, handle.stats
            s.copy_(torch.stack([s[0] + new[0], torch.maximum(s[1], new[1]), s[2] + new[2]]))
        return combine_static(self.experts(ex, offs), weights, handle)

    def _input_error(self, x) -> str | None:
        hidden = self.router.shape[0]
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != hidden:
            return f"x must be a [tokens, {hidden}] tensor, got {getattr(x, 'shape', type(x))}"
        if not x.dtype.is_floating_point:
            return f"x must be a floating tensor, got {x.dtype}"
        if x.device != self.router.device:
            return f"x is on {x.device}, the layer's parameters on {self.router.device}; move x"
        return None

    def experts(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """This rank's experts on x [N, hidden], rows grouped by local expert with end offsets
        ``offs`` (int32 [L] on x's device): gelu(x @ w1[e]) @ w2[e], in x's dtype."""
        w1, w2 = self.w1.to(x.dtype), self.w2.to(x.dtype)
        h = grouped_mm(x, w1, offs, precision=self.precision, fp8_weights=self._reused("w1", w1))
        h = torch.nn.functional.gelu(h)
        return grouped_mm(h, w2, offs, precision=self.precision, fp8_weights=self._reused("w2", w2))

    @contextlib.contextmanager
    def fp8_weight_reuse(self) -> Iterator[None]:
        """For the micro-batches of one optimizer step (gradient accumulation): inside the
        block, the FP8 precisions cast w1 and w2 to FP8 at their first use and reuse
        those casts (``fp8_rowwise_weights``, 2 bytes per weight element, held until the block
        ends) instead of casting them again in every forward and backward. The results are
        the same bits. Step the optimizer after the block: a weight changed in place inside
        it raises ValueError at its next use (seen through its version counter, where torch
        has one; writes that bypass it, such as ``w.data.mul_()``, are not seen and leave the
        casts stale). Casts of each activation dtype are kept apart. No effect with
        precision="bf16", where the plain-torch reference runs (CPU, or torch without
        _scaled_grouped_mm), under torch.compile or under torch.inference_mode.

            with layer.fp8_weight_reuse():
                for batch in micro_batches:
                    loss_fn(layer(batch)).backward()
            optimizer.step()
        """
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
        param = getattr(self, name)
        # torch's in-place counter (not public API; without it, only storage changes show)
        seen = (param.data_ptr(), getattr(param, "_version", None))
        key = (name, w.dtype, w.device)
        if key not in self._fp8_weights:
            self._fp8_weights[key] = seen, fp8_rowwise_weights(w)
        was, fp8 = self._fp8_weights[key]
        if was != seen:
            raise ValueError(
                f"ExpertParallelMoE: {name} changed (in place, or its storage) inside "
                f"fp8_weight_reuse(), so its FP8 casts would be stale; step the optimizer after "
                f"the block, not inside it"
            )
        return fp8


def init_moe_weights(hidden: int, ffn: int, num_experts: int, seed: int) -> dict[str, torch.Tensor]:
    """All experts' weights, fp32 on CPU: router [H, E], w1 [E, H, F], w2 [E, F, H]."""
    g = torch.Generator().manual_seed(seed)
    return {
        "router": torch.randn(hidden, num_experts, generator=g) * hidden**-0.5,
        "w1": torch.randn(num_experts, hidden, ffn, generator=g) * hidden**-0.5,
        "w2": torch.randn(num_experts, ffn, hidden, generator=g) * ffn**-0.5,
    }
