"""Change 3 — new_token_ratio-based KV reservation, with the chunked-prefill guard.

Replaces:  ResourceManagerV1.__init__ (state), ResourceManagerV1.schedule (wrapper: the pass's state; decay
           after a pass that scheduled something), ResourceManagerV1.get_new_block_nums (the running chunk:
           old-host guard, or the pre-change preemption under ``off`` on the new host),
           ResourceManagerV1._get_can_schedule_prefill_threshold_block (the threshold),
           ResourceManagerV1._get_running_request_reserve_blocks (new host's seam: one request's reserve),
           ResourceManagerV1._reset_reserve_on_preemption (new host's seam: re-estimate after a preemption),
           ResourceManagerV1._trigger_preempt (wrapper: old host's reservation resets, the guard's decline),
           ResourceManagerV1._log_console_scheduler_metrics (the end of the pass, under the lock),
           ResourceManagerV1.finish_requests (adaptive estimator: a finished request is a sample),
           PrefixCacheManager.can_allocate_gpu_blocks (the host's block check: keyed refusal, refusal count).
Why:       the host reserves a fixed 16 blocks per running request after a preemption, decaying to
           nothing, whatever each request still has to generate; admission is either too greedy
           (preemption storms) or too timid.
Upstream:  PR 7444, 2.6 cherry-pick 7783 (merged; in the "new host" d38eeb8).
Needs it:  FastDeploy 2.6 before 7783 (the "old host" e7c8dc2).
Switch:    FDSCHED_RATIO_RESERVE / changes.ratio_reserve = auto | on | off, with the host's own
           FD_USE_NEW_TOKEN_RATIO_RESERVE, FD_INIT/MIN_NEW_TOKEN_RATIO, FD_NEW_TOKEN_RATIO_DECAY,
           FD_CLIP_MAX_NEW_TOKENS and the fixed-block FD_RESERVE_*_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL;
           plugin tunables FDSCHED_RATIO_REESTIMATE_EXTRA_BLOCKS (16) and _CAP (init).
           FDSCHED_RESERVE_ESTIMATOR = ratio (upstream's formula) | adaptive (beyond upstream, below), with
           FDSCHED_ADAPTIVE_MIN_SAMPLES / _WINDOW / _MARGIN_K. ``adaptive`` makes ``auto`` apply the
           plugin's version on the new host too (the host has only the ratio formula).
           ``off`` on a host that has the change restores the fixed-block policy, including the
           old host's raw block check for a running chunked prefill.
Delete:    when every supported host carries 7783 and exposes the re-estimate term and cap.
Relies on: (each probed at install: ``on``, or ``off`` on the new host, fails naming it; ``auto`` skips)
  * running-chunk-check: the running pass checks a running chunk with ``cache_manager.can_allocate_gpu_blocks(n)``
    (new host: ``n = _get_can_schedule_prefill_threshold_block(...)``), right after ``n`` blocks came from
    ``get_new_block_nums``; on the old host a failed check calls ``_trigger_preempt(request, n, preempted_reqs,
    scheduled_reqs)`` and the waiting pass runs only when ``preempted_reqs`` is empty.
  * pass-end: (new host, ``off``) ``schedule()`` ends each pass, after its waiting pass and still under the lock,
    with ``self._log_console_scheduler_metrics(scheduled_reqs)`` on the list it returns; the waiting pass reads
    ``self.waiting`` and nothing before it in the pass does.
  * threshold-check: every caller of ``_get_can_schedule_prefill_threshold_block`` checks its result with
    ``cache_manager.can_allocate_gpu_blocks`` next (the refusal count).
  * finish-seam: (adaptive estimator) every request the engine finishes goes through ``finish_requests``
    (``finish_requests_async`` submits it to a pool), which finds it in ``self.requests``, still with its
    running status, and takes it out of ``running``; a preempted request is not running.

How: a prefill (new, or the next chunk of a running one) is admitted only when free blocks cover
its chunk plus, for every running request, ``ceil(min(max_tokens - generated, clip) * ratio /
block_size)`` (hook ``fdsched_estimate_reserve_blocks``; on the new host through its own per-request
seam ``_get_running_request_reserve_blocks``). The ratio starts at init, decays after each pass that
scheduled something, and is re-estimated after a preemption (the new host's ``_reset_reserve_on_preemption``
seam; on the old host at the end of a ``_trigger_preempt`` call that preempted). A running chunked prefill
that fails the threshold stops the running pass and blocks waiting requests for the step. On the new host
that stop is the host's own code; on the old host the plugin gets the same effect through the host's own
control flow: ``get_new_block_nums`` asks the cache manager to refuse the host's check of exactly that
chunk's blocks (a signal keyed to the request and the block count, evicting nothing), and
``_trigger_preempt`` then declines for that request without preempting and puts it into the pass's
``preempted_reqs`` (the host skips its waiting pass when that list is not empty).

``off`` on the new host restores the pre-change running pass too: a running chunk short of blocks
preempts instead of waiting. The plugin preempts (``_trigger_preempt``) into lists of its own, kept on
the instance for the duration of the ``schedule()`` pass its wrapper opened, holds the waiting queue
back for the rest of that pass (the pre-change pass skips admission after a preemption), and at the
pass's end (``_log_console_scheduler_metrics``, under the lock) puts the preempt tasks into the pass's
list just before the chunk's own task and the waiting queue back. Nothing depends on who called whom:
a class between the host's ``schedule()`` and these methods changes nothing. Left as the new host has it:
the token budget that 7783 pre-deducts for decoding requests at the start of a pass.

One-shot signals (the refusal, the refusal count, the guard's decline, the running chunk a threshold is
for) are keyed to the check they are for and dropped at the end of every pass; one still pending then is
logged and counted in ``fastdeploy:fdsched_unconsumed_signals_total{signal}``.

Beyond upstream: the adaptive estimator (``FDSCHED_RESERVE_ESTIMATOR=adaptive``, profile ``adaptive``;
pure code in :mod:`fdsched.core.adaptive`). Through the same seam, each running request reserves its expected
remaining output ``E[L - g | L > g]`` learned from the engine's own finished requests (samples taken in
the host's ``finish_requests`` seam, before the host forgets the request: its output length and, where
the client bounded it, its ``max_tokens``); one margin, ``k x sqrt(sum of variances)``, covers the running
set: the per-request answers telescope to ``ceil((sum of means + margin) / block_size)`` within one
admission decision (:class:`fdsched.core.adaptive.SetMargin`), never more than upstream's ratio formula gives
the same requests (``k`` defaults to -2: see fdsched.core.adaptive). A preemption raises ``k`` (and resets the
warm-up fallback); a preempted or still-running request is never a sample. Until a kind (bounded /
unbounded) has enough samples it answers with :func:`fdsched.core.adaptive.warmup_reserve_blocks`. A third-party
``fdsched_estimate_reserve_blocks`` hook still answers first, per request. Cost per running request and
decision: O(1) amortised (a bucket's tail sums are cached until the next finished request), O(log buckets)
at worst.

Beyond upstream: on a prefill node (``splitwise_role == "prefill"``) running requests reserve nothing:
such a node never decodes, and upstream's reservation there stalls it for good (a chunk that needs no
new block is refused while preallocated requests hold the pool, and the ratio only decays after a pass
that scheduled something). The new host's own code (``auto`` there) still has that stall.
"""

