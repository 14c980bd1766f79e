"""The bad-input sweep: every input a newcomer can get wrong gets ONE clear error line and the project's exit code.

Each case is a command line (plus, where needed, environment variables and files it names) run through
``fdsched.tools.cli.main`` as a user would run it. The checks, for every case:

* the exit code is the convention of ``fdsched.core.common``: 1 (EXIT_ERROR) for a bad value the command checks,
  2 for what argparse refuses (an unknown flag or a value its type check rejects, printed under the usage);
* stderr carries exactly one error line (argparse's usage lines aside) and no traceback;
* that line names what the case is about (the option, variable, YAML key or file) -- ``expect``.

No case needs the FastDeploy host: each fails before the host would be imported. The categories are the
ones issue 19 lists: CLI options, environment variables, profile YAML, traces, host archives, ab report files.
A few cases also run through the installed console script in a subprocess (``test_console_script``).
"""

from __future__ import annotations

import codecs
import gzip
import io
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field

import pytest

from fdsched.tools.cli import main
from fdsched.tools.hostsetup import DEFAULT_COMMIT, HOST_MODULES

TRACE_OK = (
    '{"header": {"engine": {"block_size": 16, "num_gpu_blocks": 708, "max_num_seqs": 16, '
    '"max_num_batched_tokens": 256, "max_model_len": 2048}}}\n'
    '{"id": "r0", "arrival": 0, "prompt_len": 100, "max_tokens": null, "output_len": 10}\n'
)
SCRAPE_OK = (
    "# TYPE fastdeploy:fdsched_requests_finished_total counter\n"
    'fastdeploy:fdsched_requests_finished_total{arm="a",dp_rank="0"} 3\n'
    'fastdeploy:fdsched_requests_finished_total{arm="b",dp_rank="1"} 4\n'
)


