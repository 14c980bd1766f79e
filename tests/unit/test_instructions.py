"""``fdsched bench instructions`` (fdsched.tools.instructions): callgrind's report read, the marker that decides
what is counted, and the one line when valgrind is missing. The counting itself runs where valgrind is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from fdsched.tools import instructions
from fdsched.tools.instructions import CHECK_ARM, CHECK_LOOP, MARKER_ARM, InstructionsError, collected, in_marker


def test_the_count_is_callgrinds_one_collected_line():
    stderr = "==12== Callgrind, a call-graph generating cache profiler\n==12== Collected : 1493030381\n==12== \n"
    assert collected(stderr) == 1493030381
    with pytest.raises(InstructionsError, match="0 'Collected' lines"):
        collected("==12== I   refs: 10\n")
    with pytest.raises(InstructionsError, match="2 'Collected' lines"):
        collected("==1== Collected : 5\n==2== Collected : 6\n")


def test_the_marker_runs_what_it_is_given_once_and_returns_its_value():
    calls = []
    assert in_marker(lambda: calls.append(1) or "done") == "done"
    assert calls == [1]


def test_without_valgrind_the_command_says_so_in_one_line(tmp_path):
    env = dict(os.environ, PATH=os.path.dirname(sys.executable), FDSCHED_HOME=str(tmp_path))  # no valgrind there
    done = subprocess.run([sys.executable, "-m", "fdsched.tools.cli", "bench", "instructions", "--steps", "1"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        "fdsched bench instructions: error: valgrind is not on PATH: each arm is counted under its callgrind (e.g. "
        "apt-get install valgrind)"]


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed here: the marker's count is not checked")
def test_callgrind_counts_inside_the_marker_and_only_there():
    valgrind = shutil.which("valgrind")
    empty = instructions.count_arm(MARKER_ARM, 1, 0, 3, 64, "spread", valgrind)["instructions"]
    looped = instructions.count_arm(CHECK_ARM, 1, 0, 3, 64, "spread", valgrind)["instructions"]
    assert 0 < empty < 200_000  # three empty markers: the ctypes call and qsort's own work
    assert looped - empty > 5 * CHECK_LOOP  # the loop ran inside the marker and was counted
