"""Workers of test_agreement_table.py: for every term that a front end's table says must
agree (mxfp8_a2a.exchange.agreement.TABLES), a call where rank 1 alone holds another value.

CASES maps (front end, term) to its calls, one per route: each is fn(odd, topo), where odd
is True on rank 1 and topo a 2 x 2 NodeTopology of the world (the node route; None: the
flat one). EXPECT gives what the error names where it is not "<term> differs between
ranks": a value that rank 1 alone may not pass on that route (the same error on every rank
too). ON_GPU lists the terms whose other value exists only on a GPU."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import mxfp8_a2a as mx
from mxfp8_a2a.exchange.nccl import NcclTransport

E, T, H = 8, 4, 64  # experts, tokens, hidden


class OtherTransport(NcclTransport):
    """NCCL's exchange under another class and setting (a transport rank 1 alone uses)."""

    def __init__(self, setting: int = 0) -> None:
        self._setting = setting

    def setting(self) -> int:
        return self._setting


def _inputs(hidden=H, dtype=torch.bfloat16, k=2):
    g = torch.Generator().manual_seed(dist.get_rank())
    return torch.randn(T, hidden, generator=g).to(dtype), torch.randint(0, E, (T, k), generator=g)


def _dispatch(odd, topo, term):
    """dispatch with rank 1's value of ``term``."""
    kw = dict(topology=topo, exchange="mxfp8", transport="nccl")
    x, ids = _inputs(96 if odd and term == "x.shape[1]" else H,
                     torch.float32 if odd and term == "x.dtype" else torch.bfloat16,
                     3 if odd and term == "top_k" else 2)  # fmt: skip
    experts = 16 if odd and term == "num_experts" else E
    if odd and term == "topology":
        kw["topology"] = None if topo is not None else _TOPO[0]
    if odd and term == "exchange":
        kw["exchange"] = "bf16"
    if odd and term in ("transport", "transport setting"):
        kw["transport"] = OtherTransport(1 if term == "transport setting" else 0)
    if term == "transport setting" and not odd:
        kw["transport"] = OtherTransport(0)
    if term == "x.requires_grad":
        x.requires_grad_(not odd)
    mx.dispatch(x, ids, experts, **kw)


def _static(odd, topo, term):
    """dispatch_static with rank 1's value of ``term``."""
    kw = dict(topology=topo, exchange="mxfp8", scaling_mode="rceil")
    x, ids = _inputs(96 if odd and term == "x.shape[1]" else H,
                     torch.float32 if odd and term == "x.dtype" else torch.bfloat16,
                     3 if odd and term == "top_k" else 2)  # fmt: skip
    experts, capacity = E, 8
    if term == "num_experts" and topo is None:  # (past the inline counts: agreed)
        experts = 4 * 40 if odd else 4 * 36
    elif term == "num_experts" and odd:
        experts = 16
    if odd and term == "capacity":
        capacity = 12
    if term == "x.dtype":  # (a leg that carries rows in x's dtype)
        kw["exchange"] = "bf16"
    if odd and term == "exchange":
        kw["exchange"] = "bf16"
    if odd and term == "scaling_mode":
        kw["scaling_mode"] = "floor"
    if odd and term == "topology":
        kw["topology"] = None if topo is not None else _TOPO[0]
    mx.dispatch_static(x, ids, experts, capacity, **kw)


def _layer(odd, topo, term, static):
    """ExpertParallelMoE's first forward with rank 1's value of ``term``."""
    kw = dict(hidden=H, ffn=32, num_experts=E, top_k=2, seed=1, topology=topo, align=16,
              exchange="mxfp8", precision="bf16", activation="gelu", transport="nccl")  # fmt: skip
    if static:
        kw |= dict(capacity=8, max_tokens=T)
    other = dict(hidden=96, ffn=64, num_experts=16, top_k=1, align=32, exchange="bf16")
    other |= dict(activation="swiglu", precision="fp8_rowwise", transport=OtherTransport())
    other |= dict(overlap_chunks=2, shared_ffn=48)
    if odd and term in other:
        kw[term] = other[term]
    if odd and term == "topology":
        kw["topology"] = None if topo is not None else _TOPO[0]
    if odd and term == "capacity":
        kw |= dict(capacity=12) if static else dict(capacity=8, max_tokens=T)
    if odd and term == "max_tokens":
        kw["max_tokens"] = 2 * T
    layer = mx.ExpertParallelMoE(**kw)
    dtype = torch.float32 if odd and term == "x.dtype" else torch.bfloat16
    layer(torch.randn(T, kw["hidden"], dtype=dtype))


