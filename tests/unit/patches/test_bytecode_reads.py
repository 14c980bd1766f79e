"""The bytecode readers that decide a host fix is "not needed" (patches/_base.py), on plain functions written the
two ways a host line can be: with the check and without it."""

from __future__ import annotations

from fdsched.patches._base import compares_locals, stores_constant


def _records_with_check(self, computed, block_size):
    last_node, num_cached_tokens = self.info
    can_cache_computed_tokens = computed - computed % block_size
    if can_cache_computed_tokens <= num_cached_tokens:
        return None
    return last_node


def _records_without_check(self, computed, block_size):
    last_node, num_cached_tokens = self.info
    can_cache_computed_tokens = computed - computed % block_size
    self.info = [last_node, can_cache_computed_tokens]
    return num_cached_tokens


def test_a_comparison_of_the_two_locals_is_found_and_only_it():
    assert compares_locals(_records_with_check, "can_cache_computed_tokens", "num_cached_tokens")
    assert not compares_locals(_records_without_check, "can_cache_computed_tokens", "num_cached_tokens")
    assert not compares_locals(_records_with_check, "computed", "num_cached_tokens")
    assert not compares_locals(object(), "a", "b")  # no code: read as without


def _threshold_zero_for_prefill(self, role, new_blocks):
    if role == "prefill":
        can_schedule_block_num_threshold = 0
    else:
        can_schedule_block_num_threshold = self.threshold(new_blocks)
    return can_schedule_block_num_threshold


def _threshold_always(self, role, new_blocks):
    can_schedule_block_num_threshold = self.threshold(new_blocks)
    other = 0
    return can_schedule_block_num_threshold + other


def test_a_constant_stored_into_the_local_is_found_and_only_it():
    assert stores_constant(_threshold_zero_for_prefill, "can_schedule_block_num_threshold", 0)
    assert not stores_constant(_threshold_always, "can_schedule_block_num_threshold", 0)
    assert not stores_constant(_threshold_zero_for_prefill, "can_schedule_block_num_threshold", 1)
    assert not stores_constant(_threshold_zero_for_prefill, "can_schedule_block_num_threshold", False)
