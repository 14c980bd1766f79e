"""Change 3 — new_token_ratio-based KV reservation, with the chunked-prefill guard.

Replaces:  ResourceManagerV1._get_can_schedule_prefill_threshold_block, .get_new_block_nums
           (records which request the next threshold is for; on the old host also runs the guard),
           ._trigger_preempt (wrapper: re-estimate after preemptions; the old-host guard's stop),
           .schedule (wrapper: decay after a pass that scheduled something), .__init__ (state).
Why:       the host reserves a fixed 16 blocks per running request after a preemption, decaying to
           nothing, whatever each request still has to generate; admission is either too greedy
           (preemption storms) or too timid.
Upstream:  PR 7444, 2.6 cherry-pick 7783 (merged; in the "new host" d38eeb8).
Needs it:  FastDeploy 2.6 before 7783 (the "old host" e7c8dc2).
Switch:    FDSCHED_RATIO_RESERVE / changes.ratio_reserve = auto | on | off, with the host's own
           FD_USE_NEW_TOKEN_RATIO_RESERVE, FD_INIT/MIN_NEW_TOKEN_RATIO, FD_NEW_TOKEN_RATIO_DECAY,
           FD_CLIP_MAX_NEW_TOKENS and the legacy FD_RESERVE_*_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL;
           plugin tunables FDSCHED_RATIO_REESTIMATE_EXTRA_BLOCKS (16) and _CAP (init).
           ``off`` on a host that has the change restores the fixed-block policy, including the
           old host's raw block check for a running chunked prefill.
Delete:    when every supported host carries 7783 and exposes the re-estimate term and cap.

How: a prefill (new, or the next chunk of a running one) is admitted only when free blocks cover
its chunk plus, for every running request, ``ceil(min(max_tokens - generated, clip) * ratio /
block_size)`` (hook ``fdsched_estimate_reserve_blocks``). The ratio starts at init, decays after
each pass that scheduled something, and is re-estimated after a preemption. A running chunked
prefill that fails the threshold stops the running pass and blocks waiting requests for the step.
On the new host that stop is the host's own code; on the old host the plugin gets the same effect
through the host's own control flow: ``get_new_block_nums`` makes the host's next block check fail
(``PrefixCacheManager.can_allocate_gpu_blocks`` answers False once, evicting nothing), and
``_trigger_preempt`` then declines without preempting and marks the step as one in which no waiting
request may be admitted (the host skips its waiting pass when that list is not empty).

``off`` on the new host restores the pre-change running pass too: a running chunk short of blocks
preempts (``_trigger_preempt`` with the pass's own task lists, read from the calling ``schedule()``
frame) instead of waiting. Left as the new host has it: the token budget that 7783 pre-deducts for
decoding requests at the start of a pass.

Beyond upstream: on a prefill node (``splitwise_role == "prefill"``) running requests reserve nothing:
such a node never decodes, and upstream's reservation there stalls it for good (a chunk that needs no
new block is refused while preallocated requests hold the pool, and the ratio only decays after a pass
that scheduled something). The new host's own code (``auto`` there) still has that stall.
"""

from __future__ import annotations

import sys

from fdsched.metrics import METRICS
from fdsched.policies import LegacyReserve, NewTokenRatio, max_new_tokens_of

from . import PatchSpec
from ._base import PluginBase

# Host attributes the host's own ratio / legacy code reads, and the settings that feed them.
_HOST_ATTRS = {
    "init_new_token_ratio": "host_tunables.FD_INIT_NEW_TOKEN_RATIO",
    "min_new_token_ratio": "host_tunables.FD_MIN_NEW_TOKEN_RATIO",
    "new_token_ratio_decay": "host_tunables.FD_NEW_TOKEN_RATIO_DECAY",
    "clip_max_new_tokens": "host_tunables.FD_CLIP_MAX_NEW_TOKENS",
    "init_reserve_output_block_num": "host_tunables.FD_RESERVE_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL",
    "decay_output_block_num": "host_tunables.FD_RESERVE_DECAY_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL",
    "min_reserve_output_block_num": "host_tunables.FD_RESERVE_MIN_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL",
}


