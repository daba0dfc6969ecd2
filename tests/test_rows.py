"""The dispatch engine's row kernels (mxfp8_a2a.moe.row_kernels) against the
plain-torch references of rows.py, bit for bit (NaNs match as NaN): both wires, bf16
and fp32 rows, fresh data of many magnitudes with NaN, inf, zeros, tiny and huge blocks,
random wire bytes for the decoders, odd widths, no tokens, index holes (-1) in permuted
order, both scaling modes; grad_w within fp32 rounding of the reference (it sums in another
order), the same bits on every call."""

from __future__ import annotations

import pytest
import torch
from helpers import KERNEL_DEVICES, fresh_generator, random_blocks, with_specials

from mxfp8_a2a import _config
from mxfp8_a2a.exchange.rows import wire_row
from mxfp8_a2a.moe import row_kernels as sk
from mxfp8_a2a.moe import rows as sr

DTYPES = [torch.bfloat16, torch.float32]

WIRES = ["mxfp8", "bf16"]
SHAPES = [(7, 3, 96), (1, 1, 32), (7, 1, 160), (5, 3, 32), (0, 3, 96)]  # (T, k, H)


@pytest.fixture(autouse=True)
def _small_interpreter_tiles(monkeypatch):
    """Tiles of 256 elements under the interpreter: several programs along the rows too."""
    monkeypatch.setattr(_config, "INTERPRET_STATIC_ROWS_TILE", 256)