from __future__ import annotations

import inspect
import math

from fdsched.core.adaptive import K_BOUND, AdaptiveReserve, RunningRequest, SetMargin, client_bound, track_live
from fdsched.core.metrics import METRICS
from fdsched.core.policies import FixedBlockReserve, NewTokenRatio, max_new_tokens_of

from fdsched.patches._spec import PatchSpec, Reliance
from fdsched.patches._base import PluginBase, block_checks, finished_ids, host_defines, host_global

RM = "fastdeploy.engine.sched.resource_manager_v1"

# What a one-shot signal is for (also the `signal` label of the unconsumed-signals metric).
REFUSE_RUNNING_CHUNK = "refuse-running-chunk"  # the host's check of a running chunk's blocks answers False
COUNT_REFUSAL = "count-refusal"  # a refused threshold check counts as a blocked admission
DECLINE_PREEMPTION = "decline-guarded-preemption"  # old host: _trigger_preempt declines for the guarded chunk
THRESHOLD_FOR_RUNNING_CHUNK = "threshold-for-running-chunk"  # off, new host: the next threshold is a running chunk's
PASS_END = "pass-end"  # off, new host: the pass's end seam closes the plugin's own preemptions

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


class _SchedulePass:
    """What the plugin keeps for one ``schedule()`` pass; opened and closed by the mixin's schedule wrapper."""

    def __init__(self) -> None:
        self.declines: set = set()  # old host: request ids whose _trigger_preempt call declines (the guard)
        self.threshold_for = None  # off, new host: (request id, blocks) the next threshold is computed for
        self.preemptions: list = []  # off, new host: (the running chunk, its preempt tasks), in order
        self.stashed_waiting = None  # off, new host: the waiting queue, held back for the rest of the pass
        self.closed = False

    def has_open_work(self) -> bool:
        return bool(self.preemptions) or self.stashed_waiting is not None


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
        self._fdsched_fixed = FixedBlockReserve(
            s["host_tunables.FD_RESERVE_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL"],
            s["host_tunables.FD_RESERVE_DECAY_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL"],
            s["host_tunables.FD_RESERVE_MIN_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL"],
        )
        self._fdsched_pass = None
        self._fdsched_adaptive = None
        if self._fdsched_impl["ratio_reserve"] == "plugin" and s["tunables.reserve_estimator"] == "adaptive":
            self._fdsched_adaptive = AdaptiveReserve(
                window=s["tunables.adaptive_window"],
                min_samples=s["tunables.adaptive_min_samples"],
                k=s["tunables.adaptive_margin_k"],
                k_step=s["tunables.adaptive_k_step"],
                k_max=K_BOUND,
                k_decay=s["tunables.adaptive_k_decay"],
            )
            self._fdsched_margin = None  # the running set's one margin while an admission decision sums it
            track_live(self._fdsched_adaptive)
            METRICS.adaptive_samples(self._fdsched_adaptive.state(), of=self)
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
            METRICS.ratio(self._fdsched_ratio.value, of=self)

    # ---- the pass ---------------------------------------------------------------------------------
    def schedule(self):
        impl = self._fdsched_impl["ratio_reserve"]
        if impl == "host":
            return super().schedule()
        this_pass, outer = _SchedulePass(), self._fdsched_pass
        self._fdsched_pass = this_pass
        result = None
        try:
            result = super().schedule()
        finally:
            self._fdsched_pass = outer
            with self.lock:
                self._fdsched_end_pass(this_pass, result[0] if result else None)
        scheduled_anything = bool(result[0])
        with self.lock:
            if impl == "plugin":
                self._fdsched_ratio.after_schedule(scheduled_anything)
                METRICS.ratio(self._fdsched_ratio.value, of=self)
            if impl != "plugin" or self._fdsched_adaptive is not None:
                # off: the fixed-block policy itself; adaptive: its warm-up fallback for unbounded requests
                self._fdsched_fixed.after_schedule(scheduled_anything)
        return result

    def _log_console_scheduler_metrics(self, scheduled_reqs):
        this_pass = self._fdsched_pass
        if this_pass is not None and not this_pass.closed:
            self._fdsched_close_pass(this_pass, scheduled_reqs)
        return super()._log_console_scheduler_metrics(scheduled_reqs)

    def _fdsched_close_pass(self, this_pass: _SchedulePass, scheduled_reqs) -> None:
        """Give the pass back what the plugin held for it: the waiting queue, and its preempt tasks in order."""
        this_pass.closed = True
        if this_pass.stashed_waiting is not None:
            arrived = self.waiting  # empty: the lock was held since the queue was set aside
            self.waiting, this_pass.stashed_waiting = this_pass.stashed_waiting, None
            self.waiting.extend(arrived)
        for chunk, tasks in this_pass.preemptions:
            # Before 7783 the preempt tasks went into the pass's list right before the chunk's own task.
            at = next((i for i, task in enumerate(scheduled_reqs) if task is chunk), len(scheduled_reqs))
            scheduled_reqs[at:at] = tasks
        this_pass.preemptions = []

    def _fdsched_end_pass(self, this_pass: _SchedulePass, scheduled_reqs) -> None:
        logger = host_global(RM, "llm_logger")
        if this_pass.has_open_work():
            # The host's pass never reached its end seam: close it here, and say so.
            METRICS.signal_unconsumed(PASS_END, of=self)
            logger.warning(
                "[fdsched] the schedule() pass ended without calling _log_console_scheduler_metrics: the plugin's "
                "running-chunk preemptions are added to the pass's tasks after it and the waiting queue is put back "
                "only now (see `fdsched patches`, ratio_reserve, relies on pass-end)"
            )
            self._fdsched_close_pass(this_pass, scheduled_reqs if scheduled_reqs is not None else [])
        for request_id in sorted(this_pass.declines):
            METRICS.signal_unconsumed(DECLINE_PREEMPTION, of=self)
            logger.warning(f"[fdsched] the guard refused running chunk {request_id} but no preemption call followed")
        if this_pass.threshold_for is not None:
            METRICS.signal_unconsumed(THRESHOLD_FOR_RUNNING_CHUNK, of=self)
            logger.warning(
                f"[fdsched] no threshold was computed for running chunk {this_pass.threshold_for[0]} "
                f"({this_pass.threshold_for[1]} blocks) after its block count"
            )
        block_checks(self.cache_manager).end_pass(logger, of=self)

    # ---- the running chunk --------------------------------------------------------------------------
    def get_new_block_nums(self, request, num_new_tokens):
        blocks = super().get_new_block_nums(request, num_new_tokens)
        this_pass = self._fdsched_pass
        impl = self._fdsched_impl["ratio_reserve"]
        if impl == "host" or this_pass is None or not self._fdsched_is_running_prefill(request):
            return blocks
        if self._fdsched_host.has["ratio_reserve"]:
            if impl == "off":
                self._fdsched_pre_change_running_chunk(this_pass, request, blocks)
        elif impl == "plugin":
            self._fdsched_guard_running_chunk(this_pass, request, blocks)
        return blocks

    def _fdsched_guard_running_chunk(self, this_pass, request, blocks) -> None:
        """Old host: its running pass checks only the chunk's own blocks; apply the reservation here."""
        if self.cache_manager.can_allocate_gpu_blocks(self._fdsched_threshold(blocks)):
            return
        METRICS.admission_blocked(of=self)
        block_checks(self.cache_manager).expect(REFUSE_RUNNING_CHUNK, request.request_id, blocks)
        this_pass.declines.add(request.request_id)

    def _fdsched_pre_change_running_chunk(self, this_pass, request, blocks) -> None:
        """New host, off: a running chunk short of blocks preempts, as before 7783, instead of waiting."""
        this_pass.threshold_for = (request.request_id, blocks)  # before 7783 it needed only its own blocks
        if self.cache_manager.can_allocate_gpu_blocks(blocks):
            return
        preempted, tasks = [], []
        can_schedule = self._trigger_preempt(request, blocks, preempted, tasks)
        if tasks:
            this_pass.preemptions.append((request, tasks))
        if preempted and this_pass.stashed_waiting is None:
            # Before 7783 a pass that preempted admitted nobody: hold the queue back until the pass ends.
            this_pass.stashed_waiting, self.waiting = self.waiting, type(self.waiting)()
        if not can_schedule:
            # The host then stops its running pass (and, as before 7783, admits nobody in this step).
            block_checks(self.cache_manager).expect(REFUSE_RUNNING_CHUNK, request.request_id, blocks)

    # ---- the threshold -----------------------------------------------------------------------------
    def _get_can_schedule_prefill_threshold_block(self, num_chunk_new_block):
        impl = self._fdsched_impl["ratio_reserve"]
        if impl == "host":
            return super()._get_can_schedule_prefill_threshold_block(num_chunk_new_block)
        if impl == "plugin":
            threshold = self._fdsched_threshold(num_chunk_new_block)
        else:
            threshold = self._fdsched_fixed_threshold(num_chunk_new_block)
        # Its caller checks the threshold with can_allocate_gpu_blocks next: count that check's refusal.
        block_checks(self.cache_manager).expect(COUNT_REFUSAL, "(threshold)", threshold)
        return threshold

    def _fdsched_threshold(self, chunk_blocks: int) -> int:
        reserve = self._fdsched_total_reserve()
        METRICS.reserved(reserve, of=self)
        return self._fdsched_speculative_slack(chunk_blocks + reserve)

    def _fdsched_fixed_threshold(self, chunk_blocks: int) -> int:
        this_pass = self._fdsched_pass
        if this_pass is not None and this_pass.threshold_for is not None and this_pass.threshold_for[1] == chunk_blocks:
            this_pass.threshold_for = None
            return chunk_blocks  # pre-change: a running chunk needed only its own blocks
        fixed = self._fdsched_fixed
        threshold = fixed.threshold(chunk_blocks, len(self.running))
        METRICS.reserved(threshold - chunk_blocks, of=self)
        if fixed.relaxed:
            return threshold
        return self._fdsched_speculative_slack(threshold)

    def _fdsched_speculative_slack(self, threshold: int) -> int:
        if self.config.speculative_config.method is not None:
            return min(threshold + 1, self.config.cache_config.max_block_num_per_seq)
        return threshold

    def _fdsched_total_reserve(self) -> int:
        adaptive = self._fdsched_adaptive
        if adaptive is None:
            return sum(self._get_running_request_reserve_blocks(r) for r in self.running)
        # One admission decision: the whole running set at once (order-independent, issue 18). A request a
        # third-party hook answers for is summed outside the set; a prefill node reserves nothing.
        max_model_len = self.config.model_config.max_model_len
        ratio, clip = self._fdsched_ratio.value, self._fdsched_settings["host_tunables.FD_CLIP_MAX_NEW_TOKENS"]
        block_size = self.config.cache_config.block_size
        outside, learned = 0, []
        if self.config.scheduler_config.splitwise_role != "prefill":
            for r in self.running:
                budget, generated = _output_budget(r, max_model_len), len(r.output_token_ids)
                override = self._fdsched_policies.reserve_blocks_override(
                    r.request_id, budget, generated, ratio, clip, block_size
                )
                if override is not None:
                    outside += override
                    continue
                max_tokens = getattr(r.sampling_params, "max_tokens", None)
                bound = client_bound(max_tokens, max_model_len, r.prompt_token_ids_len)
                learned.append(RunningRequest(bound, budget, generated))
        fixed = self._fdsched_fixed
        answer = adaptive.set_reservation(learned, ratio, clip, block_size, 0 if fixed.relaxed else fixed.current)
        METRICS.adaptive_decision(
            answer.mean, adaptive.k * math.sqrt(max(answer.variance, 0.0)), adaptive.k, answer.fallbacks, of=self
        )
        return outside + answer.blocks

    def _get_running_request_reserve_blocks(self, request) -> int:
        if self._fdsched_impl["ratio_reserve"] != "plugin":
            return super()._get_running_request_reserve_blocks(request)
        if self.config.scheduler_config.splitwise_role == "prefill":
            # A prefill node never decodes: its requests leave after their first token. Reserving decode
            # blocks there (as 7783 does) can stall it for good: a chunk that needs no new block is refused
            # while the preallocated requests hold the pool, and the ratio decays only after a pass that
            # scheduled something.
            return 0
        max_model_len = self.config.model_config.max_model_len
        budget = _output_budget(request, max_model_len)
        generated = len(request.output_token_ids)
        ratio, clip = self._fdsched_ratio.value, self._fdsched_settings["host_tunables.FD_CLIP_MAX_NEW_TOKENS"]
        block_size = self.config.cache_config.block_size
        adaptive = self._fdsched_adaptive
        if adaptive is None:
            return self._fdsched_policies.reserve_blocks(request.request_id, budget, generated, ratio, clip, block_size)
        override = self._fdsched_policies.reserve_blocks_override(
            request.request_id, budget, generated, ratio, clip, block_size
        )
        if override is not None:
            return override  # a third-party hook answers for this request (outside the set's margin)
        bound = client_bound(
            getattr(request.sampling_params, "max_tokens", None), max_model_len, request.prompt_token_ids_len
        )
        fixed = self._fdsched_fixed
        # Within an admission decision (_fdsched_total_reserve): a share of the running set's one margin;
        # asked alone: the request with a margin of its own.
        return adaptive.request_blocks(
            RunningRequest(bound, budget, generated), ratio, clip, block_size,
            0 if fixed.relaxed else fixed.current, self._fdsched_margin,
        )

    def fdsched_adaptive_state(self):
        """The adaptive estimator's state (:meth:`fdsched.core.adaptive.AdaptiveReserve.state`), or None when this
        scheduler does not run it."""
        adaptive = self._fdsched_adaptive
        return None if adaptive is None else adaptive.state()

    # ---- the adaptive estimator's samples -------------------------------------------------------
    def finish_requests(self, request_ids):
        adaptive = self._fdsched_adaptive
        if adaptive is None or self.config.scheduler_config.splitwise_role == "prefill":
            # A prefill node's requests leave after their first token: not a sample of the output length.
            return super().finish_requests(request_ids)
        request_ids, ids = finished_ids(request_ids)  # read here and by the host
        running = self._fdsched_running_statuses()
        max_model_len = self.config.model_config.max_model_len
        with self.lock:
            for request_id in ids:
                request = self.requests.get(request_id)
                # Only a request that finishes while running is a sample; a preempted one (waiting to be
                # rescheduled) or an unknown id is not: its length is not known to be complete (censoring).
                if request is None or request.status not in running:
                    continue
                adaptive.observe_finished(
                    client_bound(
                        getattr(request.sampling_params, "max_tokens", None), max_model_len, request.prompt_token_ids_len
                    ),
                    len(request.output_token_ids),
                )
            METRICS.adaptive_samples(adaptive.state(), of=self)
        return super().finish_requests(request_ids)

    def _fdsched_running_statuses(self) -> tuple:
        statuses = self._fdsched_host.request_status
        if self._fdsched_host.split_status:
            return (statuses.RUNNING_PREFILL, statuses.RUNNING_DECODE)
        return (statuses.RUNNING,)

    def _fdsched_is_running_prefill(self, request) -> bool:
        statuses = self._fdsched_host.request_status
        running = statuses.RUNNING_PREFILL if self._fdsched_host.split_status else statuses.RUNNING
        return request.status == running and request.num_computed_tokens < request.need_prefill_tokens

    # ---- preemption ----------------------------------------------------------------------------------
    def _trigger_preempt(self, request, num_new_blocks, preempted_reqs, scheduled_reqs):
        impl = self._fdsched_impl["ratio_reserve"]
        this_pass = self._fdsched_pass
        if this_pass is not None and request.request_id in this_pass.declines:
            # Old host: the guard refused this running chunk. Decline without preempting; a non-empty
            # list makes the host skip its waiting pass, as upstream does after a refused chunk.
            this_pass.declines.discard(request.request_id)
            preempted_reqs.append(request)
            return False
        already = len(preempted_reqs)
        result = super()._trigger_preempt(request, num_new_blocks, preempted_reqs, scheduled_reqs)
        if not host_defines(self, "_reset_reserve_on_preemption"):
            # Old host: no per-preemption seam; its loop reset the fixed reservation at the end of every call.
            if impl == "plugin" and len(preempted_reqs) > already:
                self._fdsched_reestimate(len(preempted_reqs) - already)
            elif impl == "host":
                self._fdsched_reset_host_fixed_reserve()  # also when change 2 replaced that loop
        if impl == "off":
            self._fdsched_fixed.on_preemption()  # pre-change: at the end of every call, as the old host did
        return result

    def _reset_reserve_on_preemption(self):
        impl = self._fdsched_impl["ratio_reserve"]
        if impl == "plugin":
            self._fdsched_reestimate()
        elif impl == "host":
            super()._reset_reserve_on_preemption()
        # off: the fixed reservation is reset at the end of the _trigger_preempt call (see there), as before 7783

    def _fdsched_reset_host_fixed_reserve(self) -> None:
        """The old host's fixed-block reservation after a preemption call (what its own loop does at its end)."""
        if hasattr(self, "init_reserve_output_block_num"):
            self.current_reserve_output_block_num = self.init_reserve_output_block_num
            self.current_reserve_output_block_num_float = self.init_reserve_output_block_num
            self.can_relax_prefill_strategy = False

    def _fdsched_reestimate(self, preemptions: int = 1) -> None:
        adaptive = self._fdsched_adaptive
        if adaptive is not None:
            # The reservation was too small: widen the margin; the warm-up fallback resets like the legacy policy.
            adaptive.observe_preemption(preemptions)
            self._fdsched_fixed.on_preemption()
            METRICS.adaptive_samples(adaptive.state(), of=self)
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
        METRICS.ratio(value, of=self)


