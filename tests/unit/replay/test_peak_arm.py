"""The replay glue of issue 18's arms (fdsched.replay.peak_arm), on stand-in request objects (no host)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from fdsched.replay.peak_admission import PeakAdmission, QuantileController, QuantileLengths
from fdsched.core.settings import SettingsError, load_settings, shipped_profiles
from fdsched.replay.peak_arm import LearnedClipHook, PeakAdmissionHook, replay_admission_hook


def _request(rid, prompt, generated, blocks, max_tokens=None, computed=None):
    return SimpleNamespace(
        request_id=rid, block_tables=list(range(blocks)), extend_block_tables=[], output_token_ids=[0] * generated,
        prompt_token_ids_len=prompt, need_prefill_tokens=prompt, num_computed_tokens=prompt + generated if computed is None else computed,
        sampling_params=SimpleNamespace(max_tokens=max_tokens),
    )


EXAMPLE_PROFILES = Path(__file__).resolve().parents[3] / "examples" / "profiles"


def test_replay_admission_picks_the_hook_and_every_shipped_profile_keeps_its_own():
    shape = SimpleNamespace(enc_dec_block_num=2, max_model_len=4096, block_size=16)
    trace = SimpleNamespace(requests=[])
    for name in shipped_profiles():
        assert replay_admission_hook(load_settings(environ={}, profile=name), trace, shape, {}) is None, name
    peak = load_settings(environ={}, profile=str(EXAMPLE_PROFILES / "peak-adaptive.yaml"))
    clip = load_settings(environ={}, profile=str(EXAMPLE_PROFILES / "clip-learned.yaml"))
    assert isinstance(replay_admission_hook(peak, trace, shape, {}), PeakAdmissionHook)
    assert isinstance(replay_admission_hook(clip, trace, shape, {}), LearnedClipHook)

def test_a_bad_replay_admission_is_one_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("description: x\nreplay:\n  admission: peek\n")
    with pytest.raises(SettingsError, match=r"key replay.admission: bad value 'peek'; allowed: one of default, peak, clip-learned"):
        load_settings(environ={}, profile=str(bad))


def test_the_first_running_request_carries_the_whole_reserve_and_the_rest_answer_zero():
    adm = PeakAdmission(QuantileLengths(min_samples=1), QuantileController(), ahead=0)
    a, b = _request("a", 32, 0, 2), _request("b", 32, 0, 2)
    ref = {"manager": SimpleNamespace(running=[a, b])}
    hook = PeakAdmissionHook(ref, {}, 4096, 16, adm)
    for _ in range(10):
        hook.observe_finished("x", None, 32, 64)  # every request makes 64 tokens
    ref["candidate"] = (_request("c", 32, 0, 0, computed=0), 32)
    first = hook.fdsched_estimate_reserve_blocks("a", 4064, 0, 0.7, 4096, 16)
    assert first == 3 * 6 - 6  # three requests peak at 6 blocks each together; they hold 2 + 2 + 2
    assert hook.fdsched_estimate_reserve_blocks("b", 4064, 0, 0.7, 4096, 16) == 0
    # a running request's next chunk is the candidate once, not twice
    ref["candidate"] = (b, 0)
    assert hook.fdsched_estimate_reserve_blocks("a", 4064, 0, 0.7, 4096, 16) == 2 * 6 - 4
