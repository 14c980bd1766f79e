"""Hook specifications for third-party scheduling policies (pluggy, project name ``fdsched``).

A third party ships a module with ``@fdsched.hookimpl`` functions and registers it under the
entry-point group ``fdsched.hooks``; the plugin loads it unless ``FDSCHED_DISABLE_EXTERNAL_HOOKS``
blocks it (``1`` blocks all, or a comma list of entry-point names). The plugin's own policies
(:mod:`fdsched.core.policies`) are registered as the last-resort implementations, so every hook always
has an answer. Every hook here stops at the first non-None result.
"""

from __future__ import annotations

from typing import Optional, Sequence

import pluggy

from fdsched.core.policies import VictimCandidate

__all__ = [
    "PROJECT",
    "hookimpl",
    "fdsched_select_preemption_victim",
    "fdsched_estimate_reserve_blocks",
    "fdsched_is_decoding",
]

PROJECT = "fdsched"
_hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@_hookspec(firstresult=True)
def fdsched_select_preemption_victim(candidates: Sequence[VictimCandidate], decode_only: bool) -> Optional[int]:
    """Choose which running request to preempt when a request cannot get KV blocks.

    Called inside ``schedule()`` under the scheduler lock, once per preemption, only when the
    plugin's preemption path is active (``changes.decode_only_preempt`` is ``on``, or ``off`` on a
    host that already has the change). Stops at the first non-None result.

    :param candidates: the running queue in order, oldest first, as plain values.
    :param decode_only: True when the decode-only policy is in force (a prefill must not be chosen).
    :returns: the index into ``candidates`` of the victim, or None to let the next implementation
        decide. The default implementation returns None only when no request qualifies, and the
        scheduler then gives up for this step.

    .. versionadded:: 0.1
    """


@_hookspec(firstresult=True)
def fdsched_estimate_reserve_blocks(
    request_id: str,
    max_new_tokens: int,
    generated_tokens: int,
    ratio: float,
    clip_max_new_tokens: int,
    block_size: int,
) -> Optional[int]:
    """How many free KV blocks to keep for one running request's future decode tokens.

    Called for every running request each time the ratio-based reservation decides whether a
    prefill (new, or the next chunk of a running one) may be admitted. Stops at the first non-None
    result. With the adaptive estimator (``FDSCHED_RESERVE_ESTIMATOR=adaptive``) a third-party
    answer replaces the estimator's for that request (it then stands outside the running set's one
    margin); None lets the estimator answer (the plugin's ratio default is not consulted then).

    :param request_id: the request's id.
    :param max_new_tokens: its output budget (``max_tokens``, else ``max_model_len`` - prompt length).
    :param generated_tokens: tokens it has generated so far.
    :param ratio: the current new_token_ratio.
    :param clip_max_new_tokens: ``FD_CLIP_MAX_NEW_TOKENS``.
    :param block_size: tokens per KV block.
    :returns: a block count >= 0, or None.

    .. versionadded:: 0.1
    """


@_hookspec(firstresult=True)
def fdsched_is_decoding(
    request_id: str, status_is_decode: Optional[bool], num_total_tokens: int, need_prefill_tokens: int
) -> Optional[bool]:
    """Is a running request in its decode phase?

    The one decode test used by victim choice, the ratio re-estimate and metrics. Called for every
    running request those need. Stops at the first non-None result.

    :param request_id: the request's id.
    :param status_is_decode: ``status == RUNNING_DECODE`` on a host with the split status, else None.
    :param num_total_tokens: prompt plus generated tokens.
    :param need_prefill_tokens: tokens its (last) prefill covers.
    :returns: True or False, or None.

    .. versionadded:: 0.1
    """
