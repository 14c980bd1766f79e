"""`fdsched replay` and `fdsched doctor` on a real host: the host's import-time messages (ccache, PROMETHEUS_MULTIPROC_DIR,
"Version file not found", ports) stay out of the terminal, in a log file the output names; -v shows them; the bar
counts arms. Each command runs as a user runs it, in its own process (the host is imported there, not here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from fdsched.install.probe import HostNotFound, find_host

HOST_NOISE = re.compile(r"ccache|PROMETHEUS_MULTIPROC_DIR|Version file not found|is not specified, found available ports")


@pytest.fixture(scope="module")
def env():
    try:
        location = find_host()
    except HostNotFound as exc:  # pragma: no cover - conftest skips the folder first
        pytest.skip(f"needs FastDeploy host: {exc}")
    environ = dict(os.environ)
    if "FDSCHED_HOST_SOURCE" not in environ and "fastdeploy" not in location:
        environ["FDSCHED_HOST_SOURCE"] = location
    for var in ("PROMETHEUS_MULTIPROC_DIR", "FD_LOG_DIR"):  # as on a user's machine: the replay picks its own
        environ.pop(var, None)
    return environ


def _fdsched(args, env, tmp_path):
    code = "import sys; from fdsched.tools.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], env=dict(env, FDSCHED_HOME=str(tmp_path / "home")),
                          capture_output=True, text=True, cwd=tmp_path, timeout=900)


def test_replay_keeps_the_host_messages_in_a_log(env, tmp_path):
    out = tmp_path / "out"
    result = _fdsched(["replay", "--trace", "pressure", "--max-steps", "200", "--no-plot", "--out", str(out)], env, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not HOST_NOISE.search(result.stdout + result.stderr), (result.stdout + result.stderr)[:3000]
    log = out / "host.log"
    assert HOST_NOISE.search(log.read_text(errors="replace")), "the host said nothing? then this test checks nothing"
    assert str(log) in result.stdout and "-v shows them" in result.stdout


def test_replay_verbose_shows_them(env, tmp_path):
    result = _fdsched(["replay", "--trace", "pressure", "--max-steps", "50", "--no-plot", "--no-progress", "-v",
                       "--out", str(tmp_path / "out")], env, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert HOST_NOISE.search(result.stdout + result.stderr)


def test_the_progress_bar_counts_arms(env, tmp_path):
    # tqdm draws only on a terminal (disable=None): give the command one, a pty
    pty = pytest.importorskip("pty")
    code = "import sys; from fdsched.tools.cli import main; sys.exit(main(sys.argv[1:]))"
    args = [sys.executable, "-c", code, "replay", "--trace", "pressure", "--max-steps", "100", "--no-plot",
            "--profile", "baseline", "recommended", "adaptive", "--out", str(tmp_path / "out")]
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, env=dict(env, FDSCHED_HOME=str(tmp_path / "home")), stdout=subprocess.DEVNULL,
                            stderr=slave, cwd=tmp_path)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=900)
    os.close(master)
    text = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    for i, name in enumerate(("baseline", "recommended", "adaptive"), 1):
        assert f"arm {i}/3 {name}" in text
    assert "req" in text and not HOST_NOISE.search(text)


def test_doctor_keeps_the_host_messages_in_a_log(env, tmp_path):
    result = _fdsched(["doctor"], dict(env, FD_PLUGINS="fdsched"), tmp_path)  # no pre-flight finding: exit 0
    assert result.returncode == 0, result.stderr[-3000:]
    assert not HOST_NOISE.search(result.stdout + result.stderr), (result.stdout + result.stderr)[:3000]
    assert "doctor-host.log" in result.stdout
