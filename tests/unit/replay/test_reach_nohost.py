"""The reach command's parts that need no host: its output folder, its grid options and its table."""

from __future__ import annotations

import json

import pytest

from fdsched.replay import reach


def test_a_folder_holding_files_it_did_not_write_is_refused_untouched(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine\n", encoding="utf-8")
    assert reach.main(["--quick", "--out", str(tmp_path)]) == 1
    assert "did not write: notes.txt" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("argv, says", [
    (["--traces", "no-such-trace"], "--traces: bad value 'no-such-trace' (unknown)"),
    (["--window", "0"], "--window: bad value 0"),
    (["--seats", "4", "0"], "--seats: bad value 0"),
    ([], "--out: missing"),
])
def test_a_bad_option_is_refused_in_one_line_before_anything_runs(tmp_path, capsys, argv, says):
    out = ["--out", str(tmp_path / "out")] if argv else []
    assert reach.main(argv + out) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("failure, cell", [
    (None, "ok"),
    (("blocks", "step 3: block 7 both free and in use", ""), "blocks"),
    (("stall", "running 0", "preempted requests hold every seat"), "stall (seats)"),
    (("stall", "running 2", ""), "stall"),
])
def test_a_cell_names_the_defect(failure, cell):
    assert reach.cell_of(failure) == cell


def test_the_table_has_a_row_per_shape_and_a_column_per_arm(tmp_path):
    cells = {"host alone": {"cell": "stall (seats)"}, "baseline": {"cell": "ok"}}
    rows = [{"trace": "t", "requests": 60, "of": 191, "seats": 4, "pool_factor": 0.5, "working_set": 100,
             "pool": 258, "role": "mixed", "cells": cells},
            {"trace": "t", "requests": 60, "of": 191, "seats": 4, "pool_factor": 2.0, "working_set": 200,
             "pool": 400, "role": "mixed", "cells": cells}]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"rows": rows}), encoding="utf-8")
    table = reach.markdown(json.loads(path.read_text(encoding="utf-8"))).splitlines()
    assert table[0] == "| trace (window) | max_num_seqs | pool (x working set) | host alone | baseline |"
    assert table[2] == "| t (first 60 of 191) | 4 | 258 (the host's minimum): 0.5x of 100 | stall (seats) | ok |"
    assert table[3] == "| t (first 60 of 191) | 4 | 400: 2x of 200 | stall (seats) | ok |"


def test_the_summary_counts_the_shapes_that_show_each_defect():
    def row(trace, role, cells):
        return {"trace": trace, "requests": 60, "of": 64, "seats": 4, "pool_factor": 1.0, "working_set": 100,
                "pool": 258, "role": role, "cells": {arm: {"cell": cell} for arm, cell in cells.items()}}

    rows = [row("a", "mixed", {"host alone": "stall (seats)", "baseline": "ok"}),
            row("a", "mixed", {"host alone": "blocks", "baseline": "ok"}),
            row("a", "mixed", {"host alone": "stall (seats)", "baseline": "ok"}),
            row("p", "prefill", {"default": "ok"})]
    assert reach.summary({"rows": rows}).splitlines() == [
        "| trace (window) | shapes | host alone | baseline |", "|---|---|---|---|",
        "| a (first 60 of 64) | 3 | stall (seats) 2 of 3, blocks 1 of 3 | ok |", "",
        "| trace (window) | shapes | default |", "|---|---|---|", "| p (first 60 of 64) | 1 | ok |"]
