"""Replay-only policies: the clairvoyant admission bound ``oracle`` (:class:`PeakOracle`), the
reserve-the-true-remainder hook (:class:`OracleReserve`) and SGLang's retract order (:class:`RetractOrder`).

Imports nothing from FastDeploy: the runner turns host requests into plain :class:`Holding` values.

``oracle`` (profile ``oracle``, ``replay.oracle_reserve: true``) knows every request's true output
length. A prefill (a new request, or the next chunk of a running one) is admitted only when the
running set's *peak* future KV demand, with the candidate added, fits the pool
(:func:`peak_demand_blocks`): each request holds ``ceil(tokens / block_size) + ahead`` blocks as it
decodes (``ahead``: the one block the host allocates before it is full) and gives every block back
after its last token. The demand is a step function that grows until some request finishes, so its
peak is found at ``t = 0`` and just before each finish: O(k^2) for k running requests. The earlier
``oracle`` (each running request reserves its whole true remainder) is :class:`OracleReserve`: it
gives no credit for the blocks finishing requests give back, so it is no bound (``adaptive`` beat it).

Both are conservative where the replay cannot know better: a candidate's (or a running request's)
unfinished prefill counts as held at once, and a block two requests share through the prefix cache
counts twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from fdsched.core.common import blocks_for_tokens, ceil_div
from fdsched.hookspecs import hookimpl

__all__ = [
    "OracleReserve", "ORACLE_PLUGIN_NAME", "Holding",
    "peak_demand_blocks", "PeakOracle", "RetractOrder", "RETRACT_PLUGIN_NAME", "sglang_victim",
]

ORACLE_PLUGIN_NAME = "fdsched-replay-oracle"
RETRACT_PLUGIN_NAME = "fdsched-replay-retract"


@dataclass(frozen=True)
class Holding:
    """One request's KV now and to come, as plain values."""

    request_id: str
    held_blocks: int  # blocks it holds now
    tokens: int  # tokens whose KV it holds once its current prefill is done (prompt + generated so far)
    remaining: int  # output tokens still to come (true length - generated)


def _need(h: Holding, t: int, block_size: int, ahead: int) -> int:
    """Blocks ``h`` holds after ``t`` more tokens (while it still runs)."""
    return max(h.held_blocks, ceil_div(h.tokens + t, block_size) + ahead)


def peak_demand_blocks(holdings: Sequence[Holding], block_size: int, ahead: int = 1) -> int:
    """The most blocks ``holdings`` hold at once from now until the last finishes, each one decoding one
    token per step and giving its blocks back after its last token (``remaining`` steps from now).

    Demand only grows between finishes, so the peak is at ``t = 0`` or at ``t = remaining - 1`` of some
    request (its last step)."""
    alive = [h for h in holdings]
    if not alive:
        return 0
    times = {0} | {max(h.remaining - 1, 0) for h in alive}
    best = 0
    for t in times:
        total = sum(_need(h, t, block_size, ahead) for h in alive if h.remaining > t or t == 0)
        best = max(best, total)
    return best


class PeakOracle:
    """The clairvoyant admission bound, answering through the reservation hook.

    ``snapshot()`` (given by the runner) returns ``(running, candidate)``: :class:`Holding` values of the
    running requests and of the prefill being decided, with ``held_blocks`` counting the chunk it is
    about to get (None when unknown). The plugin asks the hook once per running request and admits when
    ``free >= chunk + sum(answers)``; this hook answers the whole set's reserve for the first running
    request, ``max(0, peak - blocks the running set and the candidate hold with its chunk)``, and 0 for
    the others, so the sum is the reserve and admission means: the peak fits the pool.
    """

    watches_candidate = True  # the runner records the request get_new_block_nums was last asked about

    def __init__(self, snapshot: Callable[[], tuple], block_size: int, ahead: int = 1,
                 first_running: Optional[Callable[[], Optional[str]]] = None) -> None:
        self.snapshot = snapshot
        self.first_running = first_running  # the first running request's id, cheaper than a snapshot
        self.block_size = block_size
        self.ahead = ahead
        self.calls = 0
        self.decisions = 0

    def reserve(self, running: Sequence[Holding], candidate: Optional[Holding]) -> int:
        others = [h for h in running if candidate is None or h.request_id != candidate.request_id]
        together = others + ([candidate] if candidate is not None else [])
        held = sum(h.held_blocks for h in together)
        return max(0, peak_demand_blocks(together, self.block_size, self.ahead) - held)

    @hookimpl
    def fdsched_estimate_reserve_blocks(
        self, request_id, max_new_tokens, generated_tokens, ratio, clip_max_new_tokens, block_size
    ) -> Optional[int]:
        self.calls += 1
        if self.first_running is not None and self.first_running() != request_id:
            return 0
        running, candidate = self.snapshot()
        if not running or running[0].request_id != request_id:
            return 0
        self.decisions += 1
        return self.reserve(running, candidate)


def sglang_victim(candidates: Sequence, lengths: Callable[[str], Optional[tuple]], decode_only: bool) -> Optional[int]:
    """SGLang's retract order: among the requests that may be preempted (decoding when ``decode_only``,
    none using extend tables), the one with the fewest generated tokens, then the longest prompt, then
    the newest. ``lengths(request_id)`` -> ``(generated, prompt_len)`` or None (not eligible)."""
    best, best_key = None, None
    for index, c in enumerate(candidates):
        if c.uses_extend_tables or (decode_only and not c.decoding):
            continue
        known = lengths(c.request_id)
        if known is None:
            continue
        generated, prompt_len = known
        key = (generated, -prompt_len, -index)
        if best_key is None or key < best_key:
            best, best_key = index, key
    return best


class RetractOrder:
    """SGLang's retract order as a victim hook (replay only: the hook's candidates carry no lengths, so
    the runner gives ``lengths``; an engine-side hook would need them in :class:`fdsched.core.policies.VictimCandidate`)."""

    def __init__(self, lengths: Callable[[str], Optional[tuple]]) -> None:
        self.lengths = lengths
        self.calls = 0

    @hookimpl
    def fdsched_select_preemption_victim(self, candidates, decode_only) -> Optional[int]:
        self.calls += 1
        return sglang_victim(candidates, self.lengths, decode_only)


class OracleReserve:
    def __init__(self, true_output_lengths: Mapping[str, int]) -> None:
        self.true_output_lengths = dict(true_output_lengths)
        self.calls = 0

    @hookimpl
    def fdsched_estimate_reserve_blocks(
        self, request_id, max_new_tokens, generated_tokens, ratio, clip_max_new_tokens, block_size
    ) -> Optional[int]:
        true_output = self.true_output_lengths.get(request_id)
        if true_output is None:
            return None
        self.calls += 1
        return blocks_for_tokens(true_output - generated_tokens, block_size)


