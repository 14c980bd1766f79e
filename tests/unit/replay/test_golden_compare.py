"""fdsched.replay.golden's comparison names the first differing step, request or figure (no host needed)."""

from __future__ import annotations

import copy
import hashlib
import json

from fdsched.replay import golden


def _entry(steps, requests, figures):
    digest = hashlib.sha256()
    for line in steps + [["requests"]] + requests:
        digest.update(json.dumps(line, separators=(",", ":")).encode())
        digest.update(b"\n")
    return {"trace": "t", "profile": "p", "sha256": digest.hexdigest(), "steps": len(steps), "figures": figures,
            "log": steps, "requests": requests}


STEPS = [
    [[["a", 0, 16]], [], [], [], 0, 1, 0, 2, 2, 0, 0.0],
    [[], [], ["a"], [], 0, 1, 0, 2, 2, 0, 0.0],
    [[], [["a", "decode"]], [], [], 1, 0, 1, 0, 0, 0, 0.0],
]
REQUESTS = [["a", 1, 5, 1, 1, 0, 32, 4]]
FIGURES = {"preemptions": 1, "throughput_tokens_per_s": 12.5}


def test_identical_logs_compare_equal():
    assert golden.compare(_entry(STEPS, REQUESTS, FIGURES), _entry(copy.deepcopy(STEPS), REQUESTS, dict(FIGURES))) is None


def test_the_first_differing_step_and_field_are_named():
    changed = copy.deepcopy(STEPS)
    changed[2][1] = [["a", "prefill"]]
    changed[2][5] = 3
    message = golden.compare(_entry(STEPS, REQUESTS, FIGURES), _entry(changed, REQUESTS, FIGURES))
    assert message.startswith("trace t, profile p: first differing step 2: ")
    assert "preempted: golden [['a', 'decode']], now [['a', 'prefill']]" in message and "running: golden 0, now 3" in message


def test_a_longer_run_and_a_differing_request_are_named():
    message = golden.compare(_entry(STEPS, REQUESTS, FIGURES), _entry(STEPS[:2], REQUESTS, FIGURES))
    assert "the first 2 steps agree" in message and "golden run has 3 steps and this one 2" in message
    other = [["a", 1, 5, 1, 2, 0, 32, 4]]
    message = golden.compare(_entry(STEPS, REQUESTS, FIGURES), _entry(STEPS, other, FIGURES))
    assert "request a differs: preemptions: golden 1, now 2" in message


def test_figures_compare_within_float_noise_and_a_dropped_figure_fails():
    near = {"preemptions": 1, "throughput_tokens_per_s": 12.5 * (1 + 1e-12), "new_key": 3}
    assert golden.compare(_entry(STEPS, REQUESTS, FIGURES), _entry(STEPS, REQUESTS, near)) is None
    far = {"preemptions": 1, "throughput_tokens_per_s": 12.6}
    assert "report figure 'throughput_tokens_per_s': golden 12.5, now 12.6" in golden.compare(
        _entry(STEPS, REQUESTS, FIGURES), _entry(STEPS, REQUESTS, far))
    assert "'preemptions' (golden 1) is no longer computed" in golden.compare(
        _entry(STEPS, REQUESTS, FIGURES), _entry(STEPS, REQUESTS, {"throughput_tokens_per_s": 12.5}))


def test_ci_subset_covers_every_profile_on_the_synthetic_traces():
    assert golden.in_ci_subset("pressure", "anything")
    assert golden.in_ci_subset("azure-conv", "recommended") and not golden.in_ci_subset("azure-conv", "deferred_recycle")
    assert not golden.in_ci_subset("unknown-trace", "baseline")