def _output_budget(request, max_model_len: int) -> int:
    """A running request's output budget (max_tokens, else what the context leaves)."""
    return max_new_tokens_of(
        getattr(request.sampling_params, "max_tokens", None), max_model_len, request.prompt_token_ids_len
    )


class RatioReserveCacheMixin(PluginBase):
    """The host's block check, seen by the scheduler: a keyed refusal of one check (evicting nothing), and a
    refused threshold check counted for the metrics."""

    def can_allocate_gpu_blocks(self, num_blocks, try_free_gpu_blocks=True):
        signals = self.__dict__.get("_fdsched_block_checks")
        kinds = signals.take(num_blocks) if signals is not None else ()
        if REFUSE_RUNNING_CHUNK in kinds:
            allowed = False
        else:
            allowed = super().can_allocate_gpu_blocks(num_blocks, try_free_gpu_blocks)
        if COUNT_REFUSAL in kinds and not allowed:
            METRICS.admission_blocked(of=self)
        return allowed


def _has_ratio_reserve(info) -> bool:
    return hasattr(info.rm_class, "_get_running_request_reserve_blocks") and hasattr(
        info.rm_class, "_reset_reserve_on_preemption"
    )


def _uses(func, names) -> str | None:
    from fdsched.patches._base import code_names

    missing = set(names) - code_names(func)
    return f"{func.__qualname__} no longer uses {', '.join(sorted(missing))}" if missing else None


