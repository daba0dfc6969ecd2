"""The row operations of the dispatch engine (engine.py): rows encoded for the wire straight
into their slots of a send buffer, and decoded straight into their place on arrival.

A wire buffer holds one row per slot: for ``wire="mxfp8"`` uint8 [R, wire_row(H)] (the
packed MXFP8 row, K e4m3 bytes then K/32 scale bytes, padded to 16 bytes; the bits of
``quantize_packed``), for ``wire="bf16"`` the rows themselves [R, H] in their own dtype.
Indices are int64; -1 means "no row" (a dropped (token, slot) row, a padding row).

- :func:`scatter_encode`: buf[rows_of[t, j]] = encode(x[t]) for every j (one token, k slots).
- :func:`gather_encode`: buf[i] = encode(y[index[i]]), zeros where index[i] = -1.
- :func:`gather_decode`: out[i] = decode(buf[index[i]]), zeros where index[i] = -1.
- :func:`slot_sum_decode`: out[t] = sum_j w[t, j] * decode(buf[rows_of[t, j]]) over the
  slots that hold a row, and its backward :func:`slot_sum_decode_backward`.

Decoded values are rounded to the output dtype before any arithmetic, and the sums run in
fp32 over j in order with one rounding: exactly what dequantizing into rows and then
:func:`slot_sum_reference` give. The ``*_reference`` functions are the plain-torch
definitions; for bf16 and fp32 rows on CUDA (and on CPU under TRITON_INTERPRET=1) the public
functions run the kernels of row_kernels.py and row_kernels_backward.py instead, bit for bit
the same (grad_w: equal within fp32 rounding, summed in another order), except that
:func:`scatter_encode`'s and :func:`slot_sum_decode_backward`'s rows that no (token, slot)
targets are left unwritten there (never read by the receiver). Other dtypes take the
references.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor  # noqa: F401 (the launchers' annotations, read by the ops' schemas)

from .._common import check_scaling_mode, kernels_run_on
from ..exchange.rows import wire_row
from ..formats.dequantize import dequantize_reference
from ..formats.packing import pack, packed_row_bytes, unpack
from ..formats.quantize import quantize_reference
from . import row_kernels as sk
from . import row_kernels_backward as skb
from .row_kernels import wire_shape

WIRES = ("mxfp8", "bf16")


def encode(x: torch.Tensor, wire: str, scaling_mode: str = "rceil") -> torch.Tensor:
    """Rows [n, H] as wire rows (plain torch)."""
    if wire == "bf16":
        return x
    packed = pack(*quantize_reference(x, scaling_mode))
    return torch.nn.functional.pad(packed, (0, wire_row(x.shape[1]) - packed.shape[1]))


def decode(buf: torch.Tensor, hidden: int, dtype: torch.dtype, wire: str) -> torch.Tensor:
    """Wire rows -> [n, H] in ``dtype`` (plain torch)."""
    if wire == "bf16":
        return buf.to(dtype)
    return dequantize_reference(*unpack(buf[:, : packed_row_bytes(hidden)]), dtype)


def slot_sum_reference(rows: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor):
    """The plain-torch definition: rows [N, H], pos int64 [T, k], weights [T, k] -> [T, H]
    in rows' dtype, sums over j in order in fp32 (fp64 for fp64 rows)."""
    acc_dtype = torch.promote_types(rows.dtype, torch.float32)
    w = weights.to(rows.dtype).to(acc_dtype)
    if pos.shape[1] == 0:  # zeros, still a function of rows and weights (empty sums)
        return (rows.to(acc_dtype).sum(0) + w.sum(1, keepdim=True)).to(rows.dtype)
    acc = rows.new_zeros((pos.shape[0], rows.shape[1]), dtype=acc_dtype)
    for j in range(pos.shape[1]):
        acc = acc + w[:, j : j + 1] * rows.index_select(0, pos[:, j]).to(acc_dtype)
    return acc.to(rows.dtype)


