"""Change 2 — decode-only preemption.

Replaces:  ResourceManagerV1._select_preempt_candidate (the seam of a host with 7783: which request its
           preemption loop takes next), ResourceManagerV1._trigger_preempt (a host without that seam:
           the loop, paraphrased; with the seam the host's own loop runs); a step after each ``schedule()`` pass
           ends the no-victim warning episode
Why:       the host preempts the last running request whatever its phase, so a long prompt that is
           half prefilled can be thrown away and recomputed while decoders hold their blocks.
Upstream:  PR 7444, 2.6 cherry-pick 7783 (merged; in d38eeb8).
Needs it:  FastDeploy 2.6 before 7783 (e7c8dc2: a single RUNNING status).
Switch:    FDSCHED_DECODE_ONLY_PREEMPT / changes.decode_only_preempt = auto | on | off.
           ``off`` on a host that has the change restores the pre-change choice: the last running
           request that does not use extend tables, whatever its phase.
Delete:    when every supported host carries 7783 and nobody A/Bs against the old choice.
Relies on: (probed at install: ``on``, or ``off`` on a host with the change, fails naming it; ``auto`` skips)
  * preempt-loop-seams: (seam host) ``_trigger_preempt`` preempts exactly the request that
    ``_select_preempt_candidate()`` returns, ``(None, -1)`` meaning none, and calls
    ``_reset_reserve_on_preemption()`` after each preemption.

How: the victim is chosen by the ``fdsched_select_preemption_victim`` hook (default: the last
decoding request without extend tables, see :func:`fdsched.core.policies.select_preemption_victim`),
with decode detection by the one ``fdsched_is_decoding`` hook, so on a host with one RUNNING status, whose token
processor never marks decoding, the plugin still knows from token counts. On a host with the seam the plugin
answers the host's own ``_select_preempt_candidate``; the host's loop preempts, requeues, warns when
there is no victim and resets the reservation through its ``_reset_reserve_on_preemption`` seam (which
change 3 owns). Without the seam the plugin runs the loop itself; with no victim it gives up (the host's
caller then stops the running pass) and warns once per episode. Reservation state, the host's or the
plugin's, is change 3's business on both hosts: this module never touches it.

Each scheduler holds one strategy per impl and host (``SPEC.strategies``), chosen once when it is built; no
method asks which host it runs on:

=============  ==============================================  ===========================================
impl           host with the seam (has the change)             host without it
=============  ==============================================  ===========================================
host           ``HostPreempt`` (counts the seam's picks)       ``HostPreemptLoop`` (counts the
                                                               host loop's victims)
plugin         ``PolicyPreempt`` (answers the seam)            ``PolicyPreemptLoop`` (the loop)
off            ``PreChangePreempt`` (any phase)                (the host's own code: impl ``host``)
=============  ==============================================  ===========================================
"""

from __future__ import annotations

import logging

from fdsched.core.metrics import METRICS
from fdsched.core.policies import NoVictimWarning, VictimCandidate

from fdsched.patches._spec import AlteredTest, PatchSpec, Reliance, Shapes, Variant
from fdsched.patches._base import host_global, node_role

RM = "fastdeploy.engine.sched.resource_manager_v1"


class PreemptCount:
    """What every strategy of this change shares (one per scheduler, made when it is built; see
    :mod:`fdsched.patches._scheduler`): the no-victim warning's episode, ended after every pass, and the victims
    counted by phase. Each method named as the host's takes the scheduler first; ``next`` has the layer below."""

    seams: tuple = ()
    fdsched_attributes = ("running",)

    def __init__(self, rm, settings, next):
        self.next = next
        self.no_victim = NoVictimWarning()

    def pass_end(self, rm, plan, result) -> None:
        """After every pass: the no-victim warning's pass ends (it warns once per episode; outside one, a pass has
        nothing to end)."""
        if self.no_victim.in_episode:
            self.no_victim.end_pass()

    def count_victim(self, rm, victim, decoding: bool) -> None:
        # the host's loop preempts what the seam returns (its computed tokens are still set)
        METRICS.preempted("decode" if decoding else "prefill", of=rm, recomputed_tokens=_computed(victim))

    def candidates(self, rm) -> list:
        is_decoding = rm._fdsched_is_decoding
        return [VictimCandidate(r.request_id, is_decoding(r), bool(r.use_extend_tables)) for r in rm.running]


class HostPreempt(PreemptCount):
    """impl ``host`` on a host with the seam: the host's own victim choice, its victims counted by phase for the
    metrics (the host's own loop asks this seam for each victim)."""

    seams = ("_select_preempt_candidate",)
    fdsched_host_role = "counts the host's preemption victims by phase for its metrics; the host's own code picks them"

    def _select_preempt_candidate(self, rm):
        """The host's victim seam: ``(victim, its index in running)``, or ``(None, -1)`` when none qualifies."""
        victim, index = self.next._select_preempt_candidate(rm)
        if victim is not None:
            self.count_victim(rm, victim, rm._fdsched_is_decoding(victim))
        return victim, index


