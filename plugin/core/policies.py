"""Pure preemption and stall policies: which request is decoding, which one a preemption takes, when an
admission has stopped.

Everything here takes plain values and returns plain values. Nothing imports FastDeploy, so every decision can be
tested with ordinary Python objects; the patches in ``fdsched.patches`` translate host objects into these values and
apply the answers. The reservation's formulas and the admission budget are :mod:`fdsched.core.admission`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


__all__ = [
    "VictimCandidate",
    "is_decoding",
    "select_preemption_victim",
    "select_any_phase_victim",
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
        self.in_episode = False  # (set by a hit: a pass that ends outside an episode has nothing to end)
        self._hit_this_pass = False
        self.episodes = 0

    def should_warn(self) -> bool:
        self._hit_this_pass = True
        if self.in_episode:
            return False
        self.in_episode = True
        self.episodes += 1
        return True

    def end_pass(self) -> None:
        """Call once after every schedule() pass."""
        if not self._hit_this_pass:
            self.in_episode = False
        self._hit_this_pass = False


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
