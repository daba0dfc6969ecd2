"""Both FP8 copies of expert weights in one op (mxfp8_a2a.grouped.weight_scales) against
their definitions: the forward's copy per (expert, column) as expert_column_reference, grad_x's
per (expert, row) as the per-group reference with one group spanning each row; bit for bit on
data of many magnitudes with NaN, inf, zeros, tiny and huge values in several experts, several
programs per expert, rows wider than the kernel's limit, bad input, the scales returned as
reciprocals, and grouped_mm's forward making both copies of a large weight."""

from __future__ import annotations

import pytest
import torch
from emulated_gemm import _emulated_op
from grouped_mm_data import _fwd_bwd, _inputs, fr, gm, needs_interpreter
from helpers import KERNEL_DEVICES, bits, fresh_generator
from per_group_data import make_input

from mxfp8_a2a import _config, grouped_mm
from mxfp8_a2a.grouped import weight_scales as ws
from mxfp8_a2a.grouped.reference import expert_column_reference, per_group_rowwise_reference


def _weights(e, k, n, dtype, device, g):
    """[E, K, N] with special values planted in every expert's first rows."""
    w = torch.cat([make_input((k, n), torch.float32, "cpu", g) for _ in range(e)])
    return w.view(e, k, n).to(dtype).to(device)


def _assert_matches_definitions(w, got):
    e, k, n = w.shape
    by_column, col_s, by_row, row_s = got
    want_c, want_cs = expert_column_reference(w)
    assert by_column.dtype == torch.float8_e4m3fn and by_column.stride() == (n * k, 1, k)
    assert torch.equal(bits(by_column), bits(want_c))
    torch.testing.assert_close(col_s, want_cs, rtol=0, atol=0, equal_nan=True)
    whole = torch.full((1,), n, dtype=torch.int32, device=w.device)
    want_r, want_rs = per_group_rowwise_reference(w.reshape(e * k, n), whole)
    assert by_row.shape == (e, n, k) and by_row.stride() == (k * n, 1, n)
    assert torch.equal(bits(by_row.transpose(1, 2).reshape(e * k, n)), bits(want_r))
    torch.testing.assert_close(row_s, want_rs.view(e, k), rtol=0, atol=0, equal_nan=True)


@pytest.fixture(params=["shipped", "small"])
def tiling(request, monkeypatch):
    """The shipped tiling, or one with small steps and several programs per expert."""
    if request.param == "small":
        monkeypatch.setattr(_config, "ROW_SCALES_TILE", 256)
        monkeypatch.setattr(_config, "WEIGHT_SCALES_ROWS", 16)
    return request.param