def _tar(members: dict) -> bytes:
    """A .tar.gz with ``{name: data}`` members (names used as given, even absolute or with '..')."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


TOP = f"FastDeploy-{DEFAULT_COMMIT}"
GOOD_TREE = {f"{TOP}/{m}": b"# x\n" for m in HOST_MODULES + ("fastdeploy/__init__.py",)}

# files a case may name as {NAME}: name -> bytes
FILES = {
    "trace.jsonl": TRACE_OK.encode(),
    "trace-utf16.jsonl": codecs.BOM_UTF16_LE + TRACE_OK.encode("utf-16-le"),
    "trace-utf16-nobom.jsonl": TRACE_OK.encode("utf-16-le"),
    "trace-binary.jsonl": b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)),
    "trace-latin1.jsonl": TRACE_OK.replace("r0", "r\u00e9").encode("latin-1"),
    "trace-empty.jsonl": b"",
    "trace-badjson.jsonl": TRACE_OK.encode() + b'{"id": "r1", "arrival": 0,\n',
    "trace-badfield.jsonl": TRACE_OK.encode() + b'{"id": "r1", "arrival": 0, "prompt_len": -5, "max_tokens": null, "output_len": 3}\n',
    "trace-toolong.jsonl": TRACE_OK.encode() + b'{"id": "r1", "arrival": 0, "prompt_len": 99999, "max_tokens": null, "output_len": 3}\n',
    "trace-far-arrival.jsonl": TRACE_OK.encode() + b'{"id": "r1", "arrival": 100000000000000000000, "prompt_len": 10, "max_tokens": null, "output_len": 3}\n',
    "trace-far-arrival-s.jsonl": b'{"id": "r1", "arrival_s": 1e20, "prompt_len": 10, "max_tokens": null, "output_len": 3}\n',
    "trace-huge-max-tokens.jsonl": TRACE_OK.encode() + b'{"id": "r1", "arrival": 0, "prompt_len": 10, "max_tokens": 99999999999999999999, "output_len": 3}\n',
    "trace-huge-token.jsonl": b'{"id": "r1", "arrival": 0, "prompt": [1, 99999999999999999999], "max_tokens": null, "output_len": 3}\n',
    "trace-huge-pool.jsonl": b'{"header": {"engine": {"num_gpu_blocks": 99999999999999999999}}}\n' + TRACE_OK.encode().split(b"\n")[1] + b"\n",
    "empty.yaml": b"",
    "comment.yaml": b"# nothing here\n",
    "list.yaml": b"- changes\n- tunables\n",
    "scalar.yaml": b"recommended\n",
    "unknown-top.yaml": b"chnages: {ratio_reserve: 'on'}\n",
    "unknown-change.yaml": b"changes: {ratio_reserv: 'on'}\n",
    "bad-switch.yaml": b"changes: {ratio_reserve: maybe}\n",
    "duplicate.yaml": b"changes:\n  ratio_reserve: 'on'\n  ratio_reserve: 'off'\n",
    "syntax.yaml": b"changes: {ratio_reserve: 'on'\n",
    "utf16.yaml": codecs.BOM_UTF16_LE + "changes: {ratio_reserve: 'on'}\n".encode("utf-16-le"),
    "binary.yaml": bytes(range(256)),
    "latin1.yaml": "description: caf\u00e9\n".encode("latin-1"),
    "changes-scalar.yaml": b"changes: on\n",
    "description-list.yaml": b"description: [a, b]\n",
    "tunable-range.yaml": b"host_tunables: {FD_INIT_NEW_TOKEN_RATIO: 7}\n",
    "estimator.yaml": b"tunables: {reserve_estimator: magic}\n",
    "huge-int.yaml": b"tunables: {adaptive_window: 99999999999999999999}\n",
    "inf-cost.yaml": b"replay: {step_fixed_ms: .inf}\n",
    "not-a-tar.tar.gz": b"this is a text file, not an archive\n" * 4,
    "truncated.tar.gz": _tar(GOOD_TREE)[:60],
    "absolute.tar.gz": _tar({**GOOD_TREE, "/etc/evil": b"x"}),
    "traversal.tar.gz": _tar({**GOOD_TREE, f"{TOP}/../../evil": b"x"}),
    "two-tops.tar.gz": _tar({**GOOD_TREE, "other/readme": b"x"}),
    "no-modules.tar.gz": _tar({f"{TOP}/README.md": b"x"}),
    "plain.gz": gzip.compress(b"not a tar inside\n" * 10),
    "scrape.prom": SCRAPE_OK.encode(),
    "scrape-bad.prom": SCRAPE_OK.encode() + b"this is not { valid\n",
    "scrape-value.prom": b'x{arm="a"} notanumber\n',
    "scrape-binary.prom": bytes(range(256)),
    "scrape-utf16.prom": codecs.BOM_UTF16_LE + SCRAPE_OK.encode("utf-16-le"),
    "scrape-noarm.prom": b"# TYPE x counter\nx_total 1\n",
    "a-file": b"x",
    "data.csv": b"a,b\n1,2\n",
    "azure.csv": b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n",
    "binary.csv": bytes(range(256)),
}


@dataclass
class Case:
    id: str
    argv: list
    expect: str  # a piece of the error line, case-insensitive
    code: int = 1
    env: dict = field(default_factory=dict)


def _cases() -> list:
    c = []
    add = lambda id, argv, expect, code=1, **env: c.append(Case(id, argv, expect, code, env))  # noqa: E731
    # ---- CLI options ----------------------------------------------------------------------------------
    add("replay-max-steps-0", ["replay", "--max-steps", "0"], "--max-steps", 2)
    add("replay-max-steps-word", ["replay", "--max-steps", "x"], "--max-steps", 2)
    add("replay-cost-negative", ["replay", "--cost-fixed-ms", "-1"], "--cost-fixed-ms", 2)
    add("replay-cost-nan", ["replay", "--cost-fixed-ms", "nan"], "--cost-fixed-ms", 2)
    add("replay-block-size-0", ["replay", "--block-size", "0"], "--block-size", 2)
    add("replay-check-every-0", ["replay", "--check-every", "0"], "--check-every", 2)
    add("replay-unknown-flag", ["replay", "--profiles", "baseline"], "unrecognized arguments", 2)
    add("replay-dp-arms-with-profile", ["replay", "--dp-arms", "0=baseline", "--profile", "recommended"], "--dp-arms")
    add("replay-dp-arms-garbage", ["replay", "--dp-arms", "garbage"], "--dp-arms")
    add("replay-dp-arms-unknown", ["replay", "--dp-arms", "0=nosuch"], "nosuch")
    add("replay-unknown-profile", ["replay", "--profile", "nosuch"], "nosuch")
    add("replay-unknown-trace", ["replay", "--trace", "nosuch"], "nosuch")
    add("replay-out-is-a-file", ["replay", "--out", "{a-file}"], "--out")
    add("replay-out-under-a-file", ["replay", "--out", "{a-file}/sub"], "--out")
    add("replay-too-few-blocks", ["replay", "--num-gpu-blocks", "1"], "num_gpu_blocks")
    # huge numbers: refused by the option's bound, in one line, before the host is imported
    for flag in ("--num-gpu-blocks", "--block-size", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
                 "--max-steps", "--check-every"):
        add(f"replay-{flag[2:]}-huge", ["replay", flag, "99999999999999999999"], flag, 2)
    add("replay-num-gpu-blocks-negative", ["replay", "--num-gpu-blocks", "-5"], "--num-gpu-blocks", 2)
    add("replay-cost-huge", ["replay", "--cost-fixed-ms", "1e300"], "--cost-fixed-ms", 2)
    add("replay-cost-inf", ["replay", "--cost-decode-request-ms", "inf"], "--cost-decode-request-ms", 2)
    add("replay-dp-seed-huge", ["replay", "--dp-seed", "1" + "0" * 40], "--dp-seed", 2)
    add("replay-duplicate-arms", ["replay", "--profile", "baseline", "baseline"], "given twice")
    add("replay-duplicate-arms-repeated-flag", ["replay", "--profile", "baseline", "--profile", "recommended",
                                                "--profile", "baseline"], "given twice")
    add("replay-duplicate-arm-labels", ["replay", "--profile", "{tmp}/a/x.yaml", "{tmp}/b/x.yaml"], "labelled 'x'")
    add("trace-generate-requests-huge", ["trace", "generate", "--kind", "pressure", "--requests", "1" + "0" * 30],
        "--requests", 2)
    add("trace-import-sample-above-1", ["trace", "import", "{azure.csv}", "--format", "azure", "--out", "{tmp}/o.jsonl",
                                        "--sample", "2"], "--sample", 2)
    add("trace-import-duration-0", ["trace", "import", "{azure.csv}", "--format", "azure", "--out", "{tmp}/o.jsonl",
                                    "--duration", "0"], "--duration", 2)
    add("trace-import-rate-scale-huge", ["trace", "import", "{azure.csv}", "--format", "azure", "--out",
                                         "{tmp}/o.jsonl", "--rate-scale", "1e30"], "--rate-scale", 2)
    add("bench-evict-sizes-negative", ["bench", "evict", "--sizes", "-1"], "--sizes", 2)
    add("replay-dp-arms-negative-rank", ["replay", "--dp-arms", "-1=baseline"], "--option=VALUE", 2)
    add("replay-dp-arms-negative-rank-equals", ["replay", "--dp-arms=-1=baseline"], "rank '-1'")
    add("replay-out-empty", ["replay", "--out", ""], "(empty)")
    add("eval-out-empty", ["eval", "--out", ""], "(empty)")
    add("trace-generate-out-empty", ["trace", "generate", "--kind", "pressure", "--out", ""], "(empty)")
    add("profiles-empty-name", ["profiles", ""], "unknown profile")
    add("explain-profile-empty", ["explain", "--profile", ""], "--profile")
    add("explain-profile-unknown", ["explain", "--profile", "nosuch"], "nosuch")
    add("explain-profile-and-dp-rank", ["explain", "--profile", "baseline", "--dp-rank", "1"], "--dp-rank")
    add("explain-dp-rank-huge", ["explain", "--dp-rank", "1" + "0" * 20], "--dp-rank", 2)
    add("eval-duplicate-arms", ["eval", "--arms", "baseline", "recommended", "baseline"], "given twice")
    add("bench-schedule-unknown-profile", ["bench", "schedule", "--profile", "nosuch"], "--profile")
    add("bench-evict-heap-huge", ["bench", "evict", "--heap-objects", "1" + "0" * 20], "--heap-objects", 2)
    add("bench-transfer-interval-nan", ["bench", "transfer", "--interval", "nan"], "--interval", 2)
    add("trace-import-max-tokens-huge", ["trace", "import", "{azure.csv}", "--format", "azure", "--out", "{tmp}/o.jsonl",
                                         "--max-tokens", "1" + "0" * 20], "--max-tokens")
    add("bench-schedule-steps-huge", ["bench", "schedule", "--steps", "1" + "0" * 20], "--steps", 2)
    add("bench-instructions-unknown-profile", ["bench", "instructions", "--profile", "nosuch"], "--profile")
    add("bench-instructions-steps-huge", ["bench", "instructions", "--steps", "1" + "0" * 20], "--steps", 2)
    add("trace-generate-kind", ["trace", "generate", "--kind", "nosuch"], "--kind", 2)
    add("trace-generate-requests", ["trace", "generate", "--kind", "pressure", "--requests", "0"], "--requests", 2)
    add("trace-import-no-format", ["trace", "import", "{data.csv}", "--out", "{tmp}/o.jsonl"], "--format", 2)
    add("trace-import-missing-csv", ["trace", "import", "{tmp}/missing.csv", "--format", "azure", "--out", "{tmp}/o.jsonl"], "missing.csv")
    add("trace-import-max-tokens", ["trace", "import", "{data.csv}", "--format", "azure", "--out", "{tmp}/o.jsonl", "--max-tokens", "abc"], "max")
    add("trace-import-columns", ["trace", "import", "{data.csv}", "--format", "generic", "--columns", "bad", "--out", "{tmp}/o.jsonl"], "columns")
    add("patches-unknown", ["patches", "nosuch"], "nosuch")
    add("profiles-unknown", ["profiles", "nosuch"], "nosuch")
    add("host-use-unknown", ["host", "use", "nosuch"], "nosuch")
    add("host-setup-missing-archive", ["host", "setup", "--archive", "{tmp}/missing.tar.gz"], "does not exist")
    add("host-setup-dir-archive", ["host", "setup", "--archive", "{tmp}"], "directory")
    add("bench-unknown", ["bench", "nosuch"], "invalid choice", 2)
    add("ab-report-reference", ["ab", "report", "{scrape.prom}", "--reference", "nosuch"], "--reference")
    add("unknown-command", ["nosuch"], "invalid choice", 2)
    # ---- environment variables (fdsched doctor reads them) ----------------------------------------
    for var, value, expect in [
        ("FDSCHED_RATIO_RESERVE", "maybe", "FDSCHED_RATIO_RESERVE"),
        ("FDSCHED_DEFERRED_RECYCLE", "2", "FDSCHED_DEFERRED_RECYCLE"),
        ("FDSCHED_DECODE_ONLY_PREEMPT", "yes please", "FDSCHED_DECODE_ONLY_PREEMPT"),
        ("FDSCHED_PD_PREFILL_CACHE_MODE", "fast", "FDSCHED_PD_PREFILL_CACHE_MODE"),
        ("FD_INIT_NEW_TOKEN_RATIO", "1.5", "FD_INIT_NEW_TOKEN_RATIO"),
        ("FD_CLIP_MAX_NEW_TOKENS", "-1", "FD_CLIP_MAX_NEW_TOKENS"),
        ("FD_NEW_TOKEN_RATIO_DECAY", "abc", "FD_NEW_TOKEN_RATIO_DECAY"),
        ("FDSCHED_RATIO_REESTIMATE_CAP", "2", "FDSCHED_RATIO_REESTIMATE_CAP"),
        ("FDSCHED_RESERVE_ESTIMATOR", "magic", "FDSCHED_RESERVE_ESTIMATOR"),
        ("FDSCHED_ADAPTIVE_MIN_SAMPLES", "0", "FDSCHED_ADAPTIVE_MIN_SAMPLES"),
        ("FDSCHED_ADAPTIVE_MARGIN_K", "9", "FDSCHED_ADAPTIVE_MARGIN_K"),
        ("FDSCHED_TRANSFER_WAIT_SECONDS", "0", "FDSCHED_TRANSFER_WAIT_SECONDS"),
        ("FDSCHED_TRANSFER_FORCE_DIRECT_RECYCLE", "2", "FDSCHED_TRANSFER_FORCE_DIRECT_RECYCLE"),
        ("FDSCHED_RECYCLE_HEAPIFY_MIN_BATCH", "0", "FDSCHED_RECYCLE_HEAPIFY_MIN_BATCH"),
        ("FDSCHED_ADAPTIVE_WINDOW", "99999999999999999999", "at most 2147483647"),
        ("FD_CLIP_MAX_NEW_TOKENS", "99999999999999999999", "FD_CLIP_MAX_NEW_TOKENS"),
        ("FD_INIT_NEW_TOKEN_RATIO", "inf", "FD_INIT_NEW_TOKEN_RATIO"),
        ("FDSCHED_PROFILE", "nosuch", "nosuch"),
        ("FDSCHED_PROFILE", "/nonexistent/p.yaml", "no such profile file"),
        ("FDSCHED_PROFILE", "{tmp}/", "directory"),
        ("FDSCHED_PROFILE", "{empty.yaml}", "empty"),
        ("FDSCHED_PROFILE", "{utf16.yaml}", "UTF-16"),
        ("FDSCHED_PROFILE_BY_DP_RANK", "x", "FDSCHED_PROFILE_BY_DP_RANK"),
        ("FDSCHED_PROFILE_BY_DP_RANK", "0=nosuch", "nosuch"),
    ]:
        add(f"env-{var}-{value.strip('{}/').replace('/', '_')}", ["doctor"], expect, **{var: value})
    add("env-min-above-init", ["doctor"], "FD_MIN_NEW_TOKEN_RATIO", FD_INIT_NEW_TOKEN_RATIO="0.2", FD_MIN_NEW_TOKEN_RATIO="0.5")
    add("env-host-switch-contradicts", ["doctor"], "FD_USE_NEW_TOKEN_RATIO_RESERVE",
        FD_USE_NEW_TOKEN_RATIO_RESERVE="1", FDSCHED_RATIO_RESERVE="off")
    # ---- profile YAML (fdsched profiles PATH checks one; the replay loads every arm first) ----------------
    for name, expect in [
        ("empty.yaml", "empty"), ("comment.yaml", "empty"), ("list.yaml", "top level"), ("scalar.yaml", "top level"),
        ("unknown-top.yaml", "chnages"), ("unknown-change.yaml", "ratio_reserv"), ("bad-switch.yaml", "maybe"),
        ("duplicate.yaml", "given twice"), ("syntax.yaml", "line"), ("utf16.yaml", "UTF-16"), ("binary.yaml", "binary"),
        ("latin1.yaml", "not UTF-8"), ("changes-scalar.yaml", "changes"), ("description-list.yaml", "description"),
        ("tunable-range.yaml", "FD_INIT_NEW_TOKEN_RATIO"), ("estimator.yaml", "reserve_estimator"),
        ("huge-int.yaml", "tunables.adaptive_window"), ("inf-cost.yaml", "replay.step_fixed_ms"),
    ]:
        add(f"profile-{name}", ["profiles", "{%s}" % name], expect)
    add("replay-profile-empty", ["replay", "--profile", "{empty.yaml}"], "empty")
    add("replay-profile-binary", ["replay", "--profile", "{binary.yaml}"], "binary")
    add("replay-profile-dir", ["replay", "--profile", "{tmp}/"], "directory")
    # ---- traces -----------------------------------------------------------------------------------------
    for name, expect in [
        ("trace-utf16.jsonl", "UTF-16"), ("trace-utf16-nobom.jsonl", "UTF-16"), ("trace-binary.jsonl", "binary"),
        ("trace-latin1.jsonl", "not UTF-8"), ("trace-empty.jsonl", "trace-empty"), ("trace-badjson.jsonl", "line 3"),
        ("trace-badfield.jsonl", "prompt_len"), ("trace-toolong.jsonl", "trace-toolong"),
        ("trace-far-arrival.jsonl", "'arrival'"), ("trace-far-arrival-s.jsonl", "'arrival_s'"),
        ("trace-huge-max-tokens.jsonl", "'max_tokens'"), ("trace-huge-token.jsonl", "bad token"),
        ("trace-huge-pool.jsonl", "num_gpu_blocks"),
    ]:
        add(f"replay-{name}", ["replay", "--trace", "{%s}" % name], expect)
    add("trace-validate-binary", ["trace", "validate", "{trace-binary.jsonl}"], "binary")
    add("trace-validate-utf16", ["trace", "validate", "{trace-utf16.jsonl}"], "UTF-16")
    add("replay-trace-dir", ["replay", "--trace", "{tmp}/"], "directory")
    add("trace-import-utf16", ["trace", "import", "{trace-utf16.jsonl}", "--format", "azure", "--out", "{tmp}/o.jsonl"], "UTF-16")
    # ---- host archives ------------------------------------------------------------------------------------
    for name, expect in [
        ("not-a-tar.tar.gz", "not a tar archive"), ("truncated.tar.gz", "truncated or corrupt"),
        ("absolute.tar.gz", "absolute path"), ("traversal.tar.gz", "escapes"), ("two-tops.tar.gz", "one top folder"),
        ("no-modules.tar.gz", "has no"), ("plain.gz", "tar archive"),
    ]:
        add(f"archive-{name}", ["host", "setup", "--no-deps", "--archive", "{%s}" % name], expect)
    # ---- ab report files -----------------------------------------------------------------------------------
    for name, expect in [
        ("scrape-bad.prom", "line 4"), ("scrape-value.prom", "line 1"), ("scrape-binary.prom", "binary"),
        ("scrape-utf16.prom", "UTF-16"), ("scrape-noarm.prom", "arm label"),
    ]:
        add(f"ab-{name}", ["ab", "report", "{%s}" % name], expect)
    add("ab-missing-file", ["ab", "report", "{tmp}/missing.prom"], "missing.prom")
    add("ab-since-bad", ["ab", "report", "{scrape.prom}", "--since", "{scrape-bad.prom}"], "line 4")
    add("ab-report-dir", ["ab", "report", "{tmp}/"], "directory")
    # ---- --out of the other commands (checked before any work) ------------------------------------------------
    add("eval-out-is-a-file", ["eval", "--out", "{a-file}"], "--out")
    add("trace-generate-out-dir", ["trace", "generate", "--kind", "pressure", "--out", "{tmp}/"], "a directory")
    add("trace-generate-out-under-a-file", ["trace", "generate", "--kind", "pressure", "--out", "{a-file}/t.jsonl"],
        "not a directory")
    add("trace-import-out-dir", ["trace", "import", "{azure.csv}", "--format", "azure", "--out", "{tmp}/"], "a directory")
    add("trace-import-out-under-a-file", ["trace", "import", "{azure.csv}", "--format", "azure", "--out",
                                          "{a-file}/t.jsonl"], "not a directory")
    # ---- more directories and encodings ------------------------------------------------------------------------
    add("trace-validate-dir", ["trace", "validate", "{tmp}/"], "directory")
    add("trace-import-csv-dir", ["trace", "import", "{tmp}/", "--format", "azure", "--out", "{tmp}/o.jsonl"], "directory")
    add("trace-import-binary-csv", ["trace", "import", "{binary.csv}", "--format", "azure", "--out", "{tmp}/o.jsonl"],
        "binary.csv")
    add("profiles-dir", ["profiles", "{tmp}/"], "directory")
    add("profiles-missing-yaml", ["profiles", "{tmp}/missing.yaml"], "no such profile file")
    add("load-trace-binary", ["load", "--url", "http://127.0.0.1:9", "--trace", "{trace-binary.jsonl}"], "binary")
    # ---- serve-pd-bench: refused before any stack starts --------------------------------------------------------
    add("serve-pd-bench-burst-0", ["serve-pd-bench", "--burst", "0"], "--burst", 2)
    add("serve-pd-bench-trace-and-burst", ["serve-pd-bench", "--trace", "pd-prefill", "--burst", "8"],
        "--trace pd-prefill with --burst 8: allowed: one workload")
    add("serve-pd-bench-runs-without-burst", ["serve-pd-bench", "--runs", "3"], "--runs 3 without --burst")
    add("serve-pd-bench-both-roles", ["serve-pd-bench", "--burst", "8", "--prefill-profiles", "baseline,recommended",
                                      "--decode-profiles", "baseline,recommended"], "several profiles on one role only")
    add("serve-pd-bench-bad-profile", ["serve-pd-bench", "--burst", "2", "--decode-profiles", "recomended"],
        "--decode-profiles: profile: bad value 'recomended'")
    add("serve-pd-bench-prompt-too-long", ["serve-pd-bench", "--burst", "2", "--prompt-tokens", "400"],
        "--prompt-tokens 400 with --max-tokens 150: allowed: at most 512")
    add("serve-pd-bench-trace-unknown", ["serve-pd-bench", "--trace", "nosuch"], "--trace: trace 'nosuch': unknown")
    add("serve-pd-bench-out-missing-dir", ["serve-pd-bench", "--burst", "2", "--out", "{tmp}/no/x.json"],
        "--out")
    return c


CASES = _cases()


@pytest.fixture
def files(tmp_path):
    names = {"tmp": str(tmp_path)}
    for sub in ("a", "b"):  # two profile files with one name (the duplicate-label case)
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "x.yaml").write_text("description: x\n", encoding="utf-8")
    for name, data in FILES.items():
        (tmp_path / name).write_bytes(data)
        names[name] = str(tmp_path / name)
    return names


def _fill(text: str, files: dict) -> str:
    for name, path in files.items():
        text = text.replace("{%s}" % name, path)
    return text


def _error_lines(err: str, code: int) -> list:
    """Every line on stderr: argparse's refusals too are one line (no usage block before it)."""
    return [line for line in err.splitlines() if line.strip()]


