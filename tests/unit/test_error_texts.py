"""Error texts that say what to do: what the input should have been and where its format is described, the context
length that fits a trace, a "did you mean" for a near-miss name or key, and no installed path of a shipped file."""

from __future__ import annotations

import pytest

from fdsched.core.settings import SettingsError, load_settings, read_profile, resolve_profile
from fdsched.replay.tracefile import shipped_traces
from fdsched.tools.cli import main


def _one_error(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_a_file_that_is_not_a_trace_says_a_jsonl_trace_is_expected_and_where_its_format_is(tmp_path, capsys):
    passwd = tmp_path / "passwd"
    passwd.write_text("root:x:0:0:root:/root:/bin/bash\n", encoding="utf-8")
    for argv in (["replay", "--trace", str(passwd)], ["trace", "validate", str(passwd)],
                 ["serve", "--trace", str(passwd)]):
        assert main(argv) == 1
        line = _one_error(capsys)
        assert "line 1: not valid JSON" in line and "allowed: a JSONL trace: one JSON object per line" in line
        assert 'examples/replay.md, "Trace format (JSONL)"' in line


@pytest.mark.parametrize("argv,says", [
    (["replay", "--trace", "azure-conv", "--max-model-len", "64"], "allowed: max_model_len (--max-model-len) "),
    (["serve", "--trace", "azure-conv", "--max-model-len", "64"], "raise --max-model-len to "),
])
def test_a_context_too_short_for_a_shipped_trace_says_which_length_fits_and_no_path(argv, says, capsys):
    assert main(argv) == 1
    line = _one_error(capsys)
    assert "trace azure-conv line 2" in line and says in line
    assert str(shipped_traces()["azure-conv"].parent) not in line and "site-packages" not in line
    fits = int(line.split(says, 1)[1].split()[0])
    assert fits > 374  # the first request's prompt is 374 tokens


def test_the_length_said_to_fit_does_fit(capsys, tmp_path):
    from fdsched.replay.trace import check_engine
    from fdsched.replay.tracefile import load_trace

    trace = load_trace(shipped_traces()["azure-conv"])
    with pytest.raises(ValueError) as err:
        check_engine(trace, trace.engine_with({"max_model_len": 64}))
    fits = int(str(err.value).split("(--max-model-len) ")[1].split()[0])
    blocks = fits // trace.engine_with()["block_size"] + 3
    check_engine(trace, trace.engine_with({"max_model_len": fits, "num_gpu_blocks": max(blocks, 4096)}))
    with pytest.raises(ValueError):
        check_engine(trace, trace.engine_with({"max_model_len": fits - 1, "num_gpu_blocks": max(blocks, 4096)}))


def test_a_near_miss_profile_name_or_key_gets_a_did_you_mean(tmp_path):
    with pytest.raises(SettingsError, match=r"bad value 'recomended' \(unknown profile; did you mean recommended\?\); "
                                            r"allowed: "):
        resolve_profile("recomended")
    with pytest.raises(SettingsError, match=r"\(unknown profile\); allowed"):  # nothing close: no guess
        resolve_profile("zzzzzz")
    typo = tmp_path / "p.yaml"
    typo.write_text('changes:\n  ratio_reserv: "on"\n', encoding="utf-8")
    with pytest.raises(SettingsError, match=r"key changes.ratio_reserv: unknown key \(did you mean ratio_reserve\?\); "
                                            r"allowed under changes: "):
        read_profile(typo)
    typo.write_text('tunabels:\n  adaptive_window: 10\n', encoding="utf-8")
    with pytest.raises(SettingsError, match=r"key tunabels: unknown key \(did you mean tunables\?\)"):
        load_settings(environ={}, profile=str(typo))


def test_a_near_miss_trace_name_gets_a_did_you_mean(capsys):
    assert main(["trace", "validate", "azure-cnv"]) == 1
    assert "unknown (did you mean azure-conv?); allowed: a shipped trace" in _one_error(capsys)


def test_a_csv_log_given_as_a_trace_says_how_to_import_it(tmp_path, capsys):
    log = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    log.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n", encoding="utf-8")
    assert main(["replay", "--trace", str(log)]) == 1
    line = _one_error(capsys)
    assert "a CSV file, not a trace" in line and f"fdsched trace import {log} --format" in line
