"""Pure scheduling and cache policies.

Everything here takes plain values and returns plain values. Nothing imports FastDeploy, so every
decision the plugin makes can be tested with ordinary Python objects. The patches in
``fdsched.patches`` translate host objects into these values and apply the answers.

Formulas follow upstream FastDeploy PR 7444 (2.6 cherry-pick 7783); the code is our own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from fdsched.core.common import ceil_div

__all__ = [
    "VictimCandidate",
    "is_decoding",
    "select_preemption_victim",
    "select_any_phase_victim",
    "max_new_tokens_of",
    "reserve_blocks_for_request",
    "reestimate_new_token_ratio",
    "NewTokenRatio",
    "FixedBlockReserve",
    "NoVictimWarning",
]


# --------------------------------------------------------------------------------------------
# Decode detection: the one function every caller uses (victim choice, ratio estimate, metrics).
# --------------------------------------------------------------------------------------------
def is_decoding(status_is_decode: Optional[bool], num_total_tokens: int, need_prefill_tokens: int) -> bool:
    """Is a running request in its decode phase?

    ``status_is_decode`` is the host's own answer where it has one (a host with the split
    ``RUNNING_PREFILL``/``RUNNING_DECODE`` status passes ``status == RUNNING_DECODE``) and is
    authoritative. A host with a single ``RUNNING`` status passes ``None``; the answer is then
    derived from token counts: a request decodes once it has produced a token after its last
    prefill finished, i.e. ``num_total_tokens > need_prefill_tokens``. That is exactly the moment
    a host with split running statuses has its token processor flip PREFILL to DECODE, because a rescheduled request's
    ``need_prefill_tokens`` is set to its total tokens at re-admission.
    """
    if status_is_decode is not None:
        return bool(status_is_decode)
    return num_total_tokens > need_prefill_tokens


# --------------------------------------------------------------------------------------------
# Preemption victims
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VictimCandidate:
    """What the victim selector may know about one running request, in running-queue order."""

    request_id: str
    decoding: bool
    uses_extend_tables: bool


def select_preemption_victim(candidates: Sequence[VictimCandidate]) -> Optional[int]:
    """Decode-only preemption: the index of the last decoding request without extend tables.

    Scans from the back of the running queue (last in, first out). Prefill and chunked-prefill
    requests are never chosen. Returns ``None`` when no request qualifies.
    """
    for index in range(len(candidates) - 1, -1, -1):
        candidate = candidates[index]
        if candidate.decoding and not candidate.uses_extend_tables:
            return index
    return None


def select_any_phase_victim(candidates: Sequence[VictimCandidate]) -> Optional[int]:
    """Pre-change preemption: the last request without extend tables, whatever its phase."""
    for index in range(len(candidates) - 1, -1, -1):
        if not candidates[index].uses_extend_tables:
            return index
    return None


class NoVictimWarning:
    """Warn once per episode when preemption finds no victim.

    An episode starts at the first schedule() pass that finds no victim and ends at the first pass
    that does not hit that state. ``should_warn`` answers True once per episode.
    """

    def __init__(self) -> None:
        self._in_episode = False
        self._hit_this_pass = False
        self.episodes = 0

    def should_warn(self) -> bool:
        self._hit_this_pass = True
        if self._in_episode:
            return False
        self._in_episode = True
        self.episodes += 1
        return True

    def end_pass(self) -> None:
        """Call once after every schedule() pass."""
        if not self._hit_this_pass:
            self._in_episode = False
        self._hit_this_pass = False


# --------------------------------------------------------------------------------------------
# Reservation for running requests' future decode tokens
# --------------------------------------------------------------------------------------------
def max_new_tokens_of(max_tokens: Optional[int], max_model_len: int, prompt_len: int) -> int:
    """A request's output budget: its ``max_tokens``, or what is left of the context when unset."""
    if max_tokens is None:
        return max_model_len - prompt_len
    return int(max_tokens)


def reserve_blocks_for_request(
    max_new_tokens: int, generated_tokens: int, ratio: float, clip_max_new_tokens: int, block_size: int
) -> int:
    """Blocks to keep free for one running request's future decode tokens.

    ``ceil(max(int(min(max_new_tokens - generated, clip) * ratio), 0) / block_size)``: a request
    that already generated more than its budget reserves nothing.
    """
    remaining = max_new_tokens - generated_tokens
    clipped = min(remaining, clip_max_new_tokens)
    reserved_tokens = max(int(clipped * ratio), 0)
    return ceil_div(reserved_tokens, block_size)