def _running_chunk_check(info):
    names = {"get_new_block_nums", "can_allocate_gpu_blocks", "preempted_reqs", "scheduled_reqs"}
    if _has_ratio_reserve(info):
        names.add("_get_can_schedule_prefill_threshold_block")
    else:
        names.add("_trigger_preempt")
    return _uses(info.rm_class.schedule, names)


def _pass_end(info):
    if not _has_ratio_reserve(info):
        return None  # only off on the new host uses it
    problem = _uses(info.rm_class.schedule, {"_log_console_scheduler_metrics", "waiting", "lock"})
    if problem:
        return problem
    seam = getattr(info.rm_class, "_log_console_scheduler_metrics", None)
    if seam is None or "scheduled_reqs" not in inspect.signature(seam).parameters:
        return "ResourceManagerV1._log_console_scheduler_metrics no longer takes scheduled_reqs"
    return None


def _threshold_check(info):
    return _uses(info.rm_class.schedule, {"_get_can_schedule_prefill_threshold_block", "can_allocate_gpu_blocks"})


def _finish_seam(info):
    async_finish = getattr(info.rm_class, "finish_requests_async", None)
    if async_finish is not None:
        problem = _uses(async_finish, {"finish_requests"})
        if problem:
            return problem
    return _uses(info.rm_class.finish_requests, {"requests", "running", "remove"})


