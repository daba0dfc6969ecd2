"""Every term a front end's table says must agree (agreement.TABLES), varied on one rank of
four (gloo): the same error on every rank, within a deadline (no hang, no abort), on the
flat and the node route, host-synced and static (agreement_table_workers.py)."""

from __future__ import annotations

import pytest
from agreement_table_workers import CASES_OF, ON_GPU, ONLY, ROUTES, expected, run_cases
from dist_utils import run_distributed

from mxfp8_a2a.exchange import agreement

HANG = 300  # seconds: far above what a front end's cases take on 2 CPU cores


def _agreed(front: str) -> list[str]:
    return [t.name for t in agreement.TABLES[front] if t.agree]


def test_every_front_end_with_terms_has_cases():
    """A term added to a table without a case here fails this test."""
    fronts = {front for front, terms in agreement.TABLES.items() if any(t.agree for t in terms)}
    assert fronts == set(ROUTES), fronts ^ set(ROUTES)
    for front in ROUTES:
        assert _agreed(front), front
    assert set(ONLY) | set(ON_GPU) <= {(f, t) for f in ROUTES for t in _agreed(f)}


@pytest.mark.parametrize("front", list(ROUTES))
def test_a_term_that_differs_raises_alike_on_every_rank(front):
    terms = [t for t in _agreed(front) if (front, t) not in ON_GPU]
    by_rank = run_distributed(run_cases, 4, front, terms, timeout=HANG)
    cases = list(zip(*by_rank, strict=True))
    assert {(term, route) for (term, route, _), *_ in cases} == set(CASES_OF(front, terms))
    for per_rank in cases:
        term, route = per_rank[0][:2]
        messages = {m for _, _, m in per_rank if m is not None}
        assert len(messages) == 1, (term, route, per_rank)
        message = messages.pop()
        assert message.startswith(f"ValueError: {front}: "), (term, route, message)
        assert expected(front, term, route) in message, (term, route, message)
