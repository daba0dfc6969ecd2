"""The figures README.md and BENCHMARKS.md quote are the ones benchmarks/figures.py computes
from the results files."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import figures  # noqa: E402


def test_every_figure_is_quoted_as_computed():
    assert figures.missing() == []


def test_every_figure_has_a_card_and_date():
    for f in figures.FIGURES:
        assert "20" in figures.card(f.source), f.name  # a date in the card line


def test_every_results_file_is_cited():
    assert figures.uncited() == []
