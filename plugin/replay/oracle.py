"""Replay reservation hooks: ``oracle`` (each running request reserves its true remaining output) and
the ``adaptive-replay`` prototype (:class:`AdaptiveReserveHook`).

Imports nothing from FastDeploy. The replay knows every request's true output length from the
trace; registered on the installed plugin's :class:`fdsched.hooks.Policies`, this hook replaces the
new_token_ratio estimate with ``ceil(max(true_output - generated, 0) / block_size)`` blocks, the
limit a reservation policy can approach. Requests it does not know are left to the next
implementation (the plugin's default).
"""

from __future__ import annotations

from typing import Mapping, Optional

from fdsched.common import blocks_for_tokens
from fdsched.hookspecs import hookimpl

__all__ = ["OracleReserve", "ORACLE_PLUGIN_NAME", "AdaptiveReserveHook", "ADAPTIVE_PLUGIN_NAME"]

ORACLE_PLUGIN_NAME = "fdsched-replay-oracle"


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


ADAPTIVE_PLUGIN_NAME = "fdsched-replay-adaptive"


class AdaptiveReserveHook:
    """Prototype of the adaptive reservation through the hook route (replay arm ``adaptive-replay``).

    The runner feeds it what an engine sees: every finished request (its client's ``max_tokens``
    and the tokens it generated) and every preemption; never a running request's true length. The
    hook answers per running request; the reservation's one margin over the running set is spread
    over the answers (:class:`fdsched.adaptive.SetMargin`), which sum to the set's reservation. A
    new set starts when a request id comes round again (the plugin asks for every running request,
    in order, once per admission decision). Until it has learned, it answers like the plugin's
    default (upstream's ratio formula).

    Once the estimator is wired into ``ratio_reserve`` (one call per decision, no hook), this hook
    is only a way to try variants in the replay.
    """

    def __init__(self, max_model_len: int, init_ratio: float, estimator=None) -> None:
        from fdsched.adaptive import AdaptiveReserve, SetMargin

        self.max_model_len = max_model_len
        self.init_ratio = init_ratio
        self.estimator = estimator or AdaptiveReserve()
        self.client_max_tokens: dict = {}  # request id -> max_tokens as the client sent it
        self._margin = SetMargin()
        self._seen: set = set()
        self.calls = 0

    def observe_finished(self, request_id: str, max_tokens: Optional[int], prompt_len: int, output_tokens: int) -> None:
        self.estimator.observe_finished(max_tokens, output_tokens)

    def observe_preemption(self, count: int) -> None:
        self.estimator.observe_preemption(count)

    def state(self) -> dict:
        return self.estimator.state()

    @hookimpl
    def fdsched_estimate_reserve_blocks(
        self, request_id, max_new_tokens, generated_tokens, ratio, clip_max_new_tokens, block_size
    ) -> Optional[int]:
        from fdsched.policies import reserve_blocks_for_request

        self.calls += 1
        if request_id in self._seen:
            self._seen.clear()
            self._margin.reset()
        self._seen.add(request_id)
        max_tokens = self.client_max_tokens.get(request_id)
        estimate = self.estimator.remainder(max_tokens, max_new_tokens, generated_tokens)
        if estimate is None:
            self.estimator.fallbacks += 1
            return reserve_blocks_for_request(max_new_tokens, generated_tokens, ratio, clip_max_new_tokens, block_size)
        return self._margin.add(estimate.mean, estimate.variance, self.estimator.k, block_size)
