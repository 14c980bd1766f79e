"""``replay.fetch: engine``: arrivals reach the real scheduler's waiting queue as the host's own engine hands them
over on a mixed node (fdsched.replay.drive.engine_fetch_rule), against the replay's default (every arrival at once).

A burst of short requests arrives at once. New host: the engine's fetch thread hands over one request, and only
when the waiting queue is empty, so at most one new request starts per step. Old host: every arrived request is
handed over while a batch slot is free, as by default. Runs on whichever host is configured (both in CI).
"""

from __future__ import annotations

from collections import Counter

import pytest

from fdsched.replay.tracefile import parse_trace

HEADER = ('{"header": {"engine": {"block_size": 16, "num_gpu_blocks": 200, "max_num_seqs": 8, '
          '"max_num_batched_tokens": 512, "max_model_len": 512}}}')
BURST = 6


def _trace():
    lines = [HEADER] + [
        f'{{"id": "r{i}", "arrival_s": 0.0, "prompt_len": 20, "max_tokens": 4, "output_len": 4}}' for i in range(BURST)
    ]
    return parse_trace(lines, name="burst")


def _starts_per_step(tmp_path, fetch):
    from fdsched.replay.runner import run_profile

    profile = tmp_path / f"fetch-{fetch}.yaml"
    profile.write_text(f'changes: {{others: "on"}}\nreplay: {{fetch: {fetch}}}\n', encoding="utf-8")
    trace = _trace()
    run = run_profile(trace, str(profile), trace.engine_with())
    assert run.drained and all(row.output_tokens == 4 for row in run.requests)
    return Counter(row.first_token_step for row in run.requests), run


def test_engine_fetch_hands_requests_over_as_the_hosts_engine_does(replay_host, tmp_path):
    from fdsched.replay.drive import FETCH_ONE_WHEN_EMPTY, FETCH_WHILE_SLOTS, engine_fetch_rule

    default, _ = _starts_per_step(tmp_path, "all")
    assert max(default.values()) == BURST  # every arrival in the first pass
    engine, run = _starts_per_step(tmp_path, "engine")
    assert run.settings["replay.fetch"] == "engine"
    rule = engine_fetch_rule("engine", "mixed")
    commit = replay_host.commit or ""
    assert commit.startswith(("d38eeb8", "e7c8dc2")), f"a host this test does not know: {commit}"
    if commit.startswith("d38eeb8"):  # the new host
        assert rule == FETCH_ONE_WHEN_EMPTY
        assert max(engine.values()) == 1  # one new request per step
        assert len(engine) == BURST
    else:
        assert rule == FETCH_WHILE_SLOTS
        assert engine == default


def test_the_default_and_other_roles_keep_every_arrival_at_once(replay_host):
    from fdsched.replay.drive import FETCH_ALL, engine_fetch_rule

    assert engine_fetch_rule("all", "mixed") == FETCH_ALL
    assert engine_fetch_rule("engine", "prefill") == FETCH_ALL