def same(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Bit for bit (any NaN matches any NaN: payloads are the hardware's choice)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, what)
    if got.dtype.is_floating_point:
        ints = {2: torch.int16, 4: torch.int32}[got.element_size()]
        ok = (got.view(ints) == want.view(ints)) | (got.isnan() & want.isnan())
    else:
        ok = got == want
    assert bool(ok.all()), (
        f"{what}: {int((~ok).sum())} differ, e.g. {got[~ok][:4]} vs {want[~ok][:4]}"
    )


def rows_data(n, h, dtype, device, g):
    """[n, H] of many magnitudes, special blocks planted when there are 8 rows or more."""
    x = random_blocks((max(n, 8), h), torch.float32, "cpu", g)
    return with_specials(x, g)[torch.randperm(max(n, 8), generator=g)[:n]].to(dtype).to(device)


def slots(t, k, n_rows, g, holes=2):
    """rows_of int64 [T, k]: distinct rows of [0, n_rows) in random order, some -1."""
    rows_of = torch.randperm(n_rows, generator=g)[: t * k].view(t, k)
    if t * k:
        rows_of.view(-1)[torch.randperm(t * k, generator=g)[:holes]] = -1
    return rows_of


def index(n, rows, g):
    """int64 [n]: rows of [0, rows) in random order (repeats too), about a quarter -1."""
    idx = torch.randint(0, max(rows, 1), (n,), generator=g)
    return torch.where((torch.rand(n, generator=g) < 0.25) | (rows == 0), -1, idx)


def wire_buf(n, h, dtype, wire, g):
    """A wire buffer of n rows: random bytes (every e4m3 and scale byte, NaN and 0 scales
    included) for "mxfp8", rows_data for "bf16"."""
    if wire == "mxfp8":
        return torch.randint(0, 256, (n, wire_row(h)), generator=g, dtype=torch.uint8)
    return rows_data(n, h, dtype, "cpu", g)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("shape", SHAPES)
def test_encoders_match_reference(device, dtype, wire, shape):
    t, k, h = shape
    g = fresh_generator()
    x = rows_data(t, h, dtype, device, g)
    n_rows = t * k + 3
    rows_of = slots(t, k, n_rows, g).to(device)
    targeted = rows_of[rows_of >= 0]
    y = rows_data(9, h, dtype, device, g)
    idx = index(11, 9, g).to(device)
    for mode in ("rceil", "floor") if wire == "mxfp8" else ("rceil",):
        what = f"{mode}, seed {g.initial_seed()}"
        got = sr.scatter_encode(x, rows_of, n_rows, wire, mode)
        want = sr.scatter_encode_reference(x, rows_of, n_rows, wire, mode)
        same(got[targeted], want[targeted], f"scatter_encode {what}")
        got = sr.gather_encode(y, idx, wire, mode)
        same(got, sr.gather_encode_reference(y, idx, wire, mode), f"gather_encode {what}")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("shape", SHAPES)
def test_decoders_match_reference(device, dtype, wire, shape):
    """gather_decode and slot_sum_decode, weights None / fp32 / bf16 / fp64, NaN weights on
    slots without a row."""
    t, k, h = shape
    g = fresh_generator()
    n_rows = t * k + 3
    buf = wire_buf(n_rows, h, dtype, wire, g).to(device)
    idx = index(13, n_rows, g).to(device)
    what = f"seed {g.initial_seed()}"
    got = sr.gather_decode(buf, idx, h, dtype, wire)
    same(got, sr.gather_decode_reference(buf, idx, h, dtype, wire), f"gather_decode {what}")
    rows_of = slots(t, k, n_rows, g)
    w = torch.rand(t, k, generator=g) * 4 - 1
    w[rows_of < 0] = float("nan")
    rows_of, w = rows_of.to(device), w.to(device)
    for weights in (None, w, w.bfloat16(), w.double()):
        got = sr.slot_sum_decode(buf, rows_of, weights, h, dtype, wire)
        want = sr.slot_sum_decode_reference(buf, rows_of, weights, h, dtype, wire)
        same(got, want, f"slot_sum_decode {None if weights is None else weights.dtype} {what}")


def _backward_case(t, k, h, dtype, wire, device, g, special):
    """(grad [T, H], buf, rows_of, weights (NaN where rows_of is -1), n_rows); ``special``:
    special values in grad and random wire bytes, else finite data whose products and sums
    stay normal fp32 (for grad_w's tolerance)."""
    n_rows = t * k + 3
    if special:
        buf, grad = wire_buf(n_rows, h, dtype, wire, g), rows_data(t, h, dtype, "cpu", g)
    else:
        buf = sr.encode(random_blocks((n_rows, h), dtype, "cpu", g), wire)
        grad = torch.randn(t, h, generator=g) * 2.0 ** torch.randint(-20, 20, (t, 1), generator=g)
    rows_of = slots(t, k, n_rows, g)
    w = torch.rand(t, k, generator=g) * 4 - 1
    w[rows_of < 0] = float("nan")
    return grad.to(dtype).to(device), buf.to(device), rows_of.to(device), w.to(device), n_rows


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_matches_reference(device, dtype, wire, shape):
    """The rows' gradient bit for bit (both modes); grad_w 0 for slots without a row, the
    same bits on every call, within fp32 rounding of the reference (which sums in another
    order)."""
    t, k, h = shape
    g = fresh_generator()
    grad, buf, rows_of, w, n_rows = _backward_case(t, k, h, dtype, wire, device, g, True)
    targeted = rows_of[rows_of >= 0]
    for mode in ("rceil", "floor") if wire == "mxfp8" else ("rceil",):
        what = f"{mode}, seed {g.initial_seed()}"
        got, gw = sr.slot_sum_decode_backward(grad, buf, rows_of, w, n_rows, wire, mode)
        want, _ = sr.slot_sum_decode_backward_reference(grad, buf, rows_of, w, n_rows, wire, mode)
        same(got[targeted], want[targeted], f"grad rows {what}")
    assert gw.dtype == torch.float32 and gw.shape == (t, k) and not gw[rows_of < 0].any()
    same(sr.slot_sum_decode_backward(grad, buf, rows_of, w, n_rows, wire, mode)[1], gw, what)
    grad, buf, rows_of, w, n_rows = _backward_case(t, k, h, dtype, wire, device, g, False)
    _, gw = sr.slot_sum_decode_backward(grad, buf, rows_of, w, n_rows, wire)
    _, gw_ref = sr.slot_sum_decode_backward_reference(grad, buf, rows_of, w, n_rows, wire)
    rows = sr.gather_decode_reference(buf, rows_of.reshape(-1), h, dtype, wire)
    prods = grad.double()[:, None, :] * rows.double().view(t, k, h)
    tol = h * 2**-24 * prods.abs().sum(-1)  # h roundings (products, sums in any order)
    assert ((gw.double() - prods.sum(-1)).abs() <= tol).all(), f"grad_w, {what}"
    assert ((gw.double() - gw_ref.double()).abs() <= 2 * tol).all(), f"grad_w, {what}"


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wires", [("mxfp8", "bf16"), ("bf16", "mxfp8")], ids=str)
@pytest.mark.parametrize("shape", [(7, 3, 96), (5, 1, 32), (0, 3, 64)])
def test_backward_on_another_wire_than_the_forward(device, dtype, wires, shape):
    """Combine's backward with its own wire (``wire``) and the forward's rows on the other
    (``buf_wire``, a per-leg preset such as "mxfp8_to_experts"): the rows bit for bit, grad_w
    within fp32 rounding, as with one wire."""
    (wire, buf_wire), (t, k, h) = wires, shape
    g = fresh_generator()
    grad, buf, rows_of, w, n_rows = _backward_case(t, k, h, dtype, buf_wire, device, g, False)
    targeted = rows_of[rows_of >= 0]
    got, gw = sr.slot_sum_decode_backward(grad, buf, rows_of, w, n_rows, wire, "rceil", buf_wire)
    want, gw_ref = sr.slot_sum_decode_backward_reference(
        grad, buf, rows_of, w, n_rows, wire, "rceil", buf_wire
    )
    same(got[targeted], want[targeted], f"grad rows, seed {g.initial_seed()}")
    rows = sr.gather_decode_reference(buf, rows_of.reshape(-1), h, dtype, buf_wire)
    prods = grad.double()[:, None, :] * rows.double().view(t, k, h)
    tol = h * 2**-24 * prods.abs().sum(-1)
    assert ((gw.double() - gw_ref.double()).abs() <= 2 * tol).all()
    assert not gw[rows_of < 0].any()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("tiles", [((0, 2048, False),), ((0, 4096, True),)], ids=str)
@pytest.mark.parametrize("wire", WIRES)
def test_backward_tiles_and_prefetch(device, tiles, wire, monkeypatch):
    """The combine backward at the other STATIC_BACKWARD_TILES choices: the same rows."""
    monkeypatch.setattr(_config, "STATIC_BACKWARD_TILES", tiles)
    t, k, h = 7, 3, 96
    g = fresh_generator()
    grad, buf, rows_of, w, n_rows = _backward_case(t, k, h, torch.bfloat16, wire, device, g, True)
    got, _ = sr.slot_sum_decode_backward(grad, buf, rows_of, w, n_rows, wire)
    want, _ = sr.slot_sum_decode_backward_reference(grad, buf, rows_of, w, n_rows, wire)
    targeted = rows_of[rows_of >= 0]
    same(got[targeted], want[targeted], f"{tiles}, seed {g.initial_seed()}")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("wire", WIRES)
def test_empty_sizes(device, wire):
    """T = 0, k = 0, n_rows = 0, R = 0, N = 0 and buffers without rows: no launch, the
    reference's shapes and zeros."""
    g = fresh_generator()
    h, dt = 64, torch.bfloat16
    x = rows_data(4, h, dt, device, g)
    buf = sr.encode(x, wire)
    none = torch.full((4, 2), -1, dtype=torch.int64, device=device)
    no_slots = torch.zeros((4, 0), dtype=torch.int64, device=device)
    w0 = torch.zeros((4, 0), device=device)
    assert sr.scatter_encode(x, no_slots, 5, wire).shape == sk.wire_shape(5, h, dt, wire)[0]
    assert sr.scatter_encode(x, none, 0, wire).shape[0] == 0
    assert sr.scatter_encode(x[:0], none[:0], 3, wire).shape[0] == 3
    empty_idx = torch.zeros(0, dtype=torch.int64, device=device)
    all_holes = torch.full((3,), -1, dtype=torch.int64, device=device)
    for y, idx in ((x, empty_idx), (x[:0], all_holes)):
        same(sr.gather_encode(y, idx, wire), sr.gather_encode_reference(y, idx, wire))
    for b, idx in ((buf, empty_idx), (buf[:0], all_holes)):
        same(sr.gather_decode(b, idx, h, dt, wire), sr.gather_decode_reference(b, idx, h, dt, wire))
    for b, rows_of, w in ((buf, no_slots, w0), (buf[:0], none, None), (buf, none[:0], None)):
        got = sr.slot_sum_decode(b, rows_of, w, h, dt, wire)
        same(got, sr.slot_sum_decode_reference(b, rows_of, w, h, dt, wire))
    grad = rows_data(4, h, dt, device, g)
    for b, rows_of, w in ((buf, no_slots, w0), (buf[:0], none, none.float())):
        out, gw = sr.slot_sum_decode_backward(grad, b, rows_of, w, b.shape[0], wire)
        assert out.shape[0] == b.shape[0] and gw.shape == rows_of.shape and not gw.any()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_which_path(device, monkeypatch):
    """bf16 / fp32 rows take the ops (the kernels where they run, else the references in
    the op), fp16 rows (and int32 indices) the references outside any op."""
    taken = []
    names = ("scatter_encode", "gather_encode", "gather_decode", "slot_sum_decode")
    for mod, name in [(sr, n) for n in (*names, "slot_sum_decode_backward")]:
        fn = getattr(mod, f"{name}_op")  # the custom ops (eager calls take them too)
        monkeypatch.setattr(
            mod, f"{name}_op", lambda *a, _f=fn, _n=name: taken.append(_n) or _f(*a)
        )
    g = fresh_generator()
    for dt in (torch.bfloat16, torch.float32, torch.float16):
        x = rows_data(3, 32, dt, device, g)
        rows_of = slots(3, 2, 6, g, holes=0).to(device)
        w = torch.rand(3, 2, generator=g).to(device)
        buf = sr.scatter_encode(x, rows_of, 6, "bf16")
        sr.gather_encode(x, torch.tensor([2, -1, 0], device=device), "bf16")
        sr.gather_decode(buf, rows_of[:, 0], 32, dt, "bf16")
        sr.slot_sum_decode(buf, rows_of, None, 32, dt, "bf16")
        sr.slot_sum_decode_backward(x, buf, rows_of, w, 6, "bf16")
    assert len(taken) == 10 and taken[:5] == taken[5:], taken
    sr.gather_decode(buf.bfloat16(), rows_of[:, 0].int(), 32, torch.bfloat16, "bf16")
    assert len(taken) == 10, taken


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("wire", WIRES)
def test_ops_pass_opcheck(device, wire):
    """Fake shapes and dtypes of the custom ops (finite data, every buffer row written:
    opcheck compares eager and traced outputs)."""
    g = fresh_generator()
    t, k, h = 3, 2, 64
    x = torch.randn(t, h, generator=g).bfloat16().to(device)
    rows_of = slots(t, k, t * k, g, holes=0).to(device)
    buf = sr.encode(x.repeat_interleave(k, 0), wire)
    w = torch.rand(t, k, generator=g).to(device)
    idx = rows_of.view(-1)
    for op, args in (
        (sr.scatter_encode_op, (x, rows_of, t * k, wire, "rceil")),
        (sr.gather_encode_op, (x, torch.where(idx < t, idx, -1), wire, "floor")),
        (sr.gather_decode_op, (buf, idx, h, torch.float32, wire)),
        (sr.slot_sum_decode_op, (buf, rows_of, w, h, torch.bfloat16, wire)),
        (sr.slot_sum_decode_op, (buf, rows_of, None, h, torch.bfloat16, wire)),
        (sr.slot_sum_decode_backward_op, (x, buf, rows_of, w, t * k, wire, "rceil", wire)),
    ):
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_torch_compile_fullgraph(device):
    """The five functions trace (fullgraph) as the custom ops and give the eager bits."""
    g = fresh_generator()
    t, k, h, wire = 5, 2, 96, "mxfp8"
    x = rows_data(t, h, torch.bfloat16, device, g)
    rows_of = slots(t, k, t * k, g, holes=0).to(device)  # (every buffer row written)
    w = torch.rand(t, k, generator=g).to(device)

    def five(x, rows_of, w):
        buf = sr.scatter_encode(x, rows_of, t * k, wire)
        y = sr.gather_decode(buf, rows_of[:, 0], h, torch.bfloat16, wire)
        back = sr.gather_encode(y, rows_of.view(-1) % t, wire, "floor")
        out = sr.slot_sum_decode(back, rows_of, w, h, torch.float32, wire)
        return buf, y, back, out, *sr.slot_sum_decode_backward(x, back, rows_of, w, t * k, wire)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        name = "inductor" if device == "cuda" else "aot_eager"
        return torch._dynamo.lookup_backend(name)(gm, example_inputs)

    torch._dynamo.reset()
    got = torch.compile(five, fullgraph=True, backend=backend)(x, rows_of, w)
    for a, b in zip(got, five(x, rows_of, w), strict=True):
        same(a, b)
    ops = (
        "scatter_encode",
        "gather_encode",
        "gather_decode",
        "slot_sum_decode",
        "slot_sum_decode_backward",
    )
    for name in ops:
        assert f"mxfp8_a2a.moe_{name}.default" in graphs[0], graphs[0]


@pytest.mark.parametrize("device", KERNEL_DEVICES[1:])
def test_addresses_past_2gb(device):
    """Rows past 2**31 bytes (CUDA only: the buffer takes 2 GiB)."""
    g = fresh_generator()
    h = 32
    n_rows = 2**31 // wire_row(h) + 64
    x = rows_data(8, h, torch.bfloat16, device, g)
    rows_of = torch.arange(n_rows - 16, n_rows, device=device).view(8, 2)
    buf = sr.scatter_encode(x, rows_of, n_rows, "mxfp8")
    want = sr.encode(x, "mxfp8").repeat_interleave(2, 0)
    same(buf[n_rows - 16 :], want)
    got = sr.gather_decode(buf, rows_of[:, 1], h, torch.bfloat16, "mxfp8")
    same(got, sr.decode(want[1::2], h, torch.bfloat16, "mxfp8"))
