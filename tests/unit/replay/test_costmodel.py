"""The context-aware step-cost model, its presets and where the replay uses it. No host."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from fdsched.replay.costmodel import (
    COEFFICIENTS,
    CostModelError,
    StepCost,
    chunk_context_tokens,
    cost_from_settings,
    decode_context_tokens,
    load_preset,
    preset_names,
    prefill_context_tokens,
    resolve_cost_model,
    check_replay_settings,
    row_step_ms,
    step_times,
)
from fdsched.replay.figures import ProfileRun, RequestRow, StepRow, latency_samples
from fdsched.replay.report import build_report, format_header
from fdsched.core.settings import SettingsError, load_settings

REPO = Path(__file__).resolve().parents[3]
PRESET = "llama2-7b-a100"
LINEAR_SETTINGS = {"replay.step_fixed_ms": 5.0, "replay.per_prefill_token_ms": 0.02, "replay.per_decode_request_ms": 0.1}

# A model with every term and round numbers: fixed 2, prefill 0.5/token, decode 3/request,
# prefill attention 0.001 per attended token, KV read 0.01 per held token.
CONTEXT = StepCost(2.0, 0.5, 3.0, 0.0, 0.001, 0.01, name="hand")


def _preset_doc(**coefficients) -> dict:
    coeffs = {key: 1.0 for key in COEFFICIENTS}
    coeffs.update(coefficients)
    return {"name": "mine", "source": {"repository": "example.org/x", "commit": "abc"}, "coefficients": coeffs}


def _write(tmp_path, doc, name="preset.yaml") -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc), encoding="utf-8")
    return path


# ---- the step cost from hand-made steps ---------------------------------------------------------
def test_a_decode_step_pays_per_request_and_per_held_token():
    # 4 decoding requests holding 100, 200, 300 and 400 tokens: fixed + 4 d + k * 1000
    held = decode_context_tokens([100, 200, 300, 400])
    assert held == 1000
    assert CONTEXT.step_ms(0, 4, decode_context_tokens=held) == pytest.approx(2.0 + 4 * 3.0 + 0.01 * 1000)
    # one request holding N tokens: fixed + d + k N, growing with N
    for n in (1, 512, 4096):
        assert CONTEXT.step_ms(0, 1, decode_context_tokens=n) == pytest.approx(2.0 + 3.0 + 0.01 * n)


def test_a_prefill_chunk_over_a_prefix_pays_the_attention_term():
    # chunk [100, 110) of one request: 10 tokens at positions 100..109 attend to 101..110 tokens
    assert chunk_context_tokens(100, 110) == sum(range(101, 111)) == 10 * 100 + 10 * 11 // 2
    assert chunk_context_tokens(0, 1) == 1 and chunk_context_tokens(5, 5) == 0
    pairs = prefill_context_tokens([("a", 100, 110), ("b", 0, 4)])
    assert pairs == 1055 + (1 + 2 + 3 + 4)
    assert prefill_context_tokens([(100, 110)]) == 1055
    cost = CONTEXT.step_ms(14, 0, prefill_context_tokens=pairs)
    assert cost == pytest.approx(2.0 + 14 * 0.5 + 0.001 * 1065)
    # the same 10 tokens without the 100-token prefix cost less: only the attention term differs
    assert CONTEXT.step_ms(10, 0, prefill_context_tokens=chunk_context_tokens(100, 110)) - CONTEXT.step_ms(
        10, 0, prefill_context_tokens=chunk_context_tokens(0, 10)
    ) == pytest.approx(0.001 * (1055 - 55))


def test_the_token_floor_binds_small_steps_but_not_idle_ones():
    cost = StepCost(1.0, 0.1, 0.2, token_floor_ms=5.0)
    assert cost.step_ms(0, 0) == 1.0  # nothing runs: fixed only
    assert cost.step_ms(0, 3) == 1.0 + 5.0  # 0.6 ms of tokens < floor
    assert cost.step_ms(100, 0) == pytest.approx(1.0 + 10.0)  # above the floor: linear
    assert cost.step_ms(0, 3, decode_context_tokens=10) == 6.0  # the floor covers the linear part only


def test_linear_gives_the_same_step_times_as_before():
    """Regression: under ``linear`` every step costs exactly what the replay computed before the context
    terms existed (``fixed + prefill * P + decode * D``, same float), whatever context facts are passed."""
    cost = cost_from_settings(LINEAR_SETTINGS)
    assert cost == StepCost(5.0, 0.02, 0.1) and cost.name == "linear" and not cost.context_aware

    def old_step_ms(p, d):  # the formula of the replay before this change
        return 5.0 + 0.02 * p + 0.1 * d

    grid = list(itertools.product((0, 1, 7, 256, 2047, 2048), (0, 1, 3, 31, 32)))
    for p, d in grid:
        assert cost.step_ms(p, d) == old_step_ms(p, d)
        assert cost.step_ms(p, d, decode_context_tokens=10**6, prefill_context_tokens=10**9) == old_step_ms(p, d)
    prefill, decode = [p for p, _ in grid], [d for _, d in grid]
    gaps = [0.5 * i for i in range(len(grid))]
    before, now = [], 0.0
    for p, d, g in zip(prefill, decode, gaps):
        now += g
        now += old_step_ms(p, d)
        before.append(now)
    _, ends = step_times(cost, prefill, decode, gaps, [123] * len(grid), [4567] * len(grid))
    assert ends == before  # bit for bit
    # and the profiles' default model is linear with the shipped numbers
    settings = load_settings(environ={}, profile="baseline")
    assert settings["replay.cost_model"] == "linear"
    assert cost_from_settings(settings) == StepCost(5.0, 0.02, 0.1)


def test_row_step_ms_and_step_times_read_the_rows_context():
    row = StepRow(0, prefill_tokens=10, decode_tokens=2, decode_context_tokens=300, prefill_context_tokens=55)
    assert row_step_ms(CONTEXT, row) == pytest.approx(2.0 + 5.0 + 6.0 + 0.055 + 3.0)
    bare = SimpleNamespace(prefill_tokens=10, decode_tokens=2)  # a row without context facts
    assert row_step_ms(CONTEXT, bare) == pytest.approx(2.0 + 5.0 + 6.0)


def test_the_runner_records_each_steps_context_facts():
    from fdsched.replay.drive import _set_step_context

    record = SimpleNamespace(decode_context_tokens=812, prefill_chunks=[("a", 100, 110), ("b", 0, 4)])
    row = StepRow(0)
    _set_step_context(row, record)
    assert (row.decode_context_tokens, row.prefill_context_tokens) == (812, 1065)


def test_latencies_grow_with_the_context_held():
    """Two runs alike but for the tokens held: the one holding more context has a later first token."""

    def run(held):
        r = ProfileRun(profile="p", num_gpu_blocks=10, cost=CONTEXT)
        r.steps = [
            StepRow(0, prefill_tokens=4, prefill_context_tokens=chunk_context_tokens(0, 4)),
            StepRow(1, decode_tokens=1, decode_context_tokens=held),
        ]
        r.requests = [RequestRow("r", 0, 4, 2, output_tokens=2, first_token_step=0, finish_step=1, finish_count=1)]
        return latency_samples(r)

    short, long = run(5), run(5000)
    step0 = 2.0 + 4 * 0.5 + 0.001 * 10
    assert short["ttft_ms"] == long["ttft_ms"] == [pytest.approx(step0)]
    assert short["total_ms"] == pytest.approx(step0 + 2.0 + 3.0 + 0.05)
    assert long["total_ms"] - short["total_ms"] == pytest.approx(0.01 * (5000 - 5))


# ---- presets -------------------------------------------------------------------------------------
def test_the_shipped_preset_loads_with_its_source_and_every_coefficient():
    assert PRESET in preset_names()
    cost = resolve_cost_model(PRESET)
    shipped = REPO / "plugin" / "replay" / "costmodels" / f"{PRESET}.yaml"
    doc = yaml.safe_load(shipped.read_text(encoding="utf-8"))
    assert cost.coefficients() == {k: float(v) for k, v in doc["coefficients"].items()}
    assert cost.name == PRESET and cost.context_aware
    assert "github.com/microsoft/vidur" in cost.source and doc["source"]["commit"][:12] in cost.source
    assert "MIT" in doc["source"]["licence"]
    for key in ("token_operators", "decode_attention", "prefill_attention"):
        assert key in doc["derivation"] and doc["fit"][key]["rows"] > 0
    # a decode step holding more tokens costs more under the preset, as the KV read grows
    assert cost.step_ms(0, 32, decode_context_tokens=32 * 4000) > cost.step_ms(0, 32, decode_context_tokens=32 * 100)


def test_the_shipped_preset_is_what_the_fit_script_derives():
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "fit_costmodel.py"), "--check",
         str(REPO / "plugin" / "replay" / "costmodels" / f"{PRESET}.yaml")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "every coefficient matches" in proc.stdout


def test_cost_from_settings_picks_the_model_then_applies_overrides():
    preset = resolve_cost_model(PRESET)
    assert resolve_cost_model("linear") is None
    assert cost_from_settings(LINEAR_SETTINGS, {"model": PRESET}) == preset
    assert cost_from_settings(dict(LINEAR_SETTINGS, **{"replay.cost_model": PRESET})) == preset
    tweaked = cost_from_settings(LINEAR_SETTINGS, {"model": PRESET, "step_fixed_ms": 9.0, "per_decode_request_ms": None})
    assert tweaked.fixed_ms == 9.0 and tweaked.per_decode_request_ms == preset.per_decode_request_ms
    assert cost_from_settings(LINEAR_SETTINGS, {"model": "linear", "step_fixed_ms": 1.0}) == StepCost(1.0, 0.02, 0.1)


def test_a_preset_file_loads(tmp_path):
    path = _write(tmp_path, _preset_doc(per_decode_context_token_ms=0.25))
    cost = resolve_cost_model(str(path))
    assert cost.per_decode_context_token_ms == 0.25 and cost.fixed_ms == 1.0
    assert cost.name == "mine" and "example.org/x @ abc" in cost.source


@pytest.mark.parametrize(
    "doc, expected",
    [
        ({"name": "x", "coefficients": {k: 1.0 for k in list(COEFFICIENTS)[1:]}}, "coefficients.step_fixed_ms: missing"),
        (_preset_doc(token_floor_ms=-1), "coefficients.token_floor_ms: bad value -1; allowed: a number >= 0"),
        (_preset_doc(per_decode_context_token_ms="fast"), "coefficients.per_decode_context_token_ms: bad value 'fast'"),
        (_preset_doc(per_decode_context_token_ms=True), "coefficients.per_decode_context_token_ms: bad value True"),
        (_preset_doc(per_token_ms=1.0), "coefficients.per_token_ms: unknown key; allowed: step_fixed_ms"),
        (dict(_preset_doc(), colour="blue"), "key colour: unknown key; allowed: name, description"),
        ({"name": "x"}, "key coefficients: bad value None; allowed: a mapping"),
        ([1, 2], "bad value at the top level (a list)"),
        ("a: [unclosed", "not valid YAML"),
    ],
)
def test_a_bad_preset_gets_one_error_naming_the_key_value_and_what_is_allowed(tmp_path, doc, expected):
    path = _write(tmp_path, doc)
    with pytest.raises(CostModelError) as info:
        resolve_cost_model(str(path))
    message = str(info.value)
    assert message.startswith(f"--cost-model: cost model file {path}")
    assert expected in message
    assert "\n" not in message


def test_an_unknown_name_or_missing_file_names_the_option_and_the_allowed_models(tmp_path):
    with pytest.raises(CostModelError) as info:
        resolve_cost_model("gpt-17-on-abacus")
    assert str(info.value) == (
        f"--cost-model: bad value 'gpt-17-on-abacus' (unknown cost model); allowed: linear, {', '.join(preset_names())} "
        "or the path of a preset YAML file"
    )
    with pytest.raises(CostModelError, match=r"replay.cost_model: bad value '.*nope.yaml' \(no such file\)"):
        resolve_cost_model(str(tmp_path / "nope.yaml"), "replay.cost_model")
    with pytest.raises(CostModelError, match="cannot be read"):
        load_preset(tmp_path / "absent.yaml")


def test_a_profile_names_its_cost_model(tmp_path):
    good = _write(tmp_path, _preset_doc(), "good.yaml")
    profile = _write(tmp_path, {"replay": {"cost_model": str(good)}}, "p.yaml")
    assert check_replay_settings(load_settings(environ={}, profile=str(profile)))["replay.cost_model"] == str(good)
    named = _write(tmp_path, {"replay": {"cost_model": PRESET}}, "named.yaml")
    assert cost_from_settings(load_settings(environ={}, profile=str(named))) == resolve_cost_model(PRESET)
    bad = _write(tmp_path, {"replay": {"cost_model": "warp-drive"}}, "bad.yaml")
    with pytest.raises(SettingsError) as info:
        check_replay_settings(load_settings(environ={}, profile=str(bad)))
    assert str(info.value) == (f"profile {bad}, key replay.cost_model: bad value 'warp-drive'; allowed: linear, "
                               f"{', '.join(preset_names())} or the path of a preset YAML file")
    broken = _write(tmp_path, _preset_doc(step_fixed_ms=-2), "broken.yaml")
    profile = _write(tmp_path, {"replay": {"cost_model": str(broken)}}, "p2.yaml")
    with pytest.raises(SettingsError, match="coefficients.step_fixed_ms: bad value -2"):
        check_replay_settings(load_settings(environ={}, profile=str(profile)))


def test_the_engines_loader_leaves_the_cost_model_to_the_replay(tmp_path):
    """The engine never reads replay.cost_model: its loader keeps the value as written, and the replay's own check
    (every replay command runs it before anything runs) is the one that refuses it."""
    bad = _write(tmp_path, {"replay": {"cost_model": "warp-drive"}}, "bad.yaml")
    assert load_settings(environ={}, profile=str(bad))["replay.cost_model"] == "warp-drive"


def test_replay_rejects_a_bad_profile_cost_model_before_running(tmp_path, capsys):
    from fdsched.tools.cli import main

    bad = _write(tmp_path, {"replay": {"cost_model": "warp-drive"}}, "bad.yaml")
    out = tmp_path / "out"
    assert main(["replay", "--trace", "pressure", "--profile", str(bad), "--out", str(out), "--no-progress"]) == 1
    assert f"profile {bad}, key replay.cost_model: bad value 'warp-drive'; allowed: linear" in capsys.readouterr().err
    assert not (out / "report.json").exists()


def test_replay_rejects_a_bad_cost_model_before_running(tmp_path, capsys):
    from fdsched.tools.cli import main

    assert main(["replay", "--trace", "pressure", "--cost-model", "nope", "--out", str(tmp_path), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == (
        f"fdsched replay: error: --cost-model: bad value 'nope' (unknown cost model); allowed: linear, {', '.join(preset_names())} "
        "or the path of a preset YAML file"
    )
    assert not (tmp_path / "report.json").exists()


# ---- the report names the model ------------------------------------------------------------------
def _report_run(profile, cost):
    run = ProfileRun(profile=profile, num_gpu_blocks=10, cost=cost, drained=True)
    run.steps = [StepRow(0, prefill_tokens=4, prefill_context_tokens=10), StepRow(1, decode_tokens=1, decode_context_tokens=5)]
    run.requests = [RequestRow("r", 0, 4, 2, output_tokens=2, prefill_tokens=4, cache_hit_tokens=0, first_token_step=0,
                               finish_step=1, finish_count=1)]
    run.host = {"version": "2.6.0", "commit": "d38eeb8"}
    return run


def test_report_json_and_header_name_the_cost_model_and_its_coefficients():
    preset = resolve_cost_model(PRESET)
    report = build_report({"name": "t", "description": "", "requests": 1, "sha256": "0" * 64}, {"block_size": 4},
                          [_report_run("a", preset), _report_run("b", preset)])
    for p in report["profiles"]:
        assert p["cost_model"]["model"] == PRESET
        assert p["cost_model"]["per_decode_context_token_ms"] == preset.per_decode_context_token_ms
    header = format_header(report)
    line = next(line for line in header.splitlines() if line.startswith("cost model"))
    assert line.startswith(f"cost model {PRESET}: step_fixed_ms {preset.fixed_ms:g}")
    assert f"per_decode_context_token_ms {preset.per_decode_context_token_ms:g}" in line
    assert "github.com/microsoft/vidur" in line
    # the step series uses the context-aware duration
    assert report["profiles"][0]["series"]["step_end_ms"][0] == round(row_step_ms(preset, _report_run("a", preset).steps[0]), 3)
    mixed = build_report({"name": "t", "description": "", "requests": 1, "sha256": "0" * 64}, {"block_size": 4},
                         [_report_run("a", preset), _report_run("b", StepCost())])
    lines = [line for line in format_header(mixed).splitlines() if line.startswith("cost model")]
    assert lines[0].startswith(f"cost model of arm a: {PRESET}") and lines[1].startswith("cost model of arm b: linear")