def _as_selected(settings, host_has_ratio: bool) -> bool:
    # The new host has upstream's ratio formula, never the adaptive estimator.
    return host_has_ratio and settings["tunables.reserve_estimator"] == "ratio"


SPEC = PatchSpec(
    change_id="ratio_reserve",
    title="new_token_ratio KV reservation and chunked-prefill guard",
    upstream_prs=(7444, 7783),
    upstream_state="merged",
    replaces=(
        "ResourceManagerV1.__init__",
        "ResourceManagerV1.schedule",
        "ResourceManagerV1.get_new_block_nums",
        "ResourceManagerV1._get_can_schedule_prefill_threshold_block",
        "ResourceManagerV1._get_running_request_reserve_blocks",
        "ResourceManagerV1._reset_reserve_on_preemption",
        "ResourceManagerV1._trigger_preempt",
        "ResourceManagerV1._log_console_scheduler_metrics",
        "ResourceManagerV1.finish_requests",
        "PrefixCacheManager.can_allocate_gpu_blocks",
    ),
    requires={
        "PrefixCacheManager.can_allocate_gpu_blocks": ("num_blocks",),
        "ResourceManagerV1.get_new_block_nums": ("request", "num_new_tokens"),
        "ResourceManagerV1._get_can_schedule_prefill_threshold_block": ("num_chunk_new_block",),
        "ResourceManagerV1._trigger_preempt": ("request", "num_new_blocks", "preempted_reqs", "scheduled_reqs"),
        "ResourceManagerV1._log_console_scheduler_metrics": ("scheduled_reqs",),
        "ResourceManagerV1.finish_requests": ("request_ids",),
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
    relies_on=(
        Reliance("running-chunk-check", "the running pass checks a running chunk's blocks right after "
                 "get_new_block_nums (old host: a failed check calls _trigger_preempt with the pass's lists)",
                 _running_chunk_check),
        Reliance("pass-end", "schedule() ends each pass, under the lock, with "
                 "_log_console_scheduler_metrics(scheduled_reqs); only the waiting pass reads self.waiting",
                 _pass_end, when=("off",)),
        Reliance("threshold-check", "every threshold is checked with can_allocate_gpu_blocks next",
                 _threshold_check),
        Reliance("finish-seam", "every finished request goes through finish_requests (finish_requests_async "
                 "submits it), found in self.requests with its running status and taken out of running",
                 _finish_seam, when=("plugin",)),
    ),
    host_has_as_selected=_as_selected,
    applies=("host", "plugin", "off"),
)