def test_the_sweep_covers_every_category():
    assert len(CASES) >= 100
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line(case, files, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    for var, value in case.env.items():
        monkeypatch.setenv(var, _fill(value, files))
    argv = [_fill(arg, files) for arg in case.argv]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert code == case.code, err
    lines = _error_lines(err, code)
    assert len(lines) == 1, err
    assert case.expect.lower() in lines[0].lower(), lines[0]
    # one prefix for every command: "fdsched <command>: error: ..."
    command = " ".join(a for a in argv[:2] if not a.startswith("-") and "/" not in a and a != "nosuch")
    assert lines[0].startswith("fdsched"), lines[0]
    assert ": error: " in lines[0] and lines[0].split(": error: ")[0] in ("fdsched", f"fdsched {command}",
                                                                           f"fdsched {argv[0]}"), lines[0]


@pytest.mark.parametrize("case_id", ["replay-trace-utf16.jsonl", "profile-binary.yaml", "archive-absolute.tar.gz",
                                     "replay-out-is-a-file", "replay-max-steps-0", "replay-num-gpu-blocks-huge",
                                     "replay-trace-far-arrival.jsonl"])
def test_console_script(case_id, files, tmp_path):
    """The same through the installed ``fdsched`` script: nothing between main() and the terminal adds a traceback."""
    case = next(c for c in CASES if c.id == case_id)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FDSCHED_", "FD_"))}
    env["FDSCHED_HOME"] = str(tmp_path / "home")
    env.update({k: _fill(v, files) for k, v in case.env.items()})
    code = "import sys; from fdsched.tools.cli import main; sys.exit(main(sys.argv[1:]))"
    result = subprocess.run([sys.executable, "-c", code, *[_fill(a, files) for a in case.argv]], env=env,
                            capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert "Traceback" not in result.stderr
    assert result.returncode == case.code, result.stderr
    lines = _error_lines(result.stderr, result.returncode)
    assert len(lines) == 1 and case.expect.lower() in lines[0].lower(), result.stderr


def test_a_replay_over_an_earlier_report_says_it_replaces_it(tmp_path, capsys):
    from fdsched.replay.replay_cli import _say_if_replacing

    _say_if_replacing(tmp_path)
    assert capsys.readouterr().err == ""  # nothing to replace: nothing said
    (tmp_path / "report.json").write_text("{}", encoding="utf-8")
    _say_if_replacing(tmp_path)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"fdsched replay: note: {tmp_path} holds an earlier report (report.json, ")
    assert "replaces it when it finishes" in err


def test_the_bounds_admit_their_own_limits(tmp_path):
    """The bounds refuse typos, not real values: an arrival at the bound and a pool at the bound pass."""
    from fdsched.replay.trace import ENGINE_MAX, MAX_ARRIVAL_S, MAX_ARRIVAL_STEP
    from fdsched.replay.tracefile import parse_trace

    header = '{"header": {"engine": {"num_gpu_blocks": %d}}}' % ENGINE_MAX["num_gpu_blocks"]
    trace = parse_trace([header, '{"id": "r", "arrival": %d, "prompt_len": 5, "max_tokens": null, "output_len": 2}'
                         % MAX_ARRIVAL_STEP])
    assert trace.requests[0].arrival == MAX_ARRIVAL_STEP
    timed = parse_trace(['{"id": "r", "arrival_s": %r, "prompt_len": 5, "max_tokens": null, "output_len": 2}'
                         % MAX_ARRIVAL_S])
    assert timed.requests[0].arrival_s == MAX_ARRIVAL_S


def test_the_same_profile_by_name_and_by_path_is_one_arm(files, capsys, monkeypatch, tmp_path):
    from fdsched.core.settings import shipped_profiles

    monkeypatch.chdir(tmp_path)
    code = main(["replay", "--profile", "baseline", str(shipped_profiles()["baseline"])])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1
    assert "given twice" in err and err.startswith("fdsched replay: error: --profile: ")


def test_a_replay_that_cannot_start_leaves_no_output_behind(tmp_path, monkeypatch, capsys):
    import importlib.util

    if "fastdeploy" in sys.modules or importlib.util.find_spec("fastdeploy") is not None:
        pytest.skip("FastDeploy is importable in this run; the no-host path is checked where it is not")
    monkeypatch.delenv("FDSCHED_HOST_SOURCE", raising=False)
    monkeypatch.setenv("FDSCHED_HOME", str(tmp_path / "home"))
    out = tmp_path / "new-out"
    assert main(["replay", "--out", str(out), "--no-progress"]) == 2
    assert "needs the FastDeploy host" in capsys.readouterr().err
    assert not out.exists()  # made for the run, removed again: nothing half-written
    from fdsched.cmdline.outdir import MARKER, claim_out_dir, settle_out_dir

    kept, created = claim_out_dir(str(tmp_path / "kept"), "fdsched replay")  # an earlier replay's folder
    (kept / "report.json").write_text("{}", encoding="utf-8")
    settle_out_dir(kept, "fdsched replay", created)
    assert main(["replay", "--out", str(kept), "--no-progress"]) == 2
    assert sorted(p.name for p in kept.iterdir()) == [MARKER, "report.json"]  # an earlier report stays when this fails


def test_counts_read_as_words():
    from fdsched.core.common import plural

    assert [plural(1, "request"), plural(2, "request"), plural(0, "step")] == ["1 request", "2 requests", "0 steps"]
    assert plural(1234567, "prompt token") == "1234567 prompt tokens"  # never 1.23457e+06
    assert plural(24.0, "request") == "24 requests"


def test_an_unexpected_error_mid_run_is_one_line_and_its_traceback_is_kept(capsys, tmp_path):
    """What a host we have never seen raises in the middle of a replay (not a settings or trace problem) reaches the
    terminal as one line naming the error and where it was raised; the traceback goes to the run's host log."""
    from fdsched.replay.replay_cli import run_failure

    def host_code():
        raise KeyError("no_such_field\nsecond line")

    try:
        host_code()
    except KeyError as exc:
        error = run_failure(exc, tmp_path / "host.log")
    message = str(error)
    assert "\n" not in message
    assert message.startswith("the run failed: KeyError: 'no_such_field")
    assert "test_bad_input_sweep.py:" in message and str(tmp_path / "host.log") in message
    assert "Traceback (most recent call last)" in capsys.readouterr().err  # (inside a run: the host log)
