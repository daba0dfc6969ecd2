"""Which ranks of an expert-parallel group share a node: the two sub-groups the node-aware
dispatch (dispatch(..., topology=...)) sends through.

A group of W = nodes * G ranks, group rank r on node r // G at local index r % G (torchrun
numbers the ranks of a node contiguously). The *rail* of rank r: the ranks with its local
index, one per node (the inter-node hop); its *node group*: the G ranks of its node (the
NVLink hop). Both are made once, when the NodeTopology is built, by its ranks only.
"""

from __future__ import annotations

import inspect
import os

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..exchange import agreement
from ..exchange.checks import group_rank_and_size
from ..exchange.nccl import NCCL
from .terms import NODES


class NodeTopology:
    """The nodes of ``group`` and their sub-groups; build it on every rank of ``group``.

    Args:
        group: the expert-parallel process group (None: the default group).
        ranks_per_node: G, the group's ranks on each node (they must be G consecutive group
            ranks). Default: from torchrun, each rank's node being its global rank //
            LOCAL_WORLD_SIZE; without LOCAL_WORLD_SIZE, one node.
        mesh: instead of the two above, a 2-D DeviceMesh (nodes, ranks per node) whose ranks
            in row-major order are the group's (its dim 0 groups are the rails, dim 1 the
            nodes).

    Attributes: nodes, ranks_per_node, node (this rank's node), local (its index there),
    rail and node_group (process groups; None where the group has one node).
    ``spans_nodes`` is False for one node: dispatch then takes the flat path, today's bits.

    Every rank of the group checks with the others (one all_gather) that they all describe
    the same topology before any sub-group is made: a rank that differs raises the same
    ValueError on every rank.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        ranks_per_node: int | None = None,
        *,
        mesh: DeviceMesh | None = None,
    ) -> None:
        rank, world = group_rank_and_size(group)
        self.group, self.world = group, world
        problem, g = _ranks_per_node(group, world, ranks_per_node, mesh)
        lws = os.environ.get("LOCAL_WORLD_SIZE") if ranks_per_node is mesh is None else None
        made = _groups_made() if world < dist.get_world_size() and world // g > 1 else None
        args = dict(local_world_size=lws, ranks_per_node=g, groups_made=made)
        agreement.check(NODES, args, None if problem is None else ValueError(problem),
                        group)  # fmt: skip
        self.ranks_per_node = g
        self.nodes = world // g
        self.node, self.local = divmod(rank, g)
        self.rail = self.node_group = None
        if not self.spans_nodes:
            return
        if mesh is not None:
            self.rail, self.node_group = mesh.get_group(0), mesh.get_group(1)
            return
        self.rail, self.node_group = _sub_groups(group, g, self.node, self.local)

    @property
    def spans_nodes(self) -> bool:
        return self.nodes > 1

    def node_of(self, rank: int) -> int:
        """The node of group rank ``rank``."""
        return rank // self.ranks_per_node

    def __repr__(self) -> str:
        return f"NodeTopology({self.nodes} nodes x {self.ranks_per_node} ranks)"

    def terms(self) -> str:
        """What dispatch's agreement compares between ranks."""
        return f"{self.nodes}x{self.ranks_per_node}"


def spans(topology: NodeTopology | None) -> bool:
    """Whether ``topology`` asks for the node-aware route (a NodeTopology of 2+ nodes)."""
    return topology is not None and topology.spans_nodes


def topology_error(topology, group, transport) -> str | None:
    """What is wrong with a dispatch's ``topology`` for its group and transport, or None."""
    if topology is None:
        return None
    if not isinstance(topology, NodeTopology):
        return f"topology must be a NodeTopology or None, got {type(topology).__name__}"
    if not same_group(topology.group, group):
        return "topology must be built on dispatch's group (NodeTopology(group, ...))"
    if topology.spans_nodes and transport is not NCCL:
        return "the node-aware route (topology) moves rows with all_to_all_single: transport='nccl'"
    return None


def layer_topology(topology, group, push: bool) -> NodeTopology | None:
    """The layer's ``topology`` argument, resolved at construction (see ExpertParallelMoE)."""
    if isinstance(topology, str) and topology == "auto":
        return None if push else shared_topology(group)
    if topology is None:
        return None
    if not isinstance(topology, NodeTopology):
        raise ValueError(f"topology must be a NodeTopology, 'auto' or None, got {topology!r}")
    if not same_group(topology.group, group):
        raise ValueError("topology must be built on the layer's group: NodeTopology(group, ...)")
    if push and topology.spans_nodes:
        raise ValueError("a PushBuffer moves rows within one node: pass topology=None")
    return topology


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``group`` (None: the world) in group-rank order."""
    return list(dist.get_process_group_ranks(group or dist.group.WORLD))


def same_group(a: dist.ProcessGroup | None, b: dist.ProcessGroup | None) -> bool:
    """Whether two groups (None: the world) hold the same ranks in the same order."""
    return a is b or group_ranks(a) == group_ranks(b)


def _torchrun_hosts(group: dist.ProcessGroup | None) -> list[int] | None:
    """The node of each of the group's ranks by torchrun (global rank // LOCAL_WORLD_SIZE),
    None without LOCAL_WORLD_SIZE."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return None if local is None else [r // int(local) for r in group_ranks(group)]