class RatioReserveMixin(PluginBase):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        s = self._fdsched_settings
        self._fdsched_ratio = NewTokenRatio(
            s["host_tunables.FD_INIT_NEW_TOKEN_RATIO"],
            s["host_tunables.FD_MIN_NEW_TOKEN_RATIO"],
            s["host_tunables.FD_NEW_TOKEN_RATIO_DECAY"],
            s.reestimate_cap,
        )
        self._fdsched_legacy = LegacyReserve(
            s["host_tunables.FD_RESERVE_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL"],
            s["host_tunables.FD_RESERVE_DECAY_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL"],
            s["host_tunables.FD_RESERVE_MIN_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL"],
        )
        self._fdsched_block_request = None  # the request the next threshold is computed for
        self._fdsched_guarded = None  # old host: the running chunk the guard refused this pass
        if self._fdsched_impl["ratio_reserve"] == "host":
            # The host's own code runs: feed it the effective values (a profile may set them).
            for attr, key in _HOST_ATTRS.items():
                if hasattr(self, attr):
                    setattr(self, attr, s[key])
            if hasattr(self, "new_token_ratio"):
                self.new_token_ratio = self.init_new_token_ratio
            if hasattr(self, "current_reserve_output_block_num"):
                self.current_reserve_output_block_num = self.init_reserve_output_block_num
                self.current_reserve_output_block_num_float = float(self.init_reserve_output_block_num)
        if self._fdsched_impl["ratio_reserve"] == "plugin":
            METRICS.ratio(self._fdsched_ratio.value)

    # ---- the threshold ----------------------------------------------------------------------
    def get_new_block_nums(self, request, num_new_tokens):
        blocks = super().get_new_block_nums(request, num_new_tokens)
        self._fdsched_block_request = request
        impl = self._fdsched_impl["ratio_reserve"]
        if impl == "host" or not self._fdsched_is_running_prefill(request):
            return blocks
        host_has_guard = self._fdsched_host.has["ratio_reserve"]
        if impl == "plugin" and not host_has_guard:
            # Old host: its running pass checks only `blocks`; apply the reservation here. On refusal the
            # host's raw check is made to fail, and _trigger_preempt declines (see there).
            if not self.cache_manager.can_allocate_gpu_blocks(self._fdsched_threshold(blocks)):
                METRICS.admission_blocked()
                self._fdsched_guarded = request
                self.cache_manager._fdsched_refuse_next = True
        elif impl == "legacy" and host_has_guard:
            # New host, change off: before 7783 a running chunk short of blocks preempted (the host now
            # waits). Do it here, with the lists of the schedule() pass that called us.
            if not self.cache_manager.can_allocate_gpu_blocks(blocks):
                lists = _schedule_lists(sys._getframe(1))
                if lists is None or not self._trigger_preempt(request, blocks, *lists):
                    self.cache_manager._fdsched_refuse_next = True  # the host then stops the running pass
        return blocks

    def _get_can_schedule_prefill_threshold_block(self, num_chunk_new_block):
        impl = self._fdsched_impl["ratio_reserve"]
        if impl == "host":
            return super()._get_can_schedule_prefill_threshold_block(num_chunk_new_block)
        if impl == "plugin":
            threshold = self._fdsched_threshold(num_chunk_new_block)
        else:
            threshold = self._fdsched_legacy_threshold(num_chunk_new_block)
        # Every caller checks the threshold with can_allocate_gpu_blocks right away: count that check's refusal.
        self.cache_manager._fdsched_admission_check = True
        return threshold

    def _fdsched_threshold(self, chunk_blocks: int) -> int:
        reserve = self._fdsched_total_reserve()
        METRICS.reserved(reserve)
        return self._fdsched_speculative_slack(chunk_blocks + reserve)

    def _fdsched_legacy_threshold(self, chunk_blocks: int) -> int:
        request = self._fdsched_block_request
        if request is not None and self._fdsched_is_running_prefill(request):
            return chunk_blocks  # pre-change: a running chunk needed only its own blocks
        legacy = self._fdsched_legacy
        threshold = legacy.threshold(chunk_blocks, len(self.running))
        METRICS.reserved(threshold - chunk_blocks)
        if legacy.relaxed:
            return threshold
        return self._fdsched_speculative_slack(threshold)

    def _fdsched_speculative_slack(self, threshold: int) -> int:
        if self.config.speculative_config.method is not None:
            return min(threshold + 1, self.config.cache_config.max_block_num_per_seq)
        return threshold

    def _fdsched_total_reserve(self) -> int:
        if self.config.scheduler_config.splitwise_role == "prefill":
            # A prefill node never decodes: its requests leave after their first token. Reserving decode
            # blocks there (as 7783 does) can stall it for good: a chunk that needs no new block is refused
            # while the preallocated requests hold the pool, and the ratio decays only after a pass that
            # scheduled something.
            return 0
        ratio = self._fdsched_ratio.value
        clip = self._fdsched_settings["host_tunables.FD_CLIP_MAX_NEW_TOKENS"]
        block_size = self.config.cache_config.block_size
        max_model_len = self.config.model_config.max_model_len
        reserve = self._fdsched_policies.reserve_blocks
        total = 0
        for r in self.running:
            budget = _output_budget(r, max_model_len)
            total += reserve(r.request_id, budget, len(r.output_token_ids), ratio, clip, block_size)
        return total

    def _fdsched_is_running_prefill(self, request) -> bool:
        statuses = self._fdsched_host.request_status
        running = statuses.RUNNING_PREFILL if self._fdsched_host.split_status else statuses.RUNNING
        return request.status == running and request.num_computed_tokens < request.need_prefill_tokens

    # ---- preemption and the end of a pass -------------------------------------------------------
    def _trigger_preempt(self, request, num_new_blocks, preempted_reqs, scheduled_reqs):
        impl = self._fdsched_impl["ratio_reserve"]
        if impl == "plugin" and self._fdsched_guarded is request and not self._fdsched_host.has["ratio_reserve"]:
            # Old host: the guard refused this running chunk. Decline without preempting; a non-empty
            # list makes the host skip its waiting pass, as upstream does after a refused chunk.
            preempted_reqs.append(request)
            return False
        already = len(preempted_reqs)
        result = super()._trigger_preempt(request, num_new_blocks, preempted_reqs, scheduled_reqs)
        if impl == "plugin" and len(preempted_reqs) > already:
            self._fdsched_reestimate()
        elif impl == "legacy":
            self._fdsched_legacy.on_preemption()  # pre-change: on every call, as the old host did
        return result

    def _fdsched_reestimate(self) -> None:
        max_model_len = self.config.model_config.max_model_len
        generated, budgets, decoding = [], [], 0
        for r in self.running:
            generated.append(len(r.output_token_ids))
            budgets.append(_output_budget(r, max_model_len))
            decoding += self._fdsched_is_decoding(r)
        value = self._fdsched_ratio.on_preemption(
            generated,
            budgets,
            decoding,
            self.config.cache_config.block_size,
            self._fdsched_settings["tunables.ratio_reestimate_extra_blocks"],
        )
        METRICS.ratio(value)

    def schedule(self):
        impl = self._fdsched_impl["ratio_reserve"]
        try:
            result = super().schedule()
        finally:
            self._fdsched_guarded = None
            self._fdsched_block_request = None
        if impl != "host":
            scheduled_anything = bool(result[0])
            with self.lock:
                if impl == "plugin":
                    self._fdsched_ratio.after_schedule(scheduled_anything)
                    METRICS.ratio(self._fdsched_ratio.value)
                else:
                    self._fdsched_legacy.after_schedule(scheduled_anything)
        return result


