"""Replay-only candidate arms: ``peak-adaptive`` (admission by the running set's predicted peak demand,
:class:`fdsched.replay.peak_admission.PeakAdmission`) and ``clip-learned`` (upstream's ratio formula with the
clip learned online, :class:`fdsched.replay.peak_admission.LearnedClip`), through the reservation hook the
clairvoyant ``oracle`` uses.

Both learn only what an engine sees: every finished request (its client's ``max_tokens`` and its output
length) and every preemption; never a running request's true length.

Which one runs is the setting ``replay.admission`` (``peak`` / ``clip-learned``; the profiles
``configs/peak-adaptive.yaml`` and ``configs/clip-learned.yaml`` set it). In an engine both profiles are
exactly ``recommended``: the key is read by the replay only.
"""

from __future__ import annotations

from typing import Callable, Optional

from fdsched.core.adaptive import client_bound
from fdsched.hookspecs import hookimpl
from fdsched.replay.peak_admission import LearnedClip, PeakAdmission, QuantileController, QuantileLengths, RunningView

__all__ = ["PEAK_PLUGIN_NAME", "PeakAdmissionHook", "LearnedClipHook", "replay_admission_hook"]

PEAK_PLUGIN_NAME = "fdsched-replay-peak-admission"


def _view(request, client_max: Optional[int], max_model_len: int, blocks_after: Optional[int] = None) -> RunningView:
    held = len(request.block_tables or []) + len(getattr(request, "extend_block_tables", None) or [])
    if blocks_after is not None:
        held = max(held, blocks_after)
    generated = len(request.output_token_ids)
    prompt = request.prompt_token_ids_len
    tokens = max(request.need_prefill_tokens, prompt + generated)
    budget = request.sampling_params.max_tokens or (max_model_len - prompt)
    budget = min(budget, max_model_len - prompt)
    return RunningView(held, tokens, generated, client_bound(client_max, max_model_len, prompt), max(budget - generated, 0))


class PeakAdmissionHook:
    """:class:`PeakAdmission` answering through ``fdsched_estimate_reserve_blocks``: the whole set's
    reserve for the first running request, 0 for the others (the host sums the answers and admits when
    ``free >= chunk + sum``), as :class:`fdsched.replay.oracle.PeakOracle` does."""

    watches_candidate = True  # the runner records the request get_new_block_nums was last asked about

    def __init__(self, manager_ref: dict, client_max_tokens: dict, max_model_len: int, block_size: int,
                 admission: Optional[PeakAdmission] = None) -> None:
        self.manager_ref = manager_ref
        self.client_max_tokens = client_max_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.admission = admission or PeakAdmission()
        self.calls = 0

    def observe_finished(self, request_id: str, max_tokens: Optional[int], prompt_len: int, output_tokens: int) -> None:
        bound = client_bound(self.client_max_tokens.get(request_id), self.max_model_len, prompt_len)
        self.admission.observe_finished(bound, output_tokens)

    def observe_preemption(self, count: int) -> None:
        self.admission.observe_preemption(count)

    def state(self) -> dict:
        return self.admission.state()

    def _snapshot(self):
        manager = self.manager_ref["manager"]
        cm = self.client_max_tokens
        running = [_view(r, cm.get(r.request_id), self.max_model_len) for r in manager.running]
        ids = [r.request_id for r in manager.running]
        candidate = self.manager_ref.get("candidate")
        if candidate is not None:
            request, new_tokens = candidate
            after = -(-(request.num_computed_tokens + new_tokens) // self.block_size)
            view = _view(request, cm.get(request.request_id), self.max_model_len, blocks_after=after)
            if request.request_id in ids:  # a running request's next chunk: it is the candidate, once
                del running[ids.index(request.request_id)]
            candidate = view
        return running, candidate

    @hookimpl
    def fdsched_estimate_reserve_blocks(
        self, request_id, max_new_tokens, generated_tokens, ratio, clip_max_new_tokens, block_size
    ) -> Optional[int]:
        self.calls += 1
        running = self.manager_ref["manager"].running
        if not running or running[0].request_id != request_id:
            return 0
        views, candidate = self._snapshot()
        return self.admission.reserve_blocks(views, candidate, block_size)


class LearnedClipHook:
    """:class:`LearnedClip` per running request (upstream's formula, the clip learned online)."""

    watches_candidate = False

    def __init__(self, clip: Optional[LearnedClip] = None) -> None:
        self.clip = clip or LearnedClip()
        self.calls = 0

    def observe_finished(self, request_id: str, max_tokens: Optional[int], prompt_len: int, output_tokens: int) -> None:
        self.clip.observe_finished(max_tokens, output_tokens)

    def observe_preemption(self, count: int) -> None:
        pass

    def state(self) -> dict:
        return self.clip.state()

    @hookimpl
    def fdsched_estimate_reserve_blocks(
        self, request_id, max_new_tokens, generated_tokens, ratio, clip_max_new_tokens, block_size
    ) -> Optional[int]:
        self.calls += 1
        return self.clip.reserve_blocks(max_new_tokens, generated_tokens, ratio, clip_max_new_tokens, block_size)


def replay_admission_hook(settings, trace, shape, manager_ref: dict):
    """The issue-18 hook that ``replay.admission`` names, or None (``default``)."""
    kind = settings["replay.admission"]
    if kind == "default":
        return None
    if kind == "clip-learned":
        return LearnedClipHook()
    client = {r.id: r.max_tokens for r in trace.requests}
    admission = PeakAdmission(QuantileLengths(), QuantileController(), ahead=shape.enc_dec_block_num)
    return PeakAdmissionHook(manager_ref, client, shape.max_model_len, shape.block_size, admission)