def _take(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[index] with zero rows where index is -1 (t of any number of dimensions)."""
    if t.shape[0] == 0:  # (every index is -1)
        return t.new_zeros((index.numel(), *t.shape[1:]))
    rows = t.index_select(0, index.clamp(min=0))
    return rows.masked_fill((index < 0).view(-1, *[1] * (t.dim() - 1)), 0)


def put_rows(values: torch.Tensor, index: torch.Tensor, n: int, fill: float = 0):
    """[n, ...] filled with ``fill``, values[i] at row index[i] (-1: left out)."""
    out = values.new_full((n + 1, *values.shape[1:]), fill)
    return out.index_copy_(0, torch.where(index < 0, n, index), values)[:n]


def scatter_encode_reference(
    x: torch.Tensor, rows_of: torch.Tensor, n_rows: int, wire: str, scaling_mode: str = "rceil"
) -> torch.Tensor:
    """x [T, H], rows_of int64 [T, k] (slot of each copy, -1: none; distinct otherwise) ->
    a wire buffer of n_rows rows holding encode(x[t]) at every rows_of[t, j] (others zero)."""
    rows = encode(x, wire, scaling_mode).repeat_interleave(rows_of.shape[1], dim=0)
    return put_rows(rows, rows_of.reshape(-1), n_rows)


def gather_encode_reference(
    y: torch.Tensor, index: torch.Tensor, wire: str, scaling_mode: str = "rceil"
) -> torch.Tensor:
    """y [N, H], index int64 [R] -> wire buffer [R]: row i = encode(y[index[i]]), zeros for
    -1."""
    return encode(_take(y, index), wire, scaling_mode)


def gather_decode_reference(
    buf: torch.Tensor, index: torch.Tensor, hidden: int, dtype: torch.dtype, wire: str
) -> torch.Tensor:
    """buf: a wire buffer; index int64 [N] -> [N, hidden] in ``dtype``: decode(buf[index[i]]),
    zeros for -1."""
    return decode(_take(buf, index), hidden, dtype, wire)


def _slot_rows(buf, rows_of, hidden, dtype, wire) -> torch.Tensor:
    return gather_decode_reference(buf, rows_of.reshape(-1), hidden, dtype, wire)


def slot_sum_decode_reference(
    buf: torch.Tensor,
    rows_of: torch.Tensor,
    weights: torch.Tensor | None,
    hidden: int,
    dtype: torch.dtype,
    wire: str,
) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * decode(buf[rows_of[t, j]]) over the j with
    rows_of[t, j] >= 0 (weights None: all 1), [T, hidden] in ``dtype``; weights rounded to
    ``dtype`` first, fp32 sums over j in order, one rounding. A slot without a row adds
    nothing, whatever its weight (also NaN)."""
    t, k = rows_of.shape
    rows = _slot_rows(buf, rows_of, hidden, dtype, wire)
    pos = torch.arange(t * k, device=buf.device).view(t, k)
    w = torch.ones((t, k), device=buf.device) if weights is None else weights
    return slot_sum_reference(rows, pos, w.masked_fill(rows_of < 0, 0))


def slot_sum_decode_backward_reference(
    grad: torch.Tensor,
    buf: torch.Tensor,
    rows_of: torch.Tensor,
    weights: torch.Tensor,
    n_rows: int,
    wire: str,
    scaling_mode: str = "rceil",
    buf_wire: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of :func:`slot_sum_decode` for grad [T, H]: (a ``wire`` buffer of n_rows
    rows holding encode(w[t, j] * grad[t]) at rows_of[t, j] (the product rounded to grad's
    dtype, weights rounded to it first), fp32 [T, k] grad of the weights: the fp32 dot product
    of grad[t] and decode(buf[rows_of[t, j]]), 0 where rows_of is -1). buf's rows are of
    ``buf_wire`` (the forward's; default ``wire``)."""
    t, k = rows_of.shape
    h = grad.shape[1]
    rows = _slot_rows(buf, rows_of, h, grad.dtype, buf_wire or wire).view(t, k, h).float()
    g = grad.float()
    w = weights.to(grad.dtype).float()
    grad_rows = (w[:, :, None] * g[:, None, :]).to(grad.dtype).view(t * k, h)
    grad_w = (rows * g[:, None, :]).sum(-1).masked_fill(rows_of < 0, 0)
    out = scatter_encode_reference(grad_rows, rows_of.reshape(-1, 1), n_rows, wire, scaling_mode)
    return out, grad_w


# ---------------------------------------------------------------------------- custom ops
# One op per row operation (register_fake for torch.compile; no autograd: engine.py's
# Functions call them in forward and backward). Each runs row_kernels.py's launcher where the
# kernels run (CUDA; CPU under TRITON_INTERPRET=1), else its plain-torch reference: compiled
# code sees one opaque op either way (Dynamo does not trace the references' bit casts).


def _op(name: str, kernel, reference=None):
    if reference is None:  # (kernels only: push.py's ops)
        return torch.library.custom_op(f"mxfp8_a2a::moe_{name}", kernel, mutates_args=())

    @functools.wraps(kernel)
    def run(*args):
        if kernels_run_on(args[0].device, sk._gather_decode_kernel):
            return kernel(*args)
        return reference(*args)

    return torch.library.custom_op(f"mxfp8_a2a::moe_{name}", run, mutates_args=())


scatter_encode_op = _op("scatter_encode", sk.scatter_encode, scatter_encode_reference)
gather_encode_op = _op("gather_encode", sk.gather_encode, gather_encode_reference)
gather_decode_op = _op("gather_decode", sk.gather_decode, gather_decode_reference)
slot_sum_decode_op = _op("slot_sum_decode", sk.slot_sum_decode, slot_sum_decode_reference)
slot_sum_decode_backward_op = _op(
    "slot_sum_decode_backward", skb.slot_sum_decode_backward, slot_sum_decode_backward_reference
)


@slot_sum_decode_backward_op.register_fake
def _(grad, buf, rows_of, weights, n_rows, wire, scaling_mode, buf_wire):
    shape, dtype = wire_shape(n_rows, grad.shape[1], grad.dtype, wire)
    return grad.new_empty(shape, dtype=dtype), grad.new_empty(rows_of.shape, dtype=torch.float32)


@scatter_encode_op.register_fake
def _(x, rows_of, n_rows, wire, scaling_mode):
    shape, dtype = wire_shape(n_rows, x.shape[1], x.dtype, wire)
    return x.new_empty(shape, dtype=dtype)


@gather_encode_op.register_fake
def _(y, index, wire, scaling_mode):
    shape, dtype = wire_shape(index.shape[0], y.shape[1], y.dtype, wire)
    return y.new_empty(shape, dtype=dtype)


@gather_decode_op.register_fake
def _(buf, index, hidden, dtype, wire):
    return buf.new_empty((index.shape[0], hidden), dtype=dtype)


@slot_sum_decode_op.register_fake
def _(buf, rows_of, weights, hidden, dtype, wire):
    return buf.new_empty((rows_of.shape[0], hidden), dtype=dtype)


# ---------------------------------------------------------------------------- public
# The kernels take what they can (anything else goes to the references, which raise on what
# they cannot take either): bf16/fp32 rows, H % 32 == 0 for "mxfp8", int64 indices and
# floating weights of the right shapes on the rows' device.


def _kernels(device: torch.device, dtype: torch.dtype, wire: str, hidden: int, *idx) -> bool:
    """Whether the ops take these arguments (they run the kernels where those run)."""
    return (
        dtype in sk.DTYPES
        and wire in WIRES
        and (wire == "bf16" or hidden % 32 == 0)
        and all(i.dtype == torch.int64 and i.device == device for i in idx)
    )


def _decodes(buf: torch.Tensor, dtype: torch.dtype, wire: str, hidden: int, *idx) -> bool:
    """_kernels, for a wire buffer of ``hidden`` values of ``dtype`` per row."""
    if buf.dim() != 2 or not _kernels(buf.device, dtype, wire, hidden, *idx):
        return False
    if wire == "bf16":
        return buf.dtype == dtype and buf.shape[1] == hidden
    return buf.dtype == torch.uint8 and buf.shape[1] >= hidden + hidden // 32


def _weights_fit(weights: torch.Tensor | None, rows_of: torch.Tensor) -> bool:
    return weights is None or (
        weights.dtype.is_floating_point
        and weights.shape == rows_of.shape
        and weights.device == rows_of.device
    )


def scatter_encode(
    x: torch.Tensor, rows_of: torch.Tensor, n_rows: int, wire: str, scaling_mode: str = "rceil"
) -> torch.Tensor:
    """x [T, H], rows_of int64 [T, k] (slot of each copy, -1: none; distinct otherwise) ->
    a wire buffer of n_rows rows holding encode(x[t]) at every rows_of[t, j]; the other rows
    are zero in the reference, unwritten by the kernel (never read)."""
    check_scaling_mode(scaling_mode)
    if (
        x.dim() == rows_of.dim() == 2
        and rows_of.shape[0] == x.shape[0]
        and _kernels(x.device, x.dtype, wire, x.shape[1], rows_of)
    ):
        return scatter_encode_op(x, rows_of, n_rows, wire, scaling_mode)
    return scatter_encode_reference(x, rows_of, n_rows, wire, scaling_mode)


def gather_encode(
    y: torch.Tensor, index: torch.Tensor, wire: str, scaling_mode: str = "rceil"
) -> torch.Tensor:
    """y [N, H], index int64 [R] -> wire buffer [R]: row i = encode(y[index[i]]), zeros for
    -1 (for "mxfp8" all zero bytes)."""
    check_scaling_mode(scaling_mode)
    if y.dim() == 2 and index.dim() == 1 and _kernels(y.device, y.dtype, wire, y.shape[1], index):
        return gather_encode_op(y, index, wire, scaling_mode)
    return gather_encode_reference(y, index, wire, scaling_mode)


def gather_decode(
    buf: torch.Tensor, index: torch.Tensor, hidden: int, dtype: torch.dtype, wire: str
) -> torch.Tensor:
    """buf: a wire buffer; index int64 [N] -> [N, hidden] in ``dtype``: decode(buf[index[i]]),
    zeros for -1."""
    if index.dim() == 1 and _decodes(buf, dtype, wire, hidden, index):
        return gather_decode_op(buf, index, hidden, dtype, wire)
    return gather_decode_reference(buf, index, hidden, dtype, wire)


def slot_sum_decode(
    buf: torch.Tensor,
    rows_of: torch.Tensor,
    weights: torch.Tensor | None,
    hidden: int,
    dtype: torch.dtype,
    wire: str,
) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * decode(buf[rows_of[t, j]]) over the j with
    rows_of[t, j] >= 0 (weights None: all 1), [T, hidden] in ``dtype``; weights rounded to
    ``dtype`` first, fp32 sums over j in order, one rounding. A slot without a row adds
    nothing, whatever its weight (also NaN)."""
    if (
        rows_of.dim() == 2
        and _weights_fit(weights, rows_of)
        and _decodes(buf, dtype, wire, hidden, rows_of)
    ):
        return slot_sum_decode_op(buf, rows_of, weights, hidden, dtype, wire)
    return slot_sum_decode_reference(buf, rows_of, weights, hidden, dtype, wire)


def slot_sum_decode_backward(
    grad: torch.Tensor,
    buf: torch.Tensor,
    rows_of: torch.Tensor,
    weights: torch.Tensor,
    n_rows: int,
    wire: str,
    scaling_mode: str = "rceil",
    buf_wire: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of :func:`slot_sum_decode` for grad [T, H]: (a ``wire`` buffer of n_rows
    rows holding encode(w[t, j] * grad[t]) at rows_of[t, j] (the product rounded to grad's
    dtype, weights rounded to it first; other rows zero in the reference, unwritten by the
    kernel), fp32 [T, k] grad of the weights: the fp32 dot product of grad[t] and
    decode(buf[rows_of[t, j]]), 0 where rows_of is -1). buf's rows are of ``buf_wire`` (the
    forward's wire; default ``wire``)."""
    check_scaling_mode(scaling_mode)
    buf_wire = buf_wire or wire
    if (
        grad.dim() == rows_of.dim() == 2
        and rows_of.shape[0] == grad.shape[0]
        and grad.device == buf.device
        and _weights_fit(weights, rows_of)
        and _decodes(buf, grad.dtype, buf_wire, grad.shape[1], rows_of)
        and _kernels(grad.device, grad.dtype, wire, grad.shape[1], rows_of)
    ):
        return slot_sum_decode_backward_op(
            grad, buf, rows_of, weights, n_rows, wire, scaling_mode, buf_wire
        )
    return slot_sum_decode_backward_reference(
        grad, buf, rows_of, weights, n_rows, wire, scaling_mode, buf_wire
    )
