"""ExpertParallelMoE: a MoE layer on dispatch/combine (softmax top-k router, gelu expert MLPs).

A real layer, not only an example: the training script and the MoE benchmark build on it.
Its experts (:class:`GroupedExperts`, this rank's share only) run as two grouped GEMMs
(:func:`mxfp8_a2a.grouped_mm`) over the rows dispatch returns, with dispatch's end offsets on
the device. Each expert is drawn from its own generator (seed, global index), so every world
size builds the same model (tests compare against a single-process definition).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..exchange.push import PushBuffer, static_transport
from ..exchange.transport import Transport
from ..exchange.wires import Wires, layer_wires
from ..grouped.gemm import PRECISIONS
from .checkpoint import register_checkpoint_hooks
from .dispatch import combine, dispatch, dispatch_reporting
from .experts import GroupedExperts, draw_expert
from .static_dispatch import STAT_NAMES, capacity_for, combine_static, dispatch_static


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing: logits [T, E] -> (weights fp32 [T, k] summing to 1, ids [T, k])."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


class ExpertParallelMoE(torch.nn.Module):
    """A MoE layer with experts spread over the ranks of ``group`` (a ProcessGroup or a 1-D
    DeviceMesh; default: the world).

    Parameters: ``router`` [hidden, num_experts] (a Parameter; logits = x @ router, no bias),
    meant to be the same on every rank; ``experts`` (:class:`GroupedExperts`): this rank's
    L = num_experts / world experts only, gelu MLPs hidden -> ffn -> hidden, w1 [L, hidden,
    ffn] and w2 [L, ffn, hidden] (also reachable as ``layer.w1`` / ``layer.w2``). They are
    built on ``device`` in ``dtype`` (default fp32), in memory for the local experts only:
    expert e is drawn from a generator seeded by (``seed``, e), the router from ``seed``.

    Gradients are local: the router's from this rank's tokens, an expert's from every token
    routed to it by the group. Under data parallelism the experts must not be averaged with
    the other ranks' (different) experts: wrap the model with
    :func:`mxfp8_a2a.moe.prepare_ddp` before DistributedDataParallel, or shard ``experts`` on
    their own with FSDP2 (:func:`mxfp8_a2a.moe.shard_experts`); both make the update that of
    the mean loss over all ranks. Checkpoints: ``state_dict()`` presents ``experts.w1`` /
    ``experts.w2`` as DTensors [num_experts, ...] sharded over ``group`` (on this rank's
    experts' storage), so torch.distributed.checkpoint saves every expert and loads at any
    group size; :func:`mxfp8_a2a.moe.full_state_dict` and
    :func:`mxfp8_a2a.moe.load_full_state_dict` give plain full tensors (see
    :mod:`mxfp8_a2a.moe.checkpoint`).

    Forward: x [..., hidden] -> the same shape (leading dimensions flattened into tokens).
    ``exchange`` picks the wire of each leg of dispatch and combine (forward and backward):
    "mxfp8" (every leg MXFP8), "mxfp8_to_experts" (MXFP8 only toward the experts: dispatch
    forward and combine backward; bf16 back to the tokens), "bf16" (every leg unquantized,
    in the activations' dtype: fp32 activations travel as fp32), or a :class:`Wires` of four
    legs; wire bytes per preset in :mod:`mxfp8_a2a.exchange.wires`. ``transport`` how the
    MXFP8 exchanges move rows ("nccl" or a Transport object, see :func:`dispatch`; for the
    static dispatch "nccl", a :class:`mxfp8_a2a.PushBuffer` or "auto": with ``capacity``
    given, a PushBuffer of that capacity where :func:`mxfp8_a2a.static_transport`'s rule
    allows (sized for rows of ``dtype``; ``layer.transport.free()`` releases it), else NCCL;
    with ``capacity_factor``, NCCL).
    ``precision`` picks the experts' grouped GEMMs: "bf16" (unscaled, in the activations'
    dtype), "fp8_rowwise" (e4m3 operands with rowwise fp32 scales on sm_90+ GPUs, the
    plain-torch reference on CPU; hidden and ffn multiples of 16) or "fp8_rowwise_gw_hp" (the
    same with the weights' gradients unscaled in bf16; bf16 activations).

    ``capacity_factor`` or ``capacity`` (rows per rank pair) switches to the static dispatch
    (:func:`mxfp8_a2a.dispatch_static`): no host sync, fixed shapes, so the layer's forward
    and backward can be captured in one CUDA graph or compiled with fullgraph=True; rows
    past the capacity are dropped (its docstring gives the rule). ``capacity_factor`` sets
    ceil(factor * T * top_k / W) from the T of each call (every rank must then pass the
    same T). ``align``: rows per expert block rounded up to it. The buffer
    ``dispatch_stats`` (int64 [4], on the layer's device) accumulates the rows dropped, the
    largest capacity needed, the ids out of range and a num_experts that differs between
    ranks (STAT_NAMES), without a sync;
    ``mx.check_no_drops(layer.dispatch_stats, group)`` reads it where the caller chooses.
    """

    def __init__(
        self,
        hidden: int,
        ffn: int,
        num_experts: int,
        top_k: int,
        group: dist.ProcessGroup | DeviceMesh | None = None,
        *,
        exchange: str | Wires = "mxfp8",
        transport: str | Transport | PushBuffer = "nccl",
        precision: str = "bf16",
        seed: int = 0,
        capacity_factor: float | None = None,
        capacity: int | None = None,
        align: int = 16,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if isinstance(group, DeviceMesh):
            if group.ndim != 1:
                raise ValueError(
                    f"group: a DeviceMesh must be 1-D (the expert-parallel dimension, e.g. "
                    f"mesh['ep']), got {group.ndim}-D"
                )
            group = group.get_group()
        for name, value in (("hidden", hidden), ("ffn", ffn), ("num_experts", num_experts)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        wires = layer_wires(exchange)  # (a ValueError naming the presets)
        if wires.uses_mxfp8 and hidden % 32:
            raise ValueError(
                f"hidden ({hidden}) must be a multiple of 32 for an MXFP8 leg (exchange="
                f"{exchange!r}: one scale per 32 values); pad it or use exchange='bf16'"
            )
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
        if transport == "auto":  # (the rule; a collective when it builds a PushBuffer)
            transport = "nccl"
            if capacity is not None:
                transport = static_transport(group, hidden, num_experts, capacity=capacity,
                                             exchange=exchange, device=device,
                                             dtype=dtype or torch.float32)  # fmt: skip
        if self.static and not (transport == "nccl" or isinstance(transport, PushBuffer)):
            raise ValueError("the static dispatch (capacity_factor / capacity) takes transport "
                             "'nccl', 'auto' or a PushBuffer")  # fmt: skip
        if not self.static and isinstance(transport, PushBuffer):
            raise ValueError("a PushBuffer carries the static dispatch: pass capacity or "
                             "capacity_factor")  # fmt: skip
        self.capacity_factor, self.capacity, self.align = capacity_factor, capacity, align
        self.register_buffer("dispatch_stats", torch.zeros(len(STAT_NAMES), dtype=torch.int64,
                             device=device), persistent=False)  # fmt: skip
        self._exchange, self.wires, self.transport = exchange, wires, transport
        router = torch.empty(hidden, num_experts, device=device, dtype=dtype or torch.float32)
        if router.device.type != "meta":
            router.copy_(draw_router(hidden, num_experts, seed))
        self.router = torch.nn.Parameter(router)
        local = num_experts // world
        self.experts = GroupedExperts(hidden, ffn, rank * local, local, precision=precision,
                                      seed=seed, device=device, dtype=dtype)  # fmt: skip
        register_checkpoint_hooks(self)  # experts as DTensors [E, ...] in state_dict()

    @property
    def exchange(self) -> str | Wires:
        """The wires of dispatch and combine, as given (a preset name or a Wires); setting it
        switches every leg (``wires`` holds the four legs it stands for)."""
        return self._exchange

    @exchange.setter
    def exchange(self, value: str | Wires) -> None:
        wires = layer_wires(value)
        if wires.uses_mxfp8 and self.router.shape[0] % 32:
            raise ValueError(f"exchange={value!r} has an MXFP8 leg: hidden must be a multiple "
                             f"of 32, got {self.router.shape[0]}")  # fmt: skip
        self._exchange, self.wires = value, wires

    @property
    def precision(self) -> str:
        return self.experts.precision

    @precision.setter
    def precision(self, value: str) -> None:
        if value not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {value!r}")
        self.experts.precision = value

    @property
    def w1(self) -> torch.nn.Parameter:
        """This rank's experts' first weights [L, hidden, ffn] (``experts.w1``)."""
        return self.experts.w1

    @property
    def w2(self) -> torch.nn.Parameter:
        """This rank's experts' second weights [L, ffn, hidden] (``experts.w2``)."""
        return self.experts.w2

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
                x, None, self.num_experts, self.group, self.wires, self.transport, problem
            )
        weights, ids = route(x @ self.router.to(x.dtype), self.top_k)
        if self.static:
            return self._forward_static(x, weights, ids)
        ex, _, handle = dispatch(
            x, ids, self.num_experts, self.group, exchange=self.wires, transport=self.transport
        )
        return combine(self.experts(ex, handle.expert_offsets), weights, handle)

    def _forward_static(self, x, weights, ids) -> torch.Tensor:
        world = dist.get_world_size(self.group)
        cap = self.capacity
        if cap is None:
            cap = capacity_for(x.shape[0], self.top_k, world, self.capacity_factor)
        ex, offs, handle = dispatch_static(x, ids, self.num_experts, cap, self.group,
                                           exchange=self.wires, align=self.align,
                                           transport=self.transport)  # fmt: skip
        with torch.no_grad():  # dropped and bad ids add up, the other two are maxima
            s, new = self.dispatch_stats, handle.stats
            added, peak = s[0::2] + new[0::2], torch.maximum(s[1::2], new[1::2])
            s.copy_(torch.stack([added, peak], 1).view(-1))  # STAT_NAMES' order
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

    @contextlib.contextmanager
    def fp8_weight_reuse(self) -> Iterator[None]:
        """For the micro-batches of one optimizer step (gradient accumulation): inside the
        block, the FP8 precisions cast w1 and w2 to FP8 at their first use and reuse
        those casts (``fp8_rowwise_weights``, 2 bytes per weight element, held until the block
        ends) instead of casting them again in every forward and backward. The results are
        the same bits. Step the optimizer after the block: a weight changed in place inside
        it raises ValueError at the layer's next call, before its dispatch: on every rank for
        the host-synced dispatch (no rank is left waiting), on this rank for the static one
        (as for a bad x). Changes are seen through the weight's version counter, where torch
        has one; writes that bypass it, such as ``w.data.mul_()``, are not seen and leave the
        casts stale. Casts of each activation dtype are kept apart. No effect with
        precision="bf16", where the plain-torch reference runs (CPU, or torch without
        a scaled grouped GEMM), under torch.compile or under torch.inference_mode.

            with layer.fp8_weight_reuse():
                for batch in micro_batches:
                    loss_fn(layer(batch)).backward()
            optimizer.step()
        """
        hook = self.register_forward_pre_hook(_check_fp8_casts)
        try:
            with self.experts.fp8_weight_reuse():
                yield
        finally:
            hook.remove()


def _check_fp8_casts(layer: ExpertParallelMoE, args: tuple) -> None:
    """fp8_weight_reuse's check before a call's dispatch: stale casts raise on every rank
    (through dispatch, which the other ranks are in) or, for the static dispatch, here."""
    if torch.compiler.is_compiling() or (problem := layer.experts.stale_fp8_casts()) is None:
        return
    if layer.static:
        raise ValueError(problem)
    x = args[0] if args else None
    dispatch_reporting(
        x, None, layer.num_experts, layer.group, layer.wires, layer.transport, problem
    )


def draw_router(hidden: int, num_experts: int, seed: int) -> torch.Tensor:
    """The router of a layer built with ``seed``: fp32 [hidden, num_experts] on CPU."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(hidden, num_experts, generator=g) * hidden**-0.5


def init_moe_weights(hidden: int, ffn: int, num_experts: int, seed: int) -> dict[str, torch.Tensor]:
    """All experts' weights as one rank of a group of one builds them, fp32 on CPU: router
    [H, E], w1 [E, H, F], w2 [E, F, H] (the single-process definition tests compare to)."""
    experts = [draw_expert(hidden, ffn, seed, e) for e in range(num_experts)]
    return {
        "router": draw_router(hidden, num_experts, seed),
        "w1": torch.stack([w1 for w1, _ in experts]),
        "w2": torch.stack([w2 for _, w2 in experts]),
    }
