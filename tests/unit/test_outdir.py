"""Output folders the commands own: every command that writes files refuses, in one line and before it runs, a
folder holding files it did not write, the filesystem root and a file path; it takes a new or empty folder, or one an
earlier run of the same command marked as its own. None of these cases needs the FastDeploy host."""

from __future__ import annotations

import json

import pytest

from fdsched.tools.cli import main
from fdsched.cmdline.outdir import MARKER, OutputError, check_out_dir, check_out_file, claim_out_dir, settle_out_dir, \
    trace_written_by

TRACE = ('{"header": {"engine": {"block_size": 16, "num_gpu_blocks": 708, "max_num_seqs": 16, '
         '"max_num_batched_tokens": 256, "max_model_len": 2048}}}\n'
         '{"id": "r0", "arrival": 0, "prompt_len": 100, "max_tokens": null, "output_len": 10}\n')

# command -> (its name in the marker, the command line with {out} for the folder)
FOLDER_COMMANDS = {
    "replay": ("fdsched replay", ["replay", "--trace", "{trace}", "--no-progress", "--out", "{out}"]),
    "eval": ("fdsched eval", ["eval", "--no-progress", "--out", "{out}"]),
    "serve": ("fdsched serve", ["serve", "--trace", "{trace}", "--out", "{out}"]),
    "load": ("fdsched load", ["load", "--url", "http://127.0.0.1:9", "--trace", "{trace}", "--out", "{out}"]),
    "load-vs-replay": ("fdsched load-vs-replay", ["load-vs-replay", "--trace", "{trace}", "--profile", "baseline",
                                                 "--out", "{out}"]),
}


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(TRACE, encoding="utf-8")
    return str(path)


def _run(argv, out, trace, capsys) -> tuple:
    code = main([a.replace("{out}", str(out)).replace("{trace}", trace) for a in argv])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return code, err


@pytest.mark.parametrize("command", sorted(FOLDER_COMMANDS))
def test_a_folder_with_files_the_command_did_not_write_is_refused_untouched(command, tmp_path, trace, capsys,
                                                                             monkeypatch):
    monkeypatch.delenv("FDSCHED_PROFILE", raising=False)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "host.log").write_text("the user's own log\n", encoding="utf-8")
    (out / "report.json").write_text('{"mine": 1}', encoding="utf-8")
    code, err = _run(FOLDER_COMMANDS[command][1], out, trace, capsys)
    assert code == 1
    assert len(err) == 1, err
    assert str(out) in err[0] and "did not write: host.log, report.json" in err[0] and "another folder" in err[0]
    assert sorted(p.name for p in out.iterdir()) == ["host.log", "report.json"]
    assert (out / "host.log").read_text(encoding="utf-8") == "the user's own log\n"


@pytest.mark.parametrize("command", sorted(FOLDER_COMMANDS))
def test_the_filesystem_root_and_a_file_are_refused(command, tmp_path, trace, capsys):
    code, err = _run(FOLDER_COMMANDS[command][1], "/", trace, capsys)
    assert code == 1 and len(err) == 1 and "the filesystem root" in err[0], err
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me", encoding="utf-8")
    code, err = _run(FOLDER_COMMANDS[command][1], a_file, trace, capsys)
    assert code == 1 and len(err) == 1 and "an existing file, not a folder" in err[0], err
    assert a_file.read_text(encoding="utf-8") == "keep me"


@pytest.mark.parametrize("command", sorted(FOLDER_COMMANDS))
def test_another_commands_folder_is_refused(command, tmp_path, trace, capsys):
    other = "fdsched eval" if command != "eval" else "fdsched replay"
    out, created = claim_out_dir(str(tmp_path / "theirs"), other)
    (out / "report.json").write_text("{}", encoding="utf-8")
    settle_out_dir(out, other, created)
    code, err = _run(FOLDER_COMMANDS[command][1], out, trace, capsys)
    assert code == 1 and len(err) == 1 and f"the output folder of {other}" in err[0], err


def test_a_folder_the_command_wrote_is_taken_again_and_a_file_added_later_is_not(tmp_path):
    out, created = claim_out_dir(str(tmp_path / "a" / "b"), "fdsched replay")
    assert created and out.is_dir()
    (out / "report.json").write_text("{}", encoding="utf-8")
    (out / "host.log").write_text("", encoding="utf-8")  # an empty log is not kept
    settle_out_dir(out, "fdsched replay", created)
    record = json.loads((out / MARKER).read_text(encoding="utf-8"))
    assert record["command"] == "fdsched replay" and record["files"] == ["report.json"]
    assert check_out_dir(str(out), "fdsched replay") == out
    (out / "notes.txt").write_text("mine", encoding="utf-8")
    with pytest.raises(OutputError, match="did not write: notes.txt"):
        check_out_dir(str(out), "fdsched replay")


def test_a_folder_made_for_a_run_that_wrote_nothing_goes_again(tmp_path):
    out, created = claim_out_dir(str(tmp_path / "new"), "fdsched eval")
    settle_out_dir(out, "fdsched eval", created)
    assert not out.exists()
    kept = tmp_path / "empty"
    kept.mkdir()
    out, created = claim_out_dir(str(kept), "fdsched eval")
    settle_out_dir(out, "fdsched eval", created)
    assert kept.is_dir() and not created  # the user's empty folder stays


@pytest.mark.parametrize("argv,command", [
    (["trace", "generate", "--kind", "pressure", "--out", "{out}"], "fdsched trace generate"),
    (["trace", "import", "{csv}", "--format", "azure", "--out", "{out}"], "fdsched trace import"),
])
def test_a_trace_command_overwrites_only_a_trace_it_wrote(argv, command, tmp_path, capsys):
    csv = tmp_path / "a.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n", encoding="utf-8")
    target = tmp_path / "t.jsonl"
    target.write_text(TRACE, encoding="utf-8")  # a trace, but not this command's
    line = [a.replace("{out}", str(target)).replace("{csv}", str(csv)) for a in argv]
    assert main(line) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"an existing file {command} did not write" in err[0]
    assert target.read_text(encoding="utf-8") == TRACE
    target.unlink()
    assert main(line) == 0 and main(line) == 0  # new, then its own output again
    assert trace_written_by(("import",) if "import" in command else ("pressure",))(target)


def test_check_out_file_refuses_a_directory_and_a_path_under_a_file(tmp_path):
    with pytest.raises(OutputError, match="a directory"):
        check_out_file(str(tmp_path), "fdsched trace import", lambda p: True)
    (tmp_path / "f").write_text("x", encoding="utf-8")
    with pytest.raises(OutputError, match="is a file, not a directory"):
        check_out_file(str(tmp_path / "f" / "t.jsonl"), "fdsched trace import", lambda p: True)


def test_host_support_json_writes_over_a_row_it_wrote_and_nothing_else(tmp_path, capsys):
    mine = tmp_path / "notes.json"
    mine.write_text('{"my": "notes"}', encoding="utf-8")
    argv = ["host", "support", "--refused", "2.0", "a" * 40, "no V1 scheduler", "--json"]
    assert main(argv + [str(mine)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--json" in err[0] and "did not write" in err[0]
    assert mine.read_text(encoding="utf-8") == '{"my": "notes"}'
    row = tmp_path / "row.json"
    assert main(argv + [str(row)]) == 0 and main(argv + [str(row)]) == 0  # new, then its own row again
    assert json.loads(row.read_text(encoding="utf-8"))["tier"] == "refused"