def _sub_groups(group, g: int, node: int, local: int):
    """(this rank's rail, its node group), on the group's backend. For the whole world every
    rank makes every sub-group, in one order (what new_group asks of the world's ranks);
    for a smaller group only its ranks make theirs (use_local_synchronization), so every
    rank of the group must build its NodeTopologies in the same order as the others."""
    ranks = group_ranks(group)
    nodes, backend = len(ranks) // g, dist.get_backend(group)
    rails = [[ranks[n * g + i] for n in range(nodes)] for i in range(g)]
    blocks = [ranks[n * g : (n + 1) * g] for n in range(nodes)]

    unsorted = any(r != sorted(r) for r in rails + blocks)  # (the same on every rank)
    if unsorted and not KEEPS_ORDER:
        raise ValueError(
            "NodeTopology: the group's ranks do not ascend, and this torch's new_group cannot "
            "keep a sub-group's order (no sort_ranks): build the group with ascending ranks"
        )

    def make(r: list[int], **kw) -> dist.ProcessGroup:  # (group rank i: node or local i)
        return dist.new_group(r, backend=backend, **kw, **({} if r == sorted(r) else _UNSORTED))

    if len(ranks) == dist.get_world_size():
        made = [make(r) for r in rails + blocks]
        return made[local], made[g + node]
    return make(rails[local], use_local_synchronization=True), make(
        blocks[node], use_local_synchronization=True
    )


def _groups_made() -> int | None:
    """How many process groups this process has made (new_group with
    use_local_synchronization names a group by its ranks and this count, so the ranks of a
    sub-group must have made as many); None where this torch keeps no such count (private
    state, read with getattr)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    names = getattr(world, "pg_names", None)
    return len(names) if isinstance(names, dict) else None


_UNSORTED = {"sort_ranks": False}  # (a group whose ranks do not ascend: keep its order)
KEEPS_ORDER = "sort_ranks" in inspect.signature(dist.new_group).parameters  # (torch 2.13: yes)


def _ranks_per_node(group, world, ranks_per_node, mesh) -> tuple[str | None, int]:
    """(this rank's problem or None, G)."""
    if mesh is not None:
        if ranks_per_node is not None:
            return "pass mesh or ranks_per_node, not both", 1
        if mesh.ndim != 2:
            return f"mesh must be 2-D (nodes, ranks per node), got {mesh.ndim}-D", 1
        flat, ranks = mesh.mesh.flatten().tolist(), group_ranks(group)
        if flat != ranks:
            return (
                f"mesh's ranks {flat} (row-major) must be the group's ranks {ranks}; pass the "
                "expert-parallel group the mesh covers",
                1,
            )
        return None, mesh.size(1)
    if ranks_per_node is None:
        if (hosts := _torchrun_hosts(group)) is None:
            return None, world
        sizes = [hosts.count(h) for h in dict.fromkeys(hosts)]  # (nodes in group order)
        if len(set(sizes)) > 1 or hosts != sorted(hosts, key=hosts.index):
            return (
                f"the group's {world} ranks lie on nodes of {sizes} ranks (global rank // "
                f"LOCAL_WORLD_SIZE={os.environ['LOCAL_WORLD_SIZE']}: nodes {hosts}); the "
                "node-aware route needs nodes of one size, each holding consecutive group "
                "ranks: pass ranks_per_node or a mesh, or topology=None",
                1,
            )
        return None, sizes[0]
    if type(ranks_per_node) is not int or ranks_per_node < 1 or world % ranks_per_node:
        return (
            f"ranks_per_node must be a positive int dividing the group's size {world}, got "
            f"{ranks_per_node!r}",
            1,
        )
    return None, ranks_per_node


SHARED_MAX = 16  # topologies kept for the layers and dispatchers (each holds two groups)
_shared: dict[tuple, NodeTopology | None] = {}


def shared_topology(
    group: dist.ProcessGroup | None, ranks_per_node: int | None = None
) -> NodeTopology | None:
    """One NodeTopology per (group, ranks_per_node), kept for every layer that asks, for the
    life of the process (``_shared.clear()`` forgets them; never evicted, since layers keep
    using their sub-groups: past SHARED_MAX a ValueError asks for a NodeTopology of one's
    own). ranks_per_node None: torchrun's nodes (LOCAL_WORLD_SIZE; None without it, with no
    collective), and None where the group's ranks lie on one node. Every rank of the group
    must call it alike (it may build a NodeTopology, whose agreement also compares
    LOCAL_WORLD_SIZE)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if ranks_per_node is None and local is None:
        return None
    key = (group if group is not None else "world", ranks_per_node, local)
    if key not in _shared:
        if len(_shared) >= SHARED_MAX:
            raise ValueError(
                f"more than SHARED_MAX={SHARED_MAX} groups asked for a node topology of their "
                "own (the kept ones are never dropped: layers use their sub-groups); build "
                "one NodeTopology(group, ...) per group and pass topology= to the layers"
            )
        topology = NodeTopology(group, ranks_per_node)
        _shared[key] = topology if topology.spans_nodes else None
    return _shared[key]
