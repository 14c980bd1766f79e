"""`fdsched replay` without a host: one clear error, exit code 2. No host."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from fdsched.install.probe import HOST_SOURCE_ENV, HOW_TO_POINT


def _host_importable() -> bool:
    return "fastdeploy" in sys.modules or importlib.util.find_spec("fastdeploy") is not None


@pytest.mark.skipif(_host_importable(), reason="FastDeploy is importable here, so the replay would run")
def test_replay_without_host_exits_2_and_says_how_to_point(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != HOST_SOURCE_ENV and not k.startswith("FDSCHED_")}
    env["FDSCHED_HOME"] = str(tmp_path / "home")  # no recorded host either
    proc = subprocess.run(
        [sys.executable, "-m", "fdsched.tools.cli", "replay", "--trace", "shared-prefix", "--out", str(tmp_path / "o"),
         "--no-progress"],
        env=env, capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
    )
    assert proc.returncode == 2, proc.stderr
    assert "needs the FastDeploy host" in proc.stderr
    assert HOW_TO_POINT in proc.stderr
    assert proc.stderr.count(HOW_TO_POINT) == 1
    assert not (tmp_path / "o" / "report.json").exists()


def test_replay_rejects_a_bad_profile_before_looking_for_the_host(tmp_path, capsys):
    from fdsched.tools.cli import main

    assert main(["replay", "--profile", "no-such-profile", "--out", str(tmp_path), "--no-progress"]) == 1
    assert "unknown profile" in capsys.readouterr().err


def test_replay_rejects_a_bad_trace(tmp_path, capsys):
    from fdsched.tools.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "arrival": 0, "prompt_len": 4, "max_tokens": null}\n')
    assert main(["replay", "--trace", str(bad), "--out", str(tmp_path), "--no-progress"]) == 1
    assert "bad.jsonl line 1, field 'output_len': missing" in capsys.readouterr().err


def test_replay_rejects_a_shape_too_small_for_the_trace(capsys, tmp_path):
    from fdsched.tools.cli import main

    assert main(["replay", "--trace", "pressure", "--num-gpu-blocks", "10", "--out", str(tmp_path), "--no-progress"]) == 1
    assert "num_gpu_blocks=10 is too small" in capsys.readouterr().err


def test_host_free_modules_import_no_fastdeploy():
    code = (
        "import sys\n"
        "import fdsched.replay.trace, fdsched.replay.generate, fdsched.replay.costmodel, fdsched.replay.figures\n"
        "import fdsched.replay.invariants, fdsched.replay.report, fdsched.replay.oracle, fdsched.replay.cli\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('fastdeploy', 'paddle', 'matplotlib'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != HOST_SOURCE_ENV}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cli_replay_dp_arms_errors(capsys):
    """Bad --dp-arms values fail before anything needs the host."""
    from fdsched.tools.cli import main

    assert main(["replay", "--dp-arms", "0=baseline,0=recommended", "--no-progress"]) == 1
    assert "--dp-arms: bad value '0=recommended' (rank 0 is given twice" in capsys.readouterr().err
    assert main(["replay", "--dp-arms", "0=baseline", "--profile", "baseline", "--no-progress"]) == 1
    assert "allowed: one of --dp-arms or --profile" in capsys.readouterr().err
    assert main(["replay", "--dp-arms", "0=baseline,1=nosuch", "--no-progress"]) == 1
    assert "--dp-arms, rank 1: bad value 'nosuch' (unknown profile)" in capsys.readouterr().err