# Under the interpreter the colwise cast's time goes with N / 16 (its strips): there, rows of
# 520 and 4104 columns stand for 1000 and 7168 (the same row blocks: 1024 and 8192 columns).
INTERPRETER_N = {1000: 520, 7168: 4104}


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 72, 40), (2, 37, 1000), (1, 5, 7168), (4, 33, 16)])
def test_weight_scales_match_definitions(device, dtype, shape, tiling):
    if device == "cpu":
        shape = (*shape[:2], INTERPRETER_N.get(shape[2], shape[2]))
    w = _weights(*shape, dtype, device, fresh_generator())
    _assert_matches_definitions(w, ws.weight_scales(w))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_weight_scales_program_counts(device, monkeypatch):
    """Rows per program halve (in steps of whole row blocks) until the launch has enough
    programs, never below one block; results do not depend on it."""
    monkeypatch.setattr(_config, "WEIGHT_SCALES_ROWS", 128)
    monkeypatch.setattr(_config, "WEIGHT_SCALES_MIN_PROGRAMS", 64)
    assert ws._rows_per_program(7168, 32, 4) == 128  # 56 * 32 programs already
    assert ws._rows_per_program(512, 4, 4) == 32  # 16 * 4
    assert ws._rows_per_program(512, 4, 48) == 48  # one block at least
    w = _weights(2, 100, 24, torch.bfloat16, device, fresh_generator())
    _assert_matches_definitions(w, ws.weight_scales(w))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_weight_scales_wide_rows_and_empty(device, monkeypatch):
    """Rows wider than the row kernel's limit take the two casts apart: the same numbers;
    an empty K gives empty copies."""
    monkeypatch.setattr(_config, "ROW_SCALES_MAX_WIDTH", 32)
    w = _weights(2, 40, 48, torch.bfloat16, device, fresh_generator())
    _assert_matches_definitions(w, ws.weight_scales(w))
    empty = ws.weight_scales(torch.zeros(3, 0, 16, dtype=torch.bfloat16, device=device))
    assert [t.shape for t in empty] == [(3, 0, 16), (3, 16), (3, 16, 0), (3, 0)]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_weight_scales_inverse(device, monkeypatch):
    """inverse=True: the same copies, both scales as torch.reciprocal gives them, in the one
    op and in the casts apart (rows wider than the row kernel's limit)."""
    w = _weights(3, 40, 48, torch.bfloat16, device, fresh_generator())
    w[1, 7, 5] = float("inf")  # zero scales in a row and a column: inf multipliers
    for width in (_config.ROW_SCALES_MAX_WIDTH, 32):
        monkeypatch.setattr(_config, "ROW_SCALES_MAX_WIDTH", width)
        plain, inv = ws.weight_scales(w), ws.weight_scales(w, inverse=True)
        for a, b in zip(plain[::2], inv[::2], strict=True):
            assert torch.equal(bits(a), bits(b)) and a.stride() == b.stride()
        for a, b in zip(plain[1::2], inv[1::2], strict=True):
            torch.testing.assert_close(b, a.reciprocal(), rtol=0, atol=0, equal_nan=True)


def test_weight_scales_bad_input():
    with pytest.raises(ValueError, match="contiguous 3-D bf16 or fp32"):
        ws.weight_scales(torch.randn(4, 8))
    with pytest.raises(ValueError, match="contiguous 3-D bf16 or fp32"):
        ws.weight_scales(torch.randn(2, 16, 8).transpose(1, 2))
    with pytest.raises(ValueError, match="contiguous 3-D bf16 or fp32"):
        ws.weight_scales(torch.randn(2, 8, 16, dtype=torch.float16))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_weight_scales_op_passes_opcheck(device):
    w = _weights(2, 40, 32, torch.bfloat16, device, fresh_generator())
    torch.library.opcheck(ws._weight_scales_op, (w,), test_utils=("test_schema", "test_faketensor"))


@needs_interpreter
@pytest.mark.parametrize("precision", ["fp8_rowwise", "fp8_rowwise_gw_hp"])
def test_grouped_mm_casts_large_weights_in_one_pass(monkeypatch, precision):
    """grouped_mm's CUDA FP8 path (GEMM emulated) with w above the size from which the
    forward makes both copies of w at once and keeps grad_x's: the same bits as casting per
    use; the backward then casts no weight."""
    monkeypatch.setattr(fr, "_scaled_gmm", _emulated_op)
    monkeypatch.setattr(gm, "gemm_path", lambda x, precision: "scaled")
    args = _inputs(61, 32, 48, 4, "with_empty", torch.bfloat16, "cpu", fresh_generator())
    fn = lambda x, w, o: grouped_mm(x, w, o, precision=precision)  # noqa: E731
    per_use = _fwd_bwd(fn, *args)
    monkeypatch.setattr(_config, "WEIGHT_SCALES_IN_FORWARD_FROM", 0)
    per_row, both = [], fr.weight_scales
    monkeypatch.setattr(fr, "_weights_per_row", lambda w: per_row.append(w) or None)
    monkeypatch.setattr(fr, "weight_scales", lambda w, **k: per_row.append("both") or both(w, **k))
    for a, b in zip(_fwd_bwd(fn, *args), per_use, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert per_row == ["both"]
