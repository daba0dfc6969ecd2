"""The launch helpers' grid arithmetic (formats/launch.py, _common): cdiv and next_pow2 give
triton's numbers."""

from __future__ import annotations

import triton

from mxfp8_a2a._common import cdiv, next_pow2


def test_host_integer_helpers_match_triton():
    values = list(range(0, 70)) + [2**k + d for k in range(6, 40) for d in (-1, 0, 1)]
    for a in values:
        assert next_pow2(a) == triton.next_power_of_2(a), a
        for b in (1, 2, 3, 16, 32, 128, 256, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