class HostPreemptLoop(PreemptCount):
    """impl ``host`` on a host without the seam: the host's own preemption, its victims counted by phase."""

    seams = ("_trigger_preempt",)
    fdsched_host_role = HostPreempt.fdsched_host_role

    def _trigger_preempt(self, rm, request, num_new_blocks, preempted_reqs, scheduled_reqs):
        phase_before = {r.request_id: rm._fdsched_is_decoding(r) for r in rm.running}
        computed_before = {r.request_id: _computed(r) for r in rm.running}
        already = len(preempted_reqs)
        result = self.next._trigger_preempt(rm, request, num_new_blocks, preempted_reqs, scheduled_reqs)
        for victim in preempted_reqs[already:]:
            METRICS.preempted(
                "decode" if phase_before.get(victim.request_id) else "prefill",
                of=rm,
                recomputed_tokens=computed_before.get(victim.request_id, 0),
            )
        return result


class PolicyPreempt(PreemptCount):
    """impl ``plugin`` (decode-only) and, through :class:`PreChangePreempt`, ``off`` (any phase, the pre-change
    choice) on a host with the seam: the victim from the policy (hook ``fdsched_select_preemption_victim``); the
    host's own loop preempts it."""

    seams = ("_select_preempt_candidate",)
    decode_only = True

    def _select_preempt_candidate(self, rm):
        """The host's victim seam: ``(victim, its index in running)``, or ``(None, -1)`` when none qualifies."""
        candidates = self.candidates(rm)
        chosen = rm._fdsched_policies.select_victim(candidates, self.decode_only)
        if chosen is None:
            return None, -1
        victim = rm.running[chosen]
        self.count_victim(rm, victim, candidates[chosen].decoding)
        return victim, chosen


class PolicyPreemptLoop(PreemptCount):
    """impl ``plugin`` on a host without the seam: the host's loop, paraphrased, with the decoding victim from the
    policy (hook ``fdsched_select_preemption_victim``)."""

    seams = ("_trigger_preempt",)
    # What the paraphrased loop uses of the host (checked before anything is patched: fdsched.patches._spec)
    fdsched_calls = {
        "PrefixCacheManager.can_allocate_gpu_blocks": ("num_blocks",),
        "PrefixCacheManager.write_cache_to_storage": ("request",),
        "PrefixCacheManager.write_cache_to_storage_decode": ("request",),
        "ResourceManagerV1._free_blocks": ("request",),
        "ResourceManagerV1._prepare_preempt_task": ("request",),
        "ResourceManagerV1._info_each_block": (),
        "ResourceManagerV1.info": (),
    }
    fdsched_globals = {RM: ("envs", "llm_logger", "trace_print", "LoggingEventName")}
    fdsched_attributes = ("cache_manager", "config", "tasks_list", "stop_flags", "requests", "req_dict",
                          "to_be_rescheduled_request_id_set")

    def __init__(self, rm, settings, next):
        super().__init__(rm, settings, next)
        # A decode node cannot recompute a victim's prompt: there the victim leaves the node (fixed for its life).
        self.release_victim = self.drop_victim if node_role(rm) == "decode" else self.requeue_victim

    def _trigger_preempt(self, rm, request, num_new_blocks, preempted_reqs, scheduled_reqs):
        while not rm.cache_manager.can_allocate_gpu_blocks(num_new_blocks):
            candidates = self.candidates(rm)
            index = rm._fdsched_policies.select_victim(candidates, True)
            if index is None:
                if self.no_victim.should_warn():
                    host_global(RM, "llm_logger").warning(
                        "[fdsched] Preemption is triggered while no preemptable (decoding) request can be "
                        f"found, scheduler may be hung! Waiting for {num_new_blocks} blocks for request "
                        f"{request.request_id}; running: {[r.request_id for r in rm.running]}"
                    )
                return False
            victim = rm.running.pop(index)
            computed = _computed(victim)  # before the reset below
            self.preempt_request(rm, victim, preempted_reqs, scheduled_reqs)
            METRICS.preempted("decode" if candidates[index].decoding else "prefill", of=rm, recomputed_tokens=computed)
            if victim is request:
                return False
        return True

    def preempt_request(self, rm, victim, preempted_reqs, scheduled_reqs):
        """Reset a victim and requeue it (or drop it on a decode node), as a seamless host's own loop does."""
        logger = host_global(RM, "llm_logger")
        victim.status = rm._fdsched_statuses.PREEMPTED
        victim.num_computed_tokens = 0
        self.release_victim(rm, victim)
        logger.info(f"Preemption is triggered! Preempted request id: {victim.request_id}")
        preempted_reqs.append(victim)
        scheduled_reqs.append(rm._prepare_preempt_task(victim))
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(f"[fdsched] preempted {victim.request_id} at idx {victim.idx}; {rm.info()}")
            rm._info_each_block()

    @staticmethod
    def saves_output(rm):
        # the host reads its env switch at call time; so does the paraphrase
        return host_global(RM, "envs").FD_SAVE_OUTPUT_CACHE_FOR_PREEMPTED_REQUEST and rm.config.cache_config.kvcache_storage_backend

    def drop_victim(self, rm, victim) -> None:
        """A decode node's victim leaves the node (its output cache saved first where the host saves it)."""
        rm.tasks_list[victim.idx] = None
        rm.stop_flags[victim.idx] = True
        rm.requests.pop(victim.request_id, None)
        rm.req_dict.pop(victim.request_id, None)
        if self.saves_output(rm):
            self.save_decode_victim(rm, victim)
        rm._free_blocks(victim)

    def requeue_victim(self, rm, victim) -> None:
        """Any other node's victim goes back to be recomputed."""
        if self.saves_output(rm):
            rm.cache_manager.write_cache_to_storage(victim)
        rm._free_blocks(victim)
        victim.num_cached_blocks = 0
        rm.to_be_rescheduled_request_id_set.add(victim.request_id)
        host_global(RM, "trace_print")(
            host_global(RM, "LoggingEventName").PREEMPTED, victim.request_id, getattr(victim, "user", "")
        )

    def save_decode_victim(self, rm, victim) -> None:
        rm.cache_manager.write_cache_to_storage_decode(victim)


