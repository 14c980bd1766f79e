"""Change 3, impl ``host``: the host's own reservation code runs, fed the profile's values. The catalogue entry is
:mod:`fdsched.patches.ratio_reserve`.
"""

from __future__ import annotations

from fdsched.patches._spec import Shapes

# Host attributes the host's own ratio / fixed-block code reads, and the settings that feed them.
_HOST_ATTRS = {
    "init_new_token_ratio": "host_tunables.FD_INIT_NEW_TOKEN_RATIO",
    "min_new_token_ratio": "host_tunables.FD_MIN_NEW_TOKEN_RATIO",
    "new_token_ratio_decay": "host_tunables.FD_NEW_TOKEN_RATIO_DECAY",
    "clip_max_new_tokens": "host_tunables.FD_CLIP_MAX_NEW_TOKENS",
    "init_reserve_output_block_num": "host_tunables.FD_RESERVE_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL",
    "decay_output_block_num": "host_tunables.FD_RESERVE_DECAY_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL",
    "min_reserve_output_block_num": "host_tunables.FD_RESERVE_MIN_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL",
}


# ---- impl "host": the host's own code, fed the profile's values ----------------------------------------
class HostReserve:
    """The host's own reservation code runs; a profile may set the values it reads (once, when the scheduler is
    built). One per scheduler; it serves no seam."""

    seams: tuple = ()
    fdsched_host_role = "sets the values the host's reservation reads from the profile; the host's own code reserves"

    def __init__(self, rm, settings, next):
        self.next = next
        for attr, key in _HOST_ATTRS.items():
            if hasattr(rm, attr):
                setattr(rm, attr, settings[key])
        if hasattr(rm, "new_token_ratio"):
            rm.new_token_ratio = rm.init_new_token_ratio
        if hasattr(rm, "current_reserve_output_block_num"):
            rm.current_reserve_output_block_num = rm.init_reserve_output_block_num
            rm.current_reserve_output_block_num_float = float(rm.init_reserve_output_block_num)


class HostReserveReset(HostReserve):
    """A fixed-block host whose preemption loop resets the reservation at the end of every ``_trigger_preempt`` call;
    done here too, so it still happens when change 2 replaced that loop. Only on a host that keeps that reservation
    (:data:`HOST_RESERVE_RESET_SHAPES`; elsewhere :class:`HostReserve`)."""

    seams = ("_trigger_preempt",)
    fdsched_attributes = ("init_reserve_output_block_num",)
    fdsched_host_role = (HostReserve.fdsched_host_role + ", and its reservation is reset after each "
                         "preemption, as the host's own loop resets it")

    def _trigger_preempt(self, rm, request, num_new_blocks, preempted_reqs, scheduled_reqs):
        result = self.next._trigger_preempt(rm, request, num_new_blocks, preempted_reqs, scheduled_reqs)
        rm.current_reserve_output_block_num = rm.init_reserve_output_block_num
        rm.current_reserve_output_block_num_float = rm.init_reserve_output_block_num
        rm.can_relax_prefill_strategy = False
        return result


HOST_RESERVE_RESET_SHAPES = Shapes(HostReserveReset, HostReserve)
