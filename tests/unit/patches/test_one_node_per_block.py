"""The record floor of ``one_node_per_block`` with plain values."""

from __future__ import annotations

from types import SimpleNamespace

from fdsched.patches.one_node_per_block import raised_record
from fdsched.patches.prefill_node_reserve import PrefillNodeReserve, _where_the_host_reserves


def test_a_computed_count_below_the_cached_count_is_raised_to_it():
    # a fully cached 8-token prompt, its last block recomputed in chunks of 3 then 1 (block size 4)
    assert raised_record(num_computed_tokens=7, cached_tokens=8, block_size=4) == 8
    assert raised_record(num_computed_tokens=4, cached_tokens=8, block_size=4) == 8
    # every other record is the host's own
    assert raised_record(num_computed_tokens=8, cached_tokens=8, block_size=4) == 8
    assert raised_record(num_computed_tokens=11, cached_tokens=8, block_size=4) == 11
    assert raised_record(num_computed_tokens=3, cached_tokens=0, block_size=4) == 3


def test_the_prefill_fix_is_in_an_arm_only_where_the_hosts_reservation_runs():
    def settings(mode):
        return SimpleNamespace(change_mode=lambda change_id: mode if change_id == "ratio_reserve" else "auto")

    assert _where_the_host_reserves(False, settings("auto")) is PrefillNodeReserve
    assert _where_the_host_reserves(False, settings("on")) is None  # the plugin's reservation answers
    assert _where_the_host_reserves(False, settings("off")) is None  # the pre-change reservation answers