class PolicyPreemptNoDecodeSave(PolicyPreemptLoop):
    """:class:`PolicyPreemptLoop` on a host whose loop drops a decode node's victim without saving its output cache
    to storage (FastDeploy 2.5: no ``write_cache_to_storage_decode``)."""

    fdsched_calls = {"PrefixCacheManager.write_cache_to_storage_decode": None}

    def save_decode_victim(self, rm, victim) -> None:
        """Nothing: this host's own loop saves nothing for a decode node's victim."""


PREEMPT_LOOP_SHAPES = Shapes(PolicyPreemptLoop, PolicyPreemptNoDecodeSave)


class PreChangePreempt(PolicyPreempt):
    """impl ``off`` on a host that has the change: any running request may be the victim, as before it."""

    decode_only = False


def _computed(request) -> int:
    """Tokens of ``request`` whose KV a preemption throws away (they are computed again when it returns)."""
    value = getattr(request, "num_computed_tokens", 0)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


def _has_decode_only(info) -> bool:
    return hasattr(info.rm_class, "_select_preempt_candidate") and info.split_status


def _preempt_loop_seams(info):
    if not hasattr(info.rm_class, "_select_preempt_candidate"):
        return None  # no victim seam: the plugin runs its own loop
    from fdsched.patches._base import code_names

    missing = {"_select_preempt_candidate", "_reset_reserve_on_preemption"} - code_names(info.rm_class._trigger_preempt)
    if missing:
        return f"ResourceManagerV1._trigger_preempt no longer calls {', '.join(sorted(missing))}"
    return None


SPEC = PatchSpec(
    change_id="decode_only_preempt",
    title="Decode-only preemption (LIFO among decoding requests)",
    upstream_prs=(7444, 7783),
    upstream_state="merged",
    replaces=(
        "ResourceManagerV1._select_preempt_candidate",
        "ResourceManagerV1._trigger_preempt",
    ),
    why="The host preempts the last running request whatever its phase, throwing away prefill work.",
    how="Victim = last decoding request without extend tables (hook fdsched_select_preemption_victim); "
    "no victim: give up for this step and warn once per episode.",
    hosts_needing="2.6 before PR 7783 (e7c8dc2)",
    switch="FDSCHED_DECODE_ONLY_PREEMPT",
    delete_when="every supported host carries 7783 and the pre-change choice is no longer A/B tested",
    # The host's preemption seam and its split running status came together (7783): a host that has the change
    # has the seam; one that lacks it gets the loop paraphrased, which needs no seam (chosen once, per scheduler).
    strategies={"ResourceManagerV1": {
        "host": Variant.by_host(HostPreempt, HostPreemptLoop),
        "plugin": Variant.by_host(PolicyPreempt, PREEMPT_LOOP_SHAPES),
        # only on a host that has the change (elsewhere off is the host's own code: impl "host")
        "off": PreChangePreempt,
    }},
    host_has=_has_decode_only,
    alters_tests=(
        AlteredTest(
            "tests/v1/test_resource_manager_v1.py::TestResourceManagerV1Additional::test_trigger_preempt_records_tasks",
            "the host's test (before PR 7783) preempts the last running request, a prefill; decode-only preemption "
            "never takes a prefill. PR 7783 rewrote this test for that behaviour; our version of the rewrite, for a "
            "host with the single RUNNING status, is tests/host/test_cherry_pick_7783.py",
            7783,
        ),
    ),
    relies_on=(
        Reliance("preempt-loop-seams", "with the victim seam, _trigger_preempt preempts what _select_preempt_candidate "
                 "returns and calls _reset_reserve_on_preemption after each preemption", _preempt_loop_seams),
    ),
)
