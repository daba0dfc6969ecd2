"""torchtitan's expert parallelism with MXFP8 rows on the wire (extra: mxfp8_a2a[torchtitan]).

One flag on the command a torchtitan user already runs replaces the token dispatcher of every
MoE layer that uses torchtitan's ``AllToAllTokenDispatcher`` (its "standard" EP backend)::

    torchrun --nproc-per-node=2 -m torchtitan.train --module deepseek_v3 \\
        --config deepseek_v3_debugmodel --parallelism.expert_parallel_degree 2 \\
        --training.disable_cuda_graphs \\
        --override.imports 'mxfp8_a2a.torchtitan.mxfp8_dispatch={"wire": "mxfp8"}'

:class:`MXFP8TokenDispatcher` keeps that dispatcher's contract (inputs, outputs, rows grouped
by local expert then by source rank, routing scores applied in ``combine``, token counts
int64 on the counts' device, as torchtitan's at EP > 1) and moves the rows with
:func:`mxfp8_a2a.dispatch` and :func:`mxfp8_a2a.combine`: rows encoded for the wire straight
from the tokens, one packed exchange each way, decoded straight into the experts' layout, a
wire per leg (``wire``: a preset of :data:`mxfp8_a2a.WIRE_PRESETS`). The counts exchange and
its one host sync stay (as in torchtitan's own dispatcher). :func:`mxfp8_dispatch_static` gives
:class:`MXFP8StaticTokenDispatcher` instead: no host sync, fixed shapes, traceable by
torch.compile(fullgraph=True) (torchtitan's ``--compile.enable``). torchtitan's CUDA-graph check
(``_validate_cuda_graphs``) accepts neither at EP > 1 (it knows only its MinimalAsyncEP and
non-blocking HybridEP dispatchers): pass ``--training.disable_cuda_graphs``. All exchanges go
through torch's functional all_to_all_single, which torchtitan's selective activation
checkpointing saves: a recomputed block does not exchange again.

Numerics against torchtitan's own dispatcher with ``wire="bf16"``: the experts receive the
same rows in the same order, bit for bit. ``combine`` differs in rounding only: torchtitan
rounds each scored row to bf16 and sums a token's rows in bf16; this one rounds the scores to
the rows' dtype, multiplies and sums in fp32 and rounds once (tests/test_torchtitan.py
bounds the difference). With EP = 1 (no ``ep_mesh``) there is no wire: both take torchtitan's
local path.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

import torch

from .exchange.wires import WIRE_PRESETS
from .moe.dispatch_static import StaticHandle, capacity_for, combine_static, dispatch_static
from .moe.dispatch_synced import DispatchHandle, dispatch_reporting
from .moe.dispatch_synced import combine as combine_synced
from .moe.topology import NodeTopology, shared_topology

SUPPORTED = ("0.3.",)  # torchtitan releases this module is tested with (the extra pins it)


def _check_version() -> str:
    try:
        found = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(
            "mxfp8_a2a.torchtitan needs torchtitan: pip install 'mxfp8_a2a[torchtitan]'"
        ) from None
    if not found.startswith(SUPPORTED):
        raise ImportError(
            f"mxfp8_a2a.torchtitan supports torchtitan {' / '.join(v + 'x' for v in SUPPORTED)}, "
            f"found {found}: pip install 'mxfp8_a2a[torchtitan]' installs the tested release"
        )
    return found


TORCHTITAN_VERSION = _check_version()

from torchtitan.config.override import derive, override  # noqa: E402
from torchtitan.models.common.token_dispatcher import (  # noqa: E402
    AllToAllTokenDispatcher,
    LocalTokenDispatcher,
)

COMPILE_ERROR = (
    "MXFP8TokenDispatcher cannot be traced by torch.compile: its dispatch reads the token "
    "counts on the host (one sync per call) through code Dynamo does not trace. Leave the MoE "
    "blocks eager (run without --compile.enable, or compile only other components), or use "
    "torchtitan's own dispatcher where the blocks must be compiled"
)
DEFAULT_WIRE = "mxfp8"  # ExpertParallelMoE's default (BENCHMARKS.md: wire per leg)


def _wire_error(wire: object) -> str | None:
    if isinstance(wire, str) and wire in WIRE_PRESETS:
        return None
    return f"wire must be one of {sorted(WIRE_PRESETS)} (mxfp8_a2a.WIRE_PRESETS), got {wire!r}"


@dataclass(frozen=True, kw_only=True)
class MXFP8DispatchMetadata:
    """What :meth:`MXFP8TokenDispatcher.combine` needs: the dispatch's handle and the
    routing scores ``topk_scores_TK`` (T, K) that combine applies."""

    handle: DispatchHandle | StaticHandle
    topk_scores_TK: torch.Tensor  # noqa: N815


class MXFP8TokenDispatcher(AllToAllTokenDispatcher):
    """torchtitan's all-to-all token dispatcher with each leg on its own wire.

    ``dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)``:
    x_TD (T, D) bf16 or fp32 (D % 32 == 0 when a leg is MXFP8), scores (T, K) float, ids
    (T, K) int64, counts (E,) integer. Returns ``routed_input_RD`` (R, D) in x's dtype, rows
    grouped by local expert and within one by source rank (torchtitan's expert-major order);
    ``tokens_per_local_expert`` (E / ep_size,) int64 on the counts' device (EP = 1: torchtitan's
    local dispatcher, the counts' dtype), as torchtitan's; and the
    metadata for ``combine(routed_output_RD, metadata, x_TD)``, which returns out_TD (T, D)
    in x's dtype: for each token the sum over its experts of score * expert output.

    Every EP rank must use the same wire; a different wire, or a hidden size that is not a
    multiple of 32 with an MXFP8 leg, raises the same ValueError on every rank in dispatch.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(AllToAllTokenDispatcher.Config):
        wire: str = DEFAULT_WIRE
        """Wire preset of the four legs: "mxfp8", "mxfp8_to_experts" or "bf16"."""
        ranks_per_node: int | None = None
        """EP ranks per node for the node-aware route (each token sent once per node it
        reaches); None: torchrun's nodes; the EP size: flat."""

    def __init__(self, config: Config):
        if (problem := _wire_error(config.wire)) is not None:
            raise ValueError(problem)
        super().__init__(config)
        self.wire, self.ranks_per_node = config.wire, config.ranks_per_node
        self.topology: NodeTopology | None = None

    def init_buffer(self) -> None:
        """When torchtitan wires the EP mesh: the NodeTopology of its group (shared by the
        dispatchers of one group), or None on one node."""
        super().init_buffer()
        group = self.ep_mesh.get_group() if self.ep_mesh is not None else None
        if group is not None:
            self.topology = shared_topology(group, self.ranks_per_node)

    def dispatch(
        self,
        x_TD: torch.Tensor,  # noqa: N803
        topk_scores_TK: torch.Tensor,  # noqa: N803
        topk_expert_ids_TK: torch.Tensor,  # noqa: N803
        num_local_tokens_per_expert_E: torch.Tensor,  # noqa: N803
    ):
        if self.ep_mesh is None:  # EP = 1: no wire, torchtitan's local reorder
            return LocalTokenDispatcher.dispatch(
                self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E
            )
        routed, ends, handle = self._move(x_TD, topk_expert_ids_TK)
        counts = torch.diff(ends, prepend=ends.new_zeros(1))  # int32 end offsets: no host copy
        counts = counts.to(torch.int64)  # (as torchtitan's at EP > 1: a sum, int64 whatever in)
        return routed, counts, MXFP8DispatchMetadata(handle=handle, topk_scores_TK=topk_scores_TK)

    def _move(self, x_TD: torch.Tensor, topk_expert_ids_TK: torch.Tensor):  # noqa: N803
        """(routed rows, int32 end offsets per local expert, handle): the host-synced path."""
        if torch.compiler.is_compiling():
            raise RuntimeError(COMPILE_ERROR)
        # functional collectives: torchtitan's selective checkpointing saves their outputs,
        # so a recomputed block does not exchange again
        routed, _, handle = dispatch_reporting(
            x_TD, topk_expert_ids_TK, self.num_experts, self.ep_mesh.get_group(), self.wire,
            "nccl", None, functional=True, topology=self.topology,
        )  # fmt: skip
        return routed, handle.expert_offsets, handle

    def combine(
        self,
        routed_output_RD: torch.Tensor,  # noqa: N803
        metadata,
        x_TD: torch.Tensor,  # noqa: N803
    ) -> torch.Tensor:
        if not isinstance(metadata, MXFP8DispatchMetadata):  # EP = 1
            return LocalTokenDispatcher.combine(self, routed_output_RD, metadata, x_TD)
        out = self._combine_rows(routed_output_RD, metadata.topk_scores_TK, metadata.handle)
        return out.to(x_TD.dtype)

    _combine_rows = staticmethod(combine_synced)


@override(
    target=AllToAllTokenDispatcher.Config,
    exact=True,
    description="mxfp8_a2a: MXFP8 rows on the expert-parallel wire (a preset per leg)",
)
def mxfp8_dispatch(
    cfg: AllToAllTokenDispatcher.Config,
    *,
    wire: str = DEFAULT_WIRE,
    ranks_per_node: int | None = None,
) -> MXFP8TokenDispatcher.Config:
    """torchtitan override factory: every ``AllToAllTokenDispatcher.Config`` (exactly that
    class: torchtitan's other dispatchers are left alone) becomes an
    :class:`MXFP8TokenDispatcher.Config` with the same fields, ``wire`` and
    ``ranks_per_node``. Activate with
    ``--override.imports 'mxfp8_a2a.torchtitan.mxfp8_dispatch={"wire": "mxfp8_to_experts"}'``."""
    if (problem := _wire_error(wire)) is not None:
        raise ValueError(f"mxfp8_a2a.torchtitan.mxfp8_dispatch: {problem}")
    if (problem := _ranks_error(ranks_per_node)) is not None:
        raise ValueError(f"mxfp8_a2a.torchtitan.mxfp8_dispatch: {problem}")
    return derive(cfg, MXFP8TokenDispatcher.Config, wire=wire, ranks_per_node=ranks_per_node)


class MXFP8StaticTokenDispatcher(MXFP8TokenDispatcher):
    """:class:`MXFP8TokenDispatcher` on the static dispatch (:func:`mxfp8_a2a.dispatch_static`):
    no host sync, so torch.compile(fullgraph=True) of the MoE blocks (torchtitan's
    ``--compile.enable``) traces it. ``routed_input_RD`` then has a fixed row count,
    static_rows(capacity, ep_size, local experts, 16) for T tokens, each local expert's block
    padded with zero rows to a multiple of 16 (the counts returned include the padding, so
    torchtitan's grouped GEMM offsets fall on the blocks; rows past the last offset are zero).

    Capacity (rows each rank may send each rank): ``capacity_factor`` None (the default)
    is dropless, T * min(top_k, local experts); a number f gives ceil(f * T * top_k /
    ep_size), less memory, and rows past it are dropped, counted in ``last_stats``
    (int64 [4] on the device, :data:`mxfp8_a2a.STAT_NAMES`, the last call's; no sync).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(MXFP8TokenDispatcher.Config):
        capacity_factor: float | None = None
        """None: dropless; f > 0: ceil(f * tokens * top_k / ep_size) rows per rank pair."""

    def __init__(self, config: Config):
        if config.capacity_factor is not None:
            capacity_for(1, 1, 1, config.capacity_factor)  # its check of the factor
        super().__init__(config)
        self.capacity_factor = config.capacity_factor
        self.last_stats: torch.Tensor | None = None

    def _move(self, x_TD: torch.Tensor, topk_expert_ids_TK: torch.Tensor):  # noqa: N803
        """The static path: a capacity from the token count, no host sync."""
        world, tokens, k = self.ep_mesh.size(), x_TD.shape[0], topk_expert_ids_TK.shape[1]
        if self.capacity_factor is None:
            capacity = max(1, tokens * min(k, self.num_experts // world))
        else:
            capacity = max(1, capacity_for(tokens, k, world, self.capacity_factor))
        routed, ends, handle = dispatch_static(
            x_TD, topk_expert_ids_TK, self.num_experts, capacity, self.ep_mesh.get_group(),
            exchange=self.wire, functional=True,  # (selective checkpointing saves them)
            topology=self.topology,
        )  # fmt: skip
        self.last_stats = handle.stats
        return routed, ends, handle

    _combine_rows = staticmethod(combine_static)


@override(
    target=AllToAllTokenDispatcher.Config,
    exact=True,
    description="mxfp8_a2a: MXFP8 wire on the static (sync-free, compilable) dispatch",
)
def mxfp8_dispatch_static(
    cfg: AllToAllTokenDispatcher.Config,
    *,
    wire: str = DEFAULT_WIRE,
    capacity_factor: float | None = None,
    ranks_per_node: int | None = None,
) -> MXFP8StaticTokenDispatcher.Config:
    """torchtitan override factory like :func:`mxfp8_dispatch`, on the static dispatch:
    ``--override.imports 'mxfp8_a2a.torchtitan.mxfp8_dispatch_static={"wire": "mxfp8"}'``
    (``capacity_factor``: see :class:`MXFP8StaticTokenDispatcher`; default dropless)."""
    name = "mxfp8_a2a.torchtitan.mxfp8_dispatch_static"
    if (problem := _wire_error(wire)) is not None:
        raise ValueError(f"{name}: {problem}")
    if capacity_factor is not None:
        capacity_for(1, 1, 1, capacity_factor)
    if (problem := _ranks_error(ranks_per_node)) is not None:
        raise ValueError(f"{name}: {problem}")
    return derive(cfg, MXFP8StaticTokenDispatcher.Config, wire=wire,
                  capacity_factor=capacity_factor, ranks_per_node=ranks_per_node)  # fmt: skip


def _ranks_error(ranks_per_node: object) -> str | None:
    if ranks_per_node is None or (type(ranks_per_node) is int and ranks_per_node >= 1):
        return None
    return (
        f"ranks_per_node must be a positive int or None (torchrun's nodes), got {ranks_per_node!r}"
    )
