"""ExpertParallelMoE: a MoE layer on dispatch/combine (softmax top-k router, gelu or SwiGLU MLPs).

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
from . import checks, overlap
from .checkpoint import register_checkpoint_hooks
from .dispatch_static import STAT_NAMES
from .dispatch_synced import dispatch_reporting
from .experts import GroupedExperts, draw_router, init_moe_weights  # noqa: F401
from .routing import _route, balance_loss, groups_error, update_bias
from .topology import NodeTopology, layer_topology


class ExpertParallelMoE(torch.nn.Module):
    """A MoE layer with experts spread over the ranks of a group: a softmax top-k router,
    dispatch to the experts' ranks, gelu or SwiGLU expert MLPs as grouped GEMMs, combine.

    Parameters: ``router`` [hidden, num_experts] (a Parameter; logits = x @ router, no bias),
    the same on every rank; ``experts`` (:class:`GroupedExperts`): this rank's
    L = num_experts / world experts only, gelu or SwiGLU MLPs hidden -> ffn -> hidden, w1 [L,
    hidden, ffn] (SwiGLU: [L, hidden, 2 * ffn]) and w2 [L, ffn, hidden] (also ``layer.w1`` /
    ``layer.w2``).

    Forward: x [..., hidden] -> the same shape (leading dimensions flattened into tokens).
    The constructor's documentation (``help(ExpertParallelMoE.__init__)``) lists every
    argument; :meth:`read_dispatch_stats` and :meth:`reset_dispatch_stats` read and clear
    the static dispatch's drop counts.
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
        activation: str = "gelu",
        balance_bias: bool = False,
        route_groups: tuple[int, int] | None = None,
        topology: NodeTopology | str | None = "auto",
        seed: int | None = None,
        capacity_factor: float | None = None,
        capacity: int | None = None,
        max_tokens: int | None = None,
        align: int = 16,
        shared_ffn: int | torch.nn.Module | None = None,
        overlap_chunks: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        """Build the router and this rank's experts (on ``device`` in ``dtype``, default
        fp32; in memory for the local experts only).

        Args:
            hidden, ffn: the model and expert MLP widths (ints >= 1; hidden a multiple of
                32 for any MXFP8 leg; both multiples of 16 for the FP8 precisions).
            num_experts: total experts, a multiple of the group size; top_k: experts per
                token, in [0, num_experts].
            group: a ProcessGroup or a 1-D DeviceMesh (e.g. mesh["ep"]); default the world.
            exchange: the wire of each leg of dispatch and combine (forward and backward):
                "mxfp8" (every leg MXFP8), "mxfp8_to_experts" (MXFP8 only toward the
                experts: dispatch forward and combine backward; unquantized back to the
                tokens), "bf16" (every leg unquantized, in the activations' dtype: fp32
                activations travel as fp32), or a :class:`mxfp8_a2a.Wires` of four legs;
                wire bytes per preset in :mod:`mxfp8_a2a.exchange.wires`. Default "mxfp8":
                the fewest bytes, and held-out loss within 0.5% of "bf16" on every seed of
                a 110M-parameter MoE language model (BENCHMARKS.md, 2026-12-05).
            transport: how the MXFP8 exchanges move rows: "nccl" or a Transport object (see
                :func:`mxfp8_a2a.dispatch`); for the static dispatch "nccl", a
                :class:`mxfp8_a2a.PushBuffer` or "auto" (a PushBuffer of the layer's
                capacity where :func:`mxfp8_a2a.static_transport`'s rule allows, sized for
                rows of ``dtype``, else NCCL; ``layer.transport.free()`` releases it).
            precision: the experts' grouped GEMMs: "bf16" (unscaled, in the activations'
                dtype), "fp8_rowwise" (e4m3 operands with rowwise fp32 scales on sm_90+
                GPUs, the plain-torch reference on CPU) or "fp8_rowwise_gw_hp" (the same
                with the weights' gradients unscaled in bf16; bf16 activations).
            activation: the experts' MLP: "gelu" (w1 [L, hidden, ffn]) or "swiglu"
                (silu(gate) * up, w1 [L, hidden, 2 * ffn] holding gate then up; what
                current MoE models use).
            balance_bias: DeepSeek-V3's balancing without an auxiliary loss: a buffer
                ``expert_bias`` fp32 [num_experts] (in the state dict) is added to the router
                probabilities to choose the experts (the weights stay the probabilities);
                ``expert_load`` counts the rows routed to each expert; call
                :meth:`update_balance_bias` after each optimizer step.
            route_groups: (G, M): node-limited routing; the experts form G contiguous
                groups (G = the nodes: experts sit on the ranks in order) and each token
                picks its experts within its M best groups (DeepSeek-V3); None: any.
            topology: a :class:`mxfp8_a2a.NodeTopology` of ``group``: each token sent once
                per node (:func:`mxfp8_a2a.dispatch`, :func:`mxfp8_a2a.dispatch_static`).
                "auto": torchrun's nodes when the group spans several (one NodeTopology per
                group, shared by the layers), else None (flat; also with a PushBuffer).
            seed: expert e is drawn from a generator seeded by (seed, e), the router from
                seed, so a given seed builds the same model at every group size. None (the
                default): the seed is drawn from torch's default generator, so
                ``torch.manual_seed(s)`` governs the model and two layers built one after
                the other differ. Every rank must build the same router: call
                ``torch.manual_seed(s)`` with the same s on every rank before building (or
                pass the same seed); the first forward raises on every rank if the routers
                differ. Data-parallel replicas of the experts are made equal by
                :func:`mxfp8_a2a.prepare_ddp` / :func:`mxfp8_a2a.shard_experts` (a broadcast).
            capacity_factor, capacity, max_tokens: ``capacity_factor`` (with
                ``max_tokens``) or ``capacity`` switches to the static dispatch
                (:func:`mxfp8_a2a.dispatch_static`): no host sync, fixed shapes, so forward
                and backward can be captured in one CUDA graph or compiled with
                fullgraph=True; rows past the capacity (rows per rank pair) are dropped.
                ``capacity_factor`` needs ``max_tokens`` (the most tokens any rank passes
                in one call): capacity = capacity_for(max_tokens, top_k, W, factor), the
                same on every rank whatever each rank's batch. With ``capacity``,
                ``max_tokens`` is optional. A call with more than max_tokens tokens raises a
                ValueError. Ranks may pass different numbers of tokens.
            align: the static dispatch's rows per expert block are rounded up to it.
            shared_ffn: shared experts (DeepSeek-V3): a dense MLP on every token whose
                output is added to the layer's: an int (the width of a built-in MLP of
                ``activation``, ``layer.shared``, drawn from ``seed``) or an nn.Module [T,
                hidden] -> [T, hidden]; dense parameters (replicated, averaged by data
                parallelism). On CUDA it computes while dispatch and combine run on an
                exchange stream (:mod:`mxfp8_a2a.moe.overlap`). None: none.
            overlap_chunks: n >= 1: the tokens in n chunks, chunk i + 1's dispatch and chunk
                i's combine running while experts compute (on CUDA). The static dispatch
                gives each chunk ceil(capacity / n) rows per rank pair. Not with a PushBuffer.
            device, dtype: of the parameters.

        Checks at construction: everything the host knows (types, sizes, hidden % 32 for
        MXFP8, the precision's multiples). At the first forward of a layer on a group of
        more than one rank (eager, not under CUDA graph capture; once per layer), one
        small all_gather checks on every rank that the ranks built the same configuration
        and router and hold different experts (a data-parallel wrapper that broadcast or
        averaged them, i.e. DistributedDataParallel without :func:`mxfp8_a2a.prepare_ddp`,
        or fully_shard without :func:`mxfp8_a2a.shard_experts`), raising the same error on
        every rank. A layer only ever called compiled skips it: run one eager forward first.

        Gradients are local: the router's from this rank's tokens, an expert's from every
        token routed to it by the group. Under data parallelism the experts must not be
        averaged with the other ranks' (different) experts: call
        :func:`mxfp8_a2a.prepare_ddp` on the model before DistributedDataParallel, or
        :func:`mxfp8_a2a.shard_experts` before fully_shard. Checkpoints: ``state_dict()``
        presents ``experts.w1`` / ``experts.w2`` as DTensors [num_experts, ...] sharded
        over ``group`` (on this rank's experts' storage), so torch.distributed.checkpoint
        saves every expert and loads at any group size; :func:`mxfp8_a2a.full_state_dict`
        and :func:`mxfp8_a2a.load_full_state_dict` give plain full tensors (see
        :mod:`mxfp8_a2a.moe.checkpoint`).

        Static dispatch statistics: the buffer ``dispatch_stats`` (int64 [4], on the
        layer's device, not synced) accumulates, in :data:`mxfp8_a2a.STAT_NAMES`' order,
        the rows dropped, the largest capacity needed, the ids out of range and a
        num_experts that differs between ranks; :meth:`read_dispatch_stats` reads it as a
        dict, :meth:`reset_dispatch_stats` zeroes it and
        ``mx.check_no_drops(layer.dispatch_stats, group)`` raises on every rank on drops.
        """
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "ExpertParallelMoE needs torch.distributed: call "
                "torch.distributed.init_process_group() first (under torchrun, or in one process "
                "with backend='gloo', world_size=1, rank=0 and an init_method)"
            )
        group = checks.mesh_group(group)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        capacity = checks.check_construction(
            hidden, ffn, num_experts, top_k, world, exchange, precision, capacity_factor,
            capacity, max_tokens, align,
        )  # fmt: skip
        wires = layer_wires(exchange)
        if seed is None:  # torch's default generator decides (torch.manual_seed)
            seed = int(torch.randint(0, 2**31, (1,)).item())
        elif type(seed) is not int or not 0 <= seed < 2**31:
            raise ValueError(f"seed must be in [0, 2**31) or None, got {seed!r}")
        self.num_experts, self.top_k, self.group = num_experts, top_k, group
        self.static = capacity is not None
        self._routing: tuple[torch.Tensor, torch.Tensor] | None = None  # the last forward's
        overlap.check_chunks(overlap_chunks, transport)
        if transport == "auto":  # (the rule; a collective when it builds a PushBuffer)
            transport = "nccl"
            if capacity is not None and overlap_chunks == 1:
                transport = static_transport(group, hidden, num_experts, capacity=capacity,
                                             exchange=exchange, device=device,
                                             dtype=dtype or torch.float32)  # fmt: skip
        if self.static and not (transport == "nccl" or isinstance(transport, PushBuffer)):
            raise ValueError("the static dispatch (capacity_factor / capacity) takes transport "
                             "'nccl', 'auto' or a PushBuffer")  # fmt: skip
        if not self.static and isinstance(transport, PushBuffer):
            raise ValueError("a PushBuffer carries the static dispatch: pass capacity or "
                             "capacity_factor with max_tokens")  # fmt: skip
        self.capacity_factor, self.capacity, self.align = capacity_factor, capacity, align
        self.max_tokens, self.seed, self._checked = max_tokens, seed, False
        self.register_buffer("dispatch_stats", torch.zeros(len(STAT_NAMES), dtype=torch.int64,
                             device=device), persistent=False)  # fmt: skip
        if (problem := groups_error(route_groups, num_experts, top_k)) is not None:
            raise ValueError(problem)
        self.route_groups = route_groups
        if balance_bias:
            zeros = lambda: torch.zeros(num_experts, device=device)  # noqa: E731
            self.register_buffer("expert_bias", zeros())
            self.register_buffer("expert_load", zeros(), persistent=False)
        else:
            self.expert_bias = self.expert_load = None
        self._exchange, self.wires, self.transport = exchange, wires, transport
        self.topology = layer_topology(topology, group, isinstance(transport, PushBuffer))
        router = torch.empty(hidden, num_experts, device=device, dtype=dtype or torch.float32)
        if router.device.type != "meta":
            router.copy_(draw_router(hidden, num_experts, seed))
        self.router = torch.nn.Parameter(router)
        local = num_experts // world
        self.experts = GroupedExperts(hidden, ffn, rank * local, local, precision=precision,
                                      activation=activation, seed=seed, device=device,
                                      dtype=dtype)  # fmt: skip
        self.shared = overlap.build_shared(shared_ffn, hidden, activation, seed, device, dtype)
        self.overlap_chunks, self.overlap_streams = overlap_chunks, True  # (False: one stream)
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
            raise ValueError(f"hidden={self.router.shape[0]}: exchange={value!r} sends MXFP8 "
                             "blocks of 32 values; pass exchange='bf16'")  # fmt: skip
        self._exchange, self.wires = value, wires

    def extra_repr(self) -> str:
        hidden, ffn = self.router.shape[0], self.experts.w1.shape[-1]
        mode = "synced"
        if self.static:
            mode = f"static, capacity={self.capacity}, max_tokens={self.max_tokens}"
            if self.capacity_factor is not None:
                mode += f", capacity_factor={self.capacity_factor}"
        return (
            f"hidden={hidden}, ffn={ffn}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"group_size={dist.get_world_size(self.group)}, exchange={self.exchange!r}, "
            f"dispatch=({mode}), transport={self.transport!r}, precision={self.precision!r}, "
            f"overlap_chunks={self.overlap_chunks}"
        )

    def read_dispatch_stats(self) -> dict[str, int]:
        """This rank's ``dispatch_stats`` as {name: value} in STAT_NAMES' order (a host
        sync; no collective): dropped, needed_capacity, invalid_ids, num_experts_differs."""
        return dict(zip(STAT_NAMES, self.dispatch_stats.tolist(), strict=True))

    def reset_dispatch_stats(self) -> None:
        """Zero ``dispatch_stats`` in place (no sync; safe inside a captured CUDA graph)."""
        with torch.no_grad():
            self.dispatch_stats.zero_()

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

    def update_balance_bias(self, rate: float = 1e-3) -> None:
        """With ``balance_bias=True``: move ``expert_bias`` one step toward balance from the
        rows counted since the last call, summed over the layer's group (one all_reduce, no
        host sync; every rank must call it), and restart the count."""
        if self.expert_bias is None:
            raise RuntimeError("update_balance_bias() needs ExpertParallelMoE(balance_bias=True)")
        update_bias(self.expert_bias, self.expert_load, rate, self.group)

    def balance_loss(self) -> torch.Tensor:
        """The load-balancing loss of this rank's tokens in the last forward (fp32 scalar,
        differentiable in ``router``; 1 when balanced): :func:`balance_loss` of the router's
        probabilities [T, E] and the chosen ids [T, k]. Add ``coef * layer.balance_loss()``
        to the loss before backward; computed only when called (a few small kernels)."""
        if self._routing is None:
            raise RuntimeError(
                "balance_loss() reads the last forward's routing: call the layer first"
            )
        return balance_loss(*self._routing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] (floating, on the parameters' device; bf16 or fp32 for an MXFP8 leg;
        at most max_tokens tokens) -> the same shape in x's dtype. An x that is not raises a
        ValueError on every rank for the host-synced dispatch (from dispatch) and at the
        first forward; later, for the static dispatch, on this rank only unless validating
        (mxfp8_a2a.dispatch_static's validate, MXFP8_A2A_VALIDATE=1)."""
        if isinstance(x, torch.Tensor) and x.dim() > 2:  # [batch, seq, hidden] and the like
            return self.forward(x.reshape(-1, x.shape[-1])).view(x.shape)
        problem = self._input_error(x)
        if checks.first_forward_due(self):  # (once; the same error on every rank)
            checks.first_forward_check(self, x, problem)
        if problem is not None and self.static:  # (every rank hears of it where they agree)
            push = self.transport if isinstance(self.transport, PushBuffer) else None
            checks.report(problem, self.group, push)
        if problem is not None:  # no routing: dispatch tells every rank, then raises
            dispatch_reporting(
                x, None, self.num_experts, self.group, self.wires, self.transport, problem
            )
        logits = x @ self.router.to(x.dtype)
        weights, ids, probs = _route(logits, self.top_k, self.expert_bias, self.route_groups)
        self._routing = (probs, ids)  # for balance_loss(): references, no work until read
        if self.expert_load is not None and torch.is_grad_enabled():  # (training steps)
            with torch.no_grad():  # (no bincount: it reads the largest id on the host)
                flat = ids.flatten()
                load = self.expert_load
                load.scatter_add_(0, flat, torch.ones_like(flat, dtype=load.dtype))
        return overlap.routed_forward(self, x, weights, ids)

    def _input_error(self, x) -> str | None:
        hidden = self.router.shape[0]
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != hidden:
            got = getattr(x, "shape", type(x))
            return f"x must be a [..., {hidden}] tensor (hidden size last), got {got}"
        if not x.dtype.is_floating_point:
            return f"x must be a floating tensor, got {x.dtype}"
        if self.wires.uses_mxfp8 and x.dtype not in (torch.bfloat16, torch.float32):
            return f"x must be bfloat16 or float32 for exchange={self.exchange!r}, got {x.dtype}"
        if x.device != self.router.device:
            return f"x is on {x.device}, the layer's parameters on {self.router.device}; move x"
        if self.max_tokens is not None and x.shape[0] > self.max_tokens:
            return (
                f"x has {x.shape[0]} tokens, more than the layer's max_tokens={self.max_tokens} "
                "(its static capacity is sized for it); split the batch or build the layer "
                "with a larger max_tokens"
            )
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
