"""A module's docstring says what the module does and why in one screen; a longer explanation lives in a docs page
the docstring names (CONTRIBUTING.md, step 1a). Read from the source of plugin/ (fdsched) and patches/
(fdsched.patches), so a module that cannot be imported without a host is checked too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for folder in ("plugin", "patches") for p in (ROOT / folder).rglob("*.py"))
SCREEN = 40  # lines of the docstring's text, its first and last line included


def docstring_lines(path: Path) -> int:
    """How many lines the module docstring's text spans (0 without one)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
    return len(doc.splitlines()) if doc else 0


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_the_sources_are_found():
    names = {_rel(p) for p in SOURCES}
    assert {"plugin/core/settings.py", "patches/ratio_reserve/__init__.py", "patches/deferred_recycle.py"} <= names


@pytest.mark.parametrize("path", SOURCES, ids=_rel)
def test_module_docstrings_fit_one_screen(path):
    lines = docstring_lines(path)
    assert lines <= SCREEN, (f"{_rel(path)}: the module docstring spans {lines} lines (at most {SCREEN}); move the "
                             "long explanation into a docs page and name it in the docstring")


def test_the_limit_counts_every_line(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""One.\n\n' + "x\n" * (SCREEN - 2) + '"""\n\nVALUE = 1\n', encoding="utf-8")
    assert docstring_lines(module) == SCREEN
    module.write_text('"""One.\n\n' + "x\n" * (SCREEN - 1) + '"""\n', encoding="utf-8")
    assert docstring_lines(module) == SCREEN + 1
    module.write_text("VALUE = 1\n", encoding="utf-8")
    assert docstring_lines(module) == 0


@pytest.mark.parametrize("path", SOURCES, ids=_rel)
def test_a_page_a_docstring_points_to_exists(path):
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False) or ""
    for page in re.findall(r"\b((?:docs|examples)/[\w./-]+\.md)\b", doc):
        assert (ROOT / page).is_file(), f"{_rel(path)}: its docstring names {page}, which does not exist"


@pytest.mark.parametrize("path", SOURCES, ids=_rel)
def test_a_section_a_docstring_points_to_is_a_heading_of_that_page(path):
    doc = re.sub(r"\s+", " ", ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False) or "")
    for page, section in re.findall(r"\b((?:docs|examples)/[\w./-]+\.md), \"([^\"]+)\"", doc):
        headings = re.findall(r"^#+ (.+)$", (ROOT / page).read_text(encoding="utf-8"), re.M)
        assert any(section in heading for heading in headings), f"{_rel(path)}: {page} has no section {section!r}"


@pytest.mark.parametrize("path", SOURCES, ids=_rel)
def test_the_source_names_no_tracker_number(path):
    """Docstrings and comments say what the code does, not which ticket asked for it (that is the commit's job)."""
    found = re.findall(r"\bissues? #?\d+", path.read_text(encoding="utf-8"), flags=re.IGNORECASE)
    assert found == [], f"{_rel(path)}: {found}"