def _output_budget(request, max_model_len: int) -> int:
    """A running request's output budget (max_tokens, else what the context leaves)."""
    return max_new_tokens_of(
        getattr(request.sampling_params, "max_tokens", None), max_model_len, request.prompt_token_ids_len
    )


def _schedule_lists(frame):
    """``(preempted_reqs, scheduled_reqs)`` of the host's schedule() pass in ``frame``, or None."""
    names = frame.f_locals
    preempted, scheduled = names.get("preempted_reqs"), names.get("scheduled_reqs")
    if isinstance(preempted, list) and isinstance(scheduled, list):
        return preempted, scheduled
    return None


class RatioReserveCacheMixin(PluginBase):
    """The host's block check, seen by the scheduler: it can make the next check fail without evicting
    anything, and a refused admission check is counted for the metrics."""

    def can_allocate_gpu_blocks(self, num_blocks, try_free_gpu_blocks=True):
        admission = self.__dict__.pop("_fdsched_admission_check", False)
        if self.__dict__.pop("_fdsched_refuse_next", False):
            allowed = False
        else:
            allowed = super().can_allocate_gpu_blocks(num_blocks, try_free_gpu_blocks)
        if admission and not allowed:
            METRICS.admission_blocked()
        return allowed


def _has_ratio_reserve(info) -> bool:
    return hasattr(info.rm_class, "_get_running_request_reserve_blocks") and hasattr(
        info.rm_class, "_reset_reserve_on_preemption"
    )


