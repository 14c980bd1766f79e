"""README.md and the docs/ pages read as a reference: they describe the product as it is, never as a lab book
(measuring rounds, a bar to meet, "this machine", what could be fetched where, what to tune later). Measured figures
live in results pages (docs/results/), each with the date and the plugin commit it was measured on and the command
that reproduces it; a reference page carries no dated measurement and no commit of the plugin."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = sorted((ROOT / "docs" / "results").glob("*.md"))
PAGES = REFERENCE + RESULTS
# docs/reach.md opens with the date and hosts its summary was measured on (its tables: docs/results/reach.md)
REPORTS = {"reach.md"}
# commits a reference page may name that are not FastDeploy's supported hosts: sources cited (Vidur's profiles)
CITED_COMMITS = {"7d47513363ec", "7ac2fe9fb6ce"}
MEASURED = re.compile(r"^Measured (\d{4}-\d{2}-\d{2})(?: to (\d{4}-\d{2}-\d{2}))? on plugin commits? ([0-9a-f]{7,40})",
                      re.M)

# (what it is, a pattern over the page's text with its line breaks and spaces folded into one space)
LAB_BOOK = [
    ("a measuring round", r"\brounds?\b(?![ -]trips?\b)"),
    ("a bar to meet", r"\bthe bar\b"),
    ("this machine", r"\bthis machine\b"),
    ("what could be fetched where", r"could not be fetched here"),
    ("when it was run again", r"twenty minutes later"),
    ("a later round", r"kept for a later round"),
    ("an instruction to the team", r"\bdo not tune\b"),
    ("a tracker's number", r"\bissues? #?\d+"),
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
    ("as asked in issue 18 (and issue #7)", 2),
    ("an issue the operator must fix", 0),
])
def test_the_words_are_found_and_a_round_trip_is_not(text, hits):
    assert len(lab_book_words(text)) == hits, lab_book_words(text)


def test_a_phrase_broken_across_lines_is_found(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("about 520 calls/s on this\nmachine, its blob could not\nbe fetched here\n", encoding="utf-8")
    assert len(lab_book_words(_folded(page))) == 2


def dated_measurements(text: str) -> list:
    """Every 'measured ... <date>' or 'plugin commit <hash>' in a page's folded text."""
    return [m.group(0) for m in re.finditer(r"\bmeasured\b[^.]{0,60}?\b20\d\d-\d\d-\d\d\b|\bplugin commits? [0-9a-f]{7,40}\b",
                                            text, flags=re.IGNORECASE)]


def foreign_commits(text: str) -> list:
    """Hex words of 7-40 characters (letters and digits both) that are neither a supported host's commit nor a
    cited source's."""
    from fdsched.install.hosts import KNOWN_HOSTS

    found = []
    for word in re.findall(r"(?<![\w/.-])[0-9a-f]{7,40}(?![\w/.-])", text):
        if not (re.search(r"[a-f]", word) and re.search(r"\d", word)):
            continue
        if any(commit.startswith(word) for commit in KNOWN_HOSTS) or word in CITED_COMMITS:
            continue
        found.append(word)
    return found


@pytest.mark.parametrize("page", [p for p in REFERENCE if p.name not in REPORTS], ids=lambda p: p.name)
def test_a_reference_page_carries_no_dated_measurement_and_no_plugin_commit(page):
    if not page.is_file():
        pytest.skip(f"{page.name} is not in this installation")
    text = _folded(page)
    assert dated_measurements(text) == [], f"{page.name}: a dated measurement belongs in a page of docs/results/"
    assert foreign_commits(text) == [], f"{page.name}: a commit that is no supported host's"


@pytest.mark.parametrize("page", RESULTS, ids=lambda p: p.name)
def test_a_results_page_says_when_on_which_commit_and_how_to_reproduce(page):
    text = page.read_text(encoding="utf-8")
    head = "\n".join(text.splitlines()[:15])
    found = MEASURED.search(head)
    assert found, f"results/{page.name}: its first screen has no 'Measured <date> on plugin commit <hash>' line"
    assert re.search(r"`e7c8dc2`|`d38eeb8`", head), f"results/{page.name}: its first screen names no host"
    assert tables_without_a_command(text) == [], f"results/{page.name}: a table whose section shows no command"
    assert lab_book_words(_folded(page)) == []


COMMAND = re.compile(r"`(?:fdsched |python -m (?:fdsched|pytest))[^`]*`|^\s*(?:fdsched|python -m) ", re.M)


def tables_without_a_command(text: str) -> list:
    """The line numbers of tables whose section (from its '## ' heading to the table) shows no command that
    reproduces them (`fdsched ...`, `python -m fdsched...`, `python -m pytest ...`)."""
    lines, missing, section, in_table = text.splitlines(), [], 0, False
    for number, line in enumerate(lines):
        if line.startswith("## "):
            section = number
        if line.startswith("|---") and not in_table:
            in_table = True
            if not COMMAND.search("\n".join(lines[section:number])):
                missing.append(number + 1)
        elif not line.startswith("|"):
            in_table = False
    return missing


def test_a_table_without_a_command_in_its_section_is_found():
    text = ("# R\n\n## A\n\n`fdsched eval --out DIR`:\n\n| a |\n|---|\n| 1 |\n\n### A, again\n\n| b |\n|---|\n| 2 |\n"
            "\n## B\n\nMeasured by hand.\n\n| c |\n|---|\n| 3 |\n")
    assert tables_without_a_command(text) == [22]


def test_the_results_pages_exist():
    assert {p.name for p in RESULTS} >= {"evaluation.md", "schedule-cpu.md", "peak-admission.md"}


@pytest.mark.parametrize("text,found", [
    ("Measured 2026-11-24 on plugin commit 175f92e, hosts old and new.", 2),
    ("The table was measured on 2026-11-24.", 1),
    ("measured on the old host, 1.02x", 0),
    ("the data: the Azure trace from 2023-11-16", 0),
])
def test_dated_measurements_are_found(text, found):
    assert len(dated_measurements(text)) == found, dated_measurements(text)


def test_foreign_commits_are_found_and_the_hosts_are_not():
    assert foreign_commits("old e7c8dc2, new d38eeb8334331b903fb34c9cd270ff0c58a48adf, Vidur 7d47513363ec") == []
    assert foreign_commits("fixed in 175f92e; see a1b2c3d4") == ["175f92e", "a1b2c3d4"]
    assert foreign_commits("1234567 requests, a cafebabe, fdsched/core/abc1234.py") == []


def test_every_plugin_commit_a_results_page_names_is_in_the_history():
    """A results page's 'measured on plugin commit X' must name a commit of this repository (checked where the
    checkout has its git history)."""
    import shutil
    import subprocess

    if shutil.which("git") is None or subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--git-dir"],
                                                     capture_output=True).returncode != 0:
        pytest.skip("no git history here (an sdist or an exported tree)")
    shallow = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True,
                             text=True).stdout.strip()
    if shallow == "true":
        pytest.skip("a shallow clone: older commits are not here")
    named = {word for page in RESULTS for word in foreign_commits(page.read_text(encoding="utf-8"))}
    assert named, "the results pages name no plugin commit"
    unknown = sorted(word for word in named if subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", f"{word}^{{commit}}"], capture_output=True).returncode != 0)
    assert unknown == [], f"results pages name commits this history does not have: {unknown}"
