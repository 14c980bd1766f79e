"""CONTRIBUTING's worked route (a setting followed from the environment to the admission verdict) stays true: at most
six files, each one there, and every name the route gives for a file still in that file's source."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FILES = 6
NAME = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)(?:\.[A-Za-z0-9_.]+)?`")


def _route() -> list:
    """(file, what happens there) rows of the route's table."""
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    section = text.split("## Following a setting to its decision", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            rows.append((cells[0].strip("`"), cells[1]))
    return rows


def test_the_route_is_at_most_six_files_that_exist():
    files = [path for path, _ in _route()]
    assert files, "no route table under 'Following a setting to its decision'"
    assert len(files) <= MAX_FILES, files
    assert len(set(files)) == len(files), files
    assert not [path for path in files if not (ROOT / path).is_file()]


def test_the_route_count_in_words_matches_the_table():
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    words = {4: "Four", 5: "Five", 6: "Six"}
    assert f"{words[len(_route())]} files to the verdict" in text


def test_every_name_the_route_gives_is_in_its_file():
    missing = []
    for path, what in _route():
        source = (ROOT / path).read_text(encoding="utf-8")
        for name in NAME.findall(what):
            if name.isupper() and name.startswith("FD_"):
                continue  # a variable's name: it is a setting's, read where the key table is
            if not re.search(rf"\b{re.escape(name)}\b", source):
                missing.append(f"{path}: {name}")
    assert not missing, missing


def test_the_name_check_sees_a_stale_name():
    assert NAME.findall("the plan (`StepPlan`) and `SPEC.strategies`") == ["StepPlan", "SPEC"]