def reestimate_new_token_ratio(
    generated: Iterable[int],
    max_new_tokens: Iterable[int],
    num_decoding: int,
    block_size: int,
    extra_blocks_per_decode: int,
    cap: float,
) -> float:
    """The ratio after a preemption: how much of their budgets running requests have used.

    ``(sum(generated) + extra_blocks_per_decode * block_size * num_decoding) / (sum(max_new) + 1)``,
    capped at ``cap`` (upstream: the initial ratio; SGLang: 1.0).
    """
    total_generated = sum(generated)
    total_budget = sum(max_new_tokens)
    estimate = (total_generated + extra_blocks_per_decode * block_size * num_decoding) / (total_budget + 1)
    return min(estimate, cap)


class NewTokenRatio:
    """The new_token_ratio state machine of the ratio-based reservation policy."""

    def __init__(self, init: float, minimum: float, decay: float, cap: Optional[float] = None) -> None:
        self.init = init
        self.minimum = minimum
        self.decay = decay
        self.cap = init if cap is None else cap
        self.value = init

    @property
    def top(self) -> float:
        """The most the ratio can ever be: it starts at ``init``, only decays after a pass, and a re-estimate gives
        at most ``cap`` (``init`` again when nothing runs)."""
        return max(self.init, self.cap)

    def after_schedule(self, scheduled_anything: bool) -> None:
        """Relax the reservation a little after every pass that scheduled something."""
        if scheduled_anything:
            self.value = max(self.value - self.decay, self.minimum)

    def on_preemption(
        self,
        generated: Sequence[int],
        max_new_tokens: Sequence[int],
        num_decoding: int,
        block_size: int,
        extra_blocks_per_decode: int,
    ) -> float:
        """Re-estimate from what the running requests did; back to init if nothing runs."""
        if not generated:
            self.value = self.init
        else:
            self.value = reestimate_new_token_ratio(
                generated, max_new_tokens, num_decoding, block_size, extra_blocks_per_decode, self.cap
            )
        return self.value


class FixedBlockReserve:
    """The fixed-block reservation (ratio_reserve off; the pre-change policy) (FD_RESERVE_*_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL).

    ``init`` blocks per running request, decaying by ``decay`` per pass that scheduled something,
    never below ``minimum``; once it reaches 0 the reservation is off ("relaxed") until the next
    preemption puts it back to ``init``.
    """

    def __init__(self, init: int, decay: float, minimum: int) -> None:
        self.init = init
        self.decay = decay
        self.minimum = minimum
        self.current = init
        self._current_float = float(init)
        self.relaxed = True

    def threshold(self, chunk_blocks: int, num_running: int) -> int:
        if self.relaxed:
            return chunk_blocks
        return chunk_blocks + num_running * self.current

    def after_schedule(self, scheduled_anything: bool) -> None:
        if not scheduled_anything:
            return
        self._current_float -= self.decay
        self.current = max(int(self._current_float), self.minimum, 0)
        if self.current == 0:
            self.relaxed = True

    def on_preemption(self) -> None:
        self.current = self.init
        self._current_float = float(self.init)
        self.relaxed = False



class StallWatch:
    """Notices an admission that has stopped: passes that schedule nothing while requests wait, no request runs and
    blocks are free. One report per episode, once it has lasted ``min_passes`` passes and ``min_seconds`` seconds
    (a request still being preprocessed waits a few passes legitimately); a pass that schedules something, or a state
    that is not stuck, ends the episode. Plain values only: the scheduler's side gathers them."""

    def __init__(self, min_passes: int = 100, min_seconds: float = 30.0) -> None:
        self.min_passes = min_passes
        self.min_seconds = min_seconds
        self.passes = 0
        self.since: Optional[float] = None
        self.reported = False

    def clear(self) -> None:
        self.passes, self.since, self.reported = 0, None, False

    def observe(self, now: float, waiting: int, running: int, free_blocks: int) -> bool:
        """One pass that scheduled nothing; True exactly once per episode, when it should be reported."""
        if waiting == 0 or running or free_blocks <= 0:
            self.clear()
            return False
        if self.since is None:
            self.since = now
        self.passes += 1
        if self.reported or self.passes < self.min_passes or now - self.since < self.min_seconds:
            return False
        self.reported = True
        return True
