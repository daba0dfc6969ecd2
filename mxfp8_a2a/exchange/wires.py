"""The wire of each leg of an MoE layer's exchanges, and the named presets.

A layer moves rows four times per training step, each a *leg*:

- dispatch forward: the tokens to the experts' ranks;
- dispatch backward: their gradient back to the tokens' ranks;
- combine forward: the experts' outputs back to the tokens' ranks;
- combine backward: the output gradient to the experts' ranks.

Each leg travels as ``"mxfp8"`` (quantize_packed's bits: e4m3 values and one e8m0 scale per
32, 1 + 1/32 bytes per value, dequantized on arrival) or ``"bf16"`` (the rows themselves,
unquantized, in the activations' dtype: 2 bytes per value for bf16 activations, 4 for fp32).
The presets (``exchange=`` of :class:`mxfp8_a2a.ExpertParallelMoE`, dispatch, combine and
their static forms):

========================  ==============  ==============  ===============================
preset                    toward experts  toward tokens   wire bytes per token per layer
                          (dispatch fwd,  (dispatch bwd,  (k copies of H values; fwd+bwd,
                          combine bwd)    combine fwd)    bf16 activations)
========================  ==============  ==============  ===============================
``"mxfp8"``               mxfp8           mxfp8           4 * 1.03125 * k * H
``"mxfp8_to_experts"``    mxfp8           bf16            2 * (1.03125 + 2) * k * H
``"bf16"``                bf16            bf16            4 * 2 * k * H
========================  ==============  ==============  ===============================

``"mxfp8_to_experts"`` is the split of the published FP8 recipes (DeepSeek-V3's section 3.3;
torchao's ``a2a_dispatch_mxfp8_fwd_hp_bwd`` / ``a2a_combine_hp_fwd_mxfp8_bwd``): only the rows
that enter the experts' GEMMs travel as MXFP8; what returns to the tokens' residual stream
(outputs and input gradients) stays unquantized. Any other mix is a :class:`Wires`.

Each leg's numerics are the same at every group size: a row is encoded once on its sender
and decoded once on its receiver, also when sender and receiver are one rank (a group of one
applies every leg's rounding), so a one-GPU run speaks for the numerics of W ranks.
"""

from __future__ import annotations

from typing import NamedTuple

WIRE_FORMATS = ("mxfp8", "bf16")


class Wires(NamedTuple):
    """The wire of each leg ("mxfp8" or "bf16"); see the module docstring."""

    dispatch_fwd: str
    dispatch_bwd: str
    combine_fwd: str
    combine_bwd: str

    @property
    def dispatch(self) -> tuple[str, str]:
        """(forward, backward) of dispatch."""
        return self.dispatch_fwd, self.dispatch_bwd

    @property
    def combine(self) -> tuple[str, str]:
        """(forward, backward) of combine."""
        return self.combine_fwd, self.combine_bwd

    @property
    def uses_mxfp8(self) -> bool:
        return "mxfp8" in self


def _toward(experts: str, tokens: str) -> Wires:
    return Wires(experts, tokens, tokens, experts)


WIRE_PRESETS: dict[str, Wires] = {
    "mxfp8": _toward("mxfp8", "mxfp8"),
    "mxfp8_to_experts": _toward("mxfp8", "bf16"),
    "bf16": _toward("bf16", "bf16"),
}
EXCHANGES = tuple(WIRE_PRESETS)


def _problem(value) -> str:
    return (
        f"exchange must be a preset {EXCHANGES}, a Wires(...) of four legs, or for one "
        f"exchange a (forward, backward) pair of {WIRE_FORMATS}; got {value!r}"
    )


def layer_wires(exchange: str | Wires | tuple) -> Wires:
    """A layer's ``exchange``: a preset name or four legs (a Wires or a 4-tuple) -> Wires.
    A ValueError naming the choices for anything else."""
    if isinstance(exchange, str) and exchange in WIRE_PRESETS:
        return WIRE_PRESETS[exchange]
    if isinstance(exchange, tuple) and len(exchange) == 4 and all(
        isinstance(w, str) and w in WIRE_FORMATS for w in exchange
    ):  # fmt: skip
        return Wires(*exchange)
    raise ValueError(_problem(exchange))


def leg_pair(exchange: str | Wires | tuple, side: str) -> tuple[str, str]:
    """(forward, backward) wires of ``side`` ("dispatch" or "combine") for an ``exchange`` of
    one exchange: a preset name (its legs of that side), a Wires, or a (forward, backward)
    pair. A ValueError naming the choices for anything else."""
    if isinstance(exchange, tuple) and len(exchange) == 2:
        if all(isinstance(w, str) and w in WIRE_FORMATS for w in exchange):
            return exchange[0], exchange[1]
        raise ValueError(_problem(exchange))
    return getattr(layer_wires(exchange), side)


def combine_default(exchange: str | Wires | tuple) -> tuple[str, str]:
    """The (forward, backward) wires combine takes by default after a dispatch given
    ``exchange``: the preset's (or Wires') combine legs; for a dispatch pair (f, b), the mirror
    (b, f): each direction keeps its wire (toward the experts f, toward the tokens b)."""
    if isinstance(exchange, tuple) and len(exchange) == 2:
        forward, backward = leg_pair(exchange, "dispatch")
        return backward, forward
    return leg_pair(exchange, "combine")


def check_leg_pair(exchange) -> str | None:
    """What is wrong with a dispatch/combine ``exchange`` (None: nothing)."""
    try:
        leg_pair(exchange, "dispatch")
    except ValueError as e:
        return str(e)
    return None