def _nodes(odd, topo, term):
    """NodeTopology with rank 1's value of ``term``."""
    if term == "ranks_per_node":
        mx.NodeTopology(None, 1 if odd else 2)
    elif term == "LOCAL_WORLD_SIZE":
        os.environ["LOCAL_WORLD_SIZE"] = "4" if odd else "2"
        try:
            mx.NodeTopology(None)
        finally:
            del os.environ["LOCAL_WORLD_SIZE"]
    else:  # process groups made before: rank 1 made one more, then a group of 2 nodes
        pair = dist.new_group([0, 1])
        if odd:
            dist.new_group([1], use_local_synchronization=True)
        if dist.get_rank() < 2:
            mx.NodeTopology(pair, 1)
        else:
            raise ValueError("(not in the group)")


def _exchange(odd, topo, term):
    """to_mxfp8_a2a_dequant(validate=True) with rank 1's value of ``term``."""
    w = dist.get_world_size()
    kw = dict(scaling_mode="rceil", transport="nccl", backward="mxfp8", validate=True)
    x, _ = _inputs(96 if odd and term == "x.shape[1]" else H,
                   torch.float32 if odd and term == "x.dtype" else torch.bfloat16)  # fmt: skip
    x = x[:w]
    if odd and term == "scaling_mode":
        kw["scaling_mode"] = "floor"
    if odd and term == "backward":
        kw["backward"] = "bf16"
    if term in ("transport", "transport setting"):
        kw["transport"] = OtherTransport(int(odd)) if odd or term != "transport" else "nccl"
    if term == "x.requires_grad":
        x.requires_grad_(not odd)
    mx.to_mxfp8_a2a_dequant(x, [1] * w, [1] * w, **kw)


_TOPO: list = []  # the world's 2 x 2 NodeTopology, built once per run
FLAT, NODE = "flat", "node"
ROUTES = {
    "dispatch": ((FLAT, NODE), _dispatch),
    "dispatch_static": ((FLAT, NODE), _static),
    "ExpertParallelMoE": (
        (FLAT + " synced", NODE + " synced", FLAT + " static", NODE + " static"),
        None,
    ),  # fmt: skip
    "NodeTopology": ((FLAT,), _nodes),
    "to_mxfp8_a2a_dequant": ((FLAT,), _exchange),
}
ON_GPU = {("dispatch_static", "transport"): "the other value is a PushBuffer (CUDA)"}
# where rank 1's value is one its route refuses on its own: the bad-argument error
EXPECT = {
    ("dispatch", "transport", NODE): "bad arguments on rank(s) [1]",
    ("dispatch", "transport setting", NODE): "bad arguments on rank(s) [0, 1, 2, 3]",
}
# terms a route cannot take from one rank alone: rank 1's layer would refuse its own
# arguments at construction, before the first forward's agreement (max_tokens without a
# capacity; a Transport object for the static dispatch)
ONLY = {("ExpertParallelMoE", "max_tokens"): "static", ("ExpertParallelMoE", "transport"): "synced"}


def CASES_OF(front: str, terms: list[str]) -> list[tuple[str, str]]:  # noqa: N802
    """The (term, route) pairs run_cases runs for ``front``."""
    routes = ROUTES[front][0]
    return [(t, r) for t in terms for r in routes if r.endswith(ONLY.get((front, t), ""))]


def expected(front: str, term: str, route: str) -> str:
    return EXPECT.get((front, term, route)) or f"{term} differs between ranks"


def run_cases(rank, world, front, terms):
    """Every (term, route) of ``front``: the message each raised (all must raise)."""
    if not _TOPO:
        _TOPO.append(mx.NodeTopology(None, 2))
    fn, out = ROUTES[front][1], []
    for term, route in CASES_OF(front, terms):
        if True:
            topo = _TOPO[0] if route.startswith(NODE) else None
            try:
                if fn is None:
                    _layer(rank == 1, topo, term, route.endswith("static"))
                else:
                    fn(rank == 1, topo, term)
                message = "no error"
            except (ValueError, TypeError) as e:
                message = f"{type(e).__name__}: {e}"
            if message == "ValueError: (not in the group)":
                message = None  # (a rank outside the group it checks: nothing to compare)
            out.append((term, route, message))
            dist.barrier()
    return out
