"""README.md and the docs/ pages read as a reference: they describe the product as it is and state measured figures
as results with the command that reproduces them, never as a lab book (measuring rounds, a bar to meet, "this
machine", what could be fetched where, what to tune later)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# (what it is, a pattern over the page's text with its line breaks and spaces folded into one space)
LAB_BOOK = [
    ("a measuring round", r"\brounds?\b(?![ -]trips?\b)"),
    ("a bar to meet", r"\bthe bar\b"),
    ("this machine", r"\bthis machine\b"),
    ("what could be fetched where", r"could not be fetched here"),
    ("when it was run again", r"twenty minutes later"),
    ("a later round", r"kept for a later round"),
    ("an instruction to the team", r"\bdo not tune\b"),
]


def _folded(page: Path) -> str:
    return re.sub(r"\s+", " ", page.read_text(encoding="utf-8"))


def lab_book_words(text: str) -> list:
    """Each lab-book phrase in ``text``, with what it is and a little context."""
    found = []
    for what, pattern in LAB_BOOK:
        for match in re.finditer(pattern, text, flags=re.IGNORECASE):
            start = max(0, match.start() - 40)
            found.append(f"{what}: ...{text[start:match.end() + 40]}...")
    return found


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_the_page_has_no_lab_book_words(page):
    if not page.is_file():
        pytest.skip(f"{page.name} is not in this installation")
    assert lab_book_words(_folded(page)) == []


@pytest.mark.parametrize("text,hits", [
    ("Measured in three rounds on the old host.", 1),
    ("within 1.05x in every round measured", 1),
    ("The bar is not met", 1),
    ("about 520 calls/s on this\nmachine", 0),  # folded by _folded, not here: see the next test
    ("its blob could not be fetched here", 1),
    ("the same command again, twenty minutes later", 1),
    ("reserve (kept for a later round; do not tune)", 3),
    ("each manager round trip, round-trips, a crossbar, around the barrier", 0),
])
def test_the_words_are_found_and_a_round_trip_is_not(text, hits):
    assert len(lab_book_words(text)) == hits, lab_book_words(text)


def test_a_phrase_broken_across_lines_is_found(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("about 520 calls/s on this\nmachine, its blob could not\nbe fetched here\n", encoding="utf-8")
    assert len(lab_book_words(_folded(page))) == 2