def _guard_mechanism(info):
    """The guard (old host) and the pre-change running-chunk preemption (new host, off) attach to the running
    pass's control flow: its calls and its two task lists."""
    from fdsched.host import code_names

    names = code_names(info.rm_class.schedule)
    needed = {"preempted_reqs", "scheduled_reqs", "get_new_block_nums", "_get_can_schedule_prefill_threshold_block"}
    if not _has_ratio_reserve(info):
        needed.add("_trigger_preempt")
    missing = needed - names
    if missing:
        return f"ResourceManagerV1.schedule no longer uses {', '.join(sorted(missing))}; the guard cannot attach"
    return None


SPEC = PatchSpec(
    change_id="ratio_reserve",
    title="new_token_ratio KV reservation and chunked-prefill guard",
    upstream_prs=(7444, 7783),
    upstream_state="merged",
    replaces=(
        "ResourceManagerV1.__init__",
        "ResourceManagerV1.get_new_block_nums",
        "ResourceManagerV1._get_can_schedule_prefill_threshold_block",
        "ResourceManagerV1._trigger_preempt",
        "ResourceManagerV1.schedule",
        "PrefixCacheManager.can_allocate_gpu_blocks",
    ),
    requires={
        "PrefixCacheManager.can_allocate_gpu_blocks": ("num_blocks",),
        "ResourceManagerV1.get_new_block_nums": ("request", "num_new_tokens"),
        "ResourceManagerV1._get_can_schedule_prefill_threshold_block": ("num_chunk_new_block",),
        "ResourceManagerV1._trigger_preempt": ("request", "num_new_blocks", "preempted_reqs", "scheduled_reqs"),
        "ResourceManagerV1.schedule": (),
    },
    why="Fixed 16 blocks per running request ignore how much each request still has to generate.",
    how="Admit a prefill only if free >= chunk + sum(ceil(min(max_tokens - generated, clip) * ratio / block)); "
    "ratio decays per pass, re-estimated on preemption; a refused running chunk blocks admission for the step.",
    hosts_needing="2.6 before PR 7783 (old host e7c8dc2)",
    switch="FDSCHED_RATIO_RESERVE",
    delete_when="every supported host carries 7783 and exposes the re-estimate term and cap as settings",
    mixins={"ResourceManagerV1": RatioReserveMixin, "PrefixCacheManager": RatioReserveCacheMixin},
    host_has=_has_ratio_reserve,
    extra_check=_guard_mechanism,
)
