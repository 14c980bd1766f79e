"""Trace generators and the `fdsched trace` commands. No host."""

from __future__ import annotations

import math

import pytest

from fdsched.tools.cli import main
from fdsched.replay.generate import DEFAULT_REQUESTS, KINDS, generate, generate_text, peak_demand_blocks
from fdsched.replay.trace import check_engine
from fdsched.replay.tracefile import load_trace, parse_trace, resolve_trace


def _blocks(tokens, block_size):
    return -(-tokens // block_size)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_same_arguments_same_bytes_and_valid(kind):
    text = generate_text(kind, 20, 7)
    assert generate_text(kind, 20, 7) == text
    assert generate_text(kind, 20, 8) != text
    trace = parse_trace(text.splitlines())
    assert len(trace.requests) == 20
    assert trace.generator == {"kind": kind, "requests": 20, "seed": 7}
    check_engine(trace, trace.engine_with())


@pytest.mark.parametrize("name", ["pressure", "shared-prefix", "pd-prefill"])
def test_shipped_traces_are_what_the_generator_makes(name):
    path = resolve_trace(name)
    trace = load_trace(path)
    gen = trace.generator
    assert gen["kind"] == name
    assert path.read_text(encoding="utf-8") == generate_text(gen["kind"], gen["requests"], gen["seed"])


def test_peak_demand_on_a_small_example():
    requests = [
        {"arrival": 0, "prompt_len": 8, "max_tokens": None, "output_len": 4},  # 8+4 tokens -> 3 blocks of 4
        {"arrival": 1, "prompt_len": 4, "max_tokens": 2, "output_len": 9},  # stops at 2: 4+2 -> 2 blocks
    ]
    # step 0: r0 holds 9 tokens (3 blocks); step 1: r0 10 (3) + r1 5 (2) = 5; step 2: r0 11 (3) + r1 6 (2) = 5
    assert peak_demand_blocks(requests, 4, 8) == 5
    # one at a time: never both
    assert peak_demand_blocks(requests, 4, 1) == 3


def test_pressure_pool_is_about_one_and_a_half_short():
    engine, requests, _, _ = generate("pressure", DEFAULT_REQUESTS["pressure"], 0)
    peak = peak_demand_blocks(requests, engine["block_size"], engine["max_num_seqs"])
    assert engine["num_gpu_blocks"] == max(math.ceil(peak / 1.5), _blocks(engine["max_model_len"], engine["block_size"]) + 2)
    assert 1.4 < peak / engine["num_gpu_blocks"] <= 1.5
    assert min(r["output_len"] for r in requests) >= 256  # long outputs


def test_shared_prefix_pool_cannot_keep_every_suffix():
    engine, requests, _, _ = generate("shared-prefix", DEFAULT_REQUESTS["shared-prefix"], 0)
    bs = engine["block_size"]
    groups = {(r["prefix_group"], r["prefix_len"]) for r in requests}
    assert 1 < len(groups) <= 4 and all(r.get("prefix_group") for r in requests)
    cached_prefixes = sum(length // bs for _, length in groups)
    private_full_blocks = sum((r["prompt_len"] - r["prefix_len"]) // bs for r in requests)
    # What the radix tree would hold if nothing were evicted does not fit the pool.
    assert cached_prefixes + private_full_blocks > engine["num_gpu_blocks"]
    # ... but every system prompt does, with room for each running request's private blocks.
    assert engine["num_gpu_blocks"] - cached_prefixes >= engine["max_num_seqs"] * 4


def test_pd_prefill_is_a_prefill_node_with_shared_prefixes():
    engine, requests, _, _ = generate("pd-prefill", 30, 1)
    assert engine["splitwise_role"] == "prefill"
    assert sum(1 for r in requests if "prefix_group" in r) >= 15


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown trace kind"):
        generate("nope", 3, 0)
    with pytest.raises(ValueError, match="requests=0"):
        generate("pressure", 0, 0)


def test_cli_generate_then_validate(tmp_path, capsys):
    out = tmp_path / "sub" / "t.jsonl"
    assert main(["trace", "generate", "--kind", "shared-prefix", "--requests", "12", "--seed", "3", "--out", str(out)]) == 0
    assert out.read_text() == generate_text("shared-prefix", 12, 3)
    assert main(["trace", "validate", str(out)]) == 0
    assert "12 requests" in capsys.readouterr().out


def test_cli_generate_to_stdout(capsys):
    assert main(["trace", "generate", "--kind", "pressure", "--requests", "2"]) == 0
    assert capsys.readouterr().out == generate_text("pressure", 2, 0)


def test_cli_validate_reports_line_and_field(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "arrival": 0, "prompt_len": 4, "max_tokens": null, "output_len": 1}\n'
                   '{"id": "b", "arrival": 0, "prompt_len": -4, "max_tokens": null, "output_len": 1}\n')
    assert main(["trace", "validate", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "bad.jsonl line 2, field 'prompt_len'" in err


def test_cli_list(capsys):
    assert main(["trace", "list"]) == 0
    out = capsys.readouterr().out
    assert "pressure:" in out and "shared-prefix:" in out and "pd-prefill:" in out
