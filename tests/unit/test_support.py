"""fdsched host support: the support tables are made from CI's rows, and a page that says otherwise fails."""

from __future__ import annotations

import json
from types import SimpleNamespace

from fdsched.core.settings import CHANGE_IDS, HOST_FIXES
from fdsched.tools.support import MARKERS, cmd_support, detail_table, refused_row, summary_table

HF = len(HOST_FIXES)  # every host fix applied in these rows


def _row(line, commit, states, refused=(), tier="compat"):
    states = list(states) + ["applied"] * (len(CHANGE_IDS) - len(states))  # the host fixes: applied
    changes = {c: {"state": s, "why": "X.y is missing" if s == "declined" else ""} for c, s in zip(CHANGE_IDS, states)}
    return {"line": line, "commit": commit, "tier": tier, "changes": changes, "refused_profiles": list(refused)}


ROWS = [
    _row("develop", "c" * 40, ["applied", "in host", "in host", "applied", "applied"]),
    _row("2.4", "f" * 40, ["applied", "declined", "declined", "applied", "applied"], refused=("recommended",)),
    refused_row("2.0", "a" * 40, "no V1 scheduler"),
]


def test_the_summary_counts_what_applies_and_orders_lines_oldest_first():
    lines = summary_table(ROWS).splitlines()
    assert [line.split("|")[1].strip() for line in lines[2:]] == ["2.0", "2.4", "develop"]
    assert f"| 2.4 | `fffffff` | compatibility tier | 3 of 5 | {HF} of {HF} | recommended |" in lines
    assert f"| develop | `ccccccc` | compatibility tier | 3 of 5 (+2 in the host) | {HF} of {HF} | none |" in lines
    assert lines[2].startswith("| 2.0 | `aaaaaaa` | set-up refuses | none: no V1 scheduler")


def test_the_detail_numbers_every_decline_with_its_reason():
    text = detail_table(ROWS)
    assert "| decode_only_preempt | declined (1) | in host |" in text
    assert "| ratio_reserve | declined (2) | in host |" in text
    assert "1. decode_only_preempt on 2.4 `fffffff`: X.y is missing" in text
    assert "2.0 `aaaaaaa`: `fdsched host setup` refuses it: no V1 scheduler." in text


def test_check_fails_when_a_page_differs_and_passes_when_it_matches(tmp_path, capsys):
    paths = []
    for i, row in enumerate(ROWS):
        path = tmp_path / f"row{i}.json"
        path.write_text(json.dumps(row), encoding="utf-8")
        paths.append(str(path))
    start, end = MARKERS["summary"]
    page = tmp_path / "README.md"
    page.write_text(f"intro\n{start}\n{summary_table(ROWS)}\n{end}\n", encoding="utf-8")
    args = SimpleNamespace(rows=paths, check=[str(page)], json=None, refused=None)
    assert cmd_support(args) == 0
    page.write_text(f"intro\n{start}\n| stale |\n{end}\n", encoding="utf-8")
    assert cmd_support(args) == 1
    assert "the summary table differs from what CI ran" in capsys.readouterr().err
    page.write_text("no markers\n", encoding="utf-8")
    assert cmd_support(args) == 1
