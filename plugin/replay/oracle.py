"""The ``oracle`` profile's reservation: each running request reserves its true remaining output.

Imports nothing from FastDeploy. The replay knows every request's true output length from the
trace; registered on the installed plugin's :class:`fdsched.hooks.Policies`, this hook replaces the
new_token_ratio estimate with ``ceil(max(true_output - generated, 0) / block_size)`` blocks, the
limit a reservation policy can approach. Requests it does not know are left to the next
implementation (the plugin's default).
"""

from __future__ import annotations

from typing import Mapping, Optional

from fdsched.hookspecs import hookimpl

__all__ = ["OracleReserve", "ORACLE_PLUGIN_NAME"]

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
        remaining = max(true_output - generated_tokens, 0)
        return -(-remaining // block_size)
