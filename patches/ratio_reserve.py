"""Change 3 — new_token_ratio-based KV reservation, with the chunked-prefill guard.

Replaces:  ResourceManagerV1.__init__ (state), ResourceManagerV1.schedule (wrapper: the pass's state; decay
           after a pass that scheduled something), ResourceManagerV1.get_new_block_nums (the running chunk:
           old-host guard, or the pre-change preemption under ``off`` on the new host),
           ResourceManagerV1._get_can_schedule_prefill_threshold_block (the threshold),
           ResourceManagerV1._get_running_request_reserve_blocks (new host's seam: one request's reserve),
           ResourceManagerV1._reset_reserve_on_preemption (new host's seam: re-estimate after a preemption),
           ResourceManagerV1._trigger_preempt (wrapper: old host's reservation resets, the guard's decline),
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
  * pass-end: (new host, ``off``) ``schedule()`` holds ``self.lock`` for the whole pass and returns the pass's task
    list; its waiting pass starts with a truth test of ``self.waiting`` and nothing before it in the pass reads the
    queue (every other reader of the queue, in the host and the engine, asks its ``len``).
  * threshold-check: every caller of ``_get_can_schedule_prefill_threshold_block`` checks its result with
    ``cache_manager.can_allocate_gpu_blocks`` next (the refusal count).
  * finish-seam: (adaptive estimator) every request the engine finishes goes through ``finish_requests``
    (``finish_requests_async`` submits it to a pool), which finds it in ``self.requests``, still with its
    running status, and takes it out of ``running``; a preempted request is not running.

How: one admission budget per ``schedule()`` pass (:class:`fdsched.core.admission.AdmissionBudget`), with
this arm's reservation strategy behind it. The ``schedule`` wrapper opens it; every admission asks it at the
host's threshold seam ``_get_can_schedule_prefill_threshold_block`` (a prefill, new or the next chunk of a
running one, is admitted only when free blocks cover its chunk plus what the running set keeps free); the
wrapper closes it when the pass ends and then tells the strategy whether the pass scheduled something.
The arm's class holds the mixin for its impl, host version and estimator (``SPEC.variants``), chosen
once when the class is built; no method asks which impl it runs:

===========================  ===================================================================
impl (host)                  mixin, strategy
===========================  ===================================================================
host (either)                ``HostReserveMixin`` (old host: ``HostReserveOldHostMixin``): the host's
                             own code, fed the profile's values
plugin, ratio (new / old)    ``RatioReserveMixin`` / ``RatioReserveOldHostMixin``: :class:`RatioStrategy`
plugin, adaptive (new / old) ``AdaptiveReserveMixin`` / ``AdaptiveReserveOldHostMixin``:
                             :class:`AdaptiveStrategy`
off (new host only)          ``PreChangeReserveMixin``: :class:`FixedBlockStrategy` and the pre-change
                             running pass
===========================  ===================================================================

Upstream's formula keeps ``ceil(min(max_tokens - generated, clip) * ratio / block_size)`` blocks per running
request (hook ``fdsched_estimate_reserve_blocks``; the new host's per-request seam
``_get_running_request_reserve_blocks`` answers the same for one request asked alone). The ratio starts at
init, decays after each pass that scheduled something, and is re-estimated after a preemption (the new host's
``_reset_reserve_on_preemption`` seam; on the old host at the end of a ``_trigger_preempt`` call that
preempted). A running chunked prefill that fails the threshold stops the running pass and blocks waiting
requests for the step. On the new host that stop is the host's own code; on the old host the plugin gets the
same effect through the host's own control flow: ``get_new_block_nums`` asks the budget for the chunk and,
refused, asks the cache manager to refuse the host's check of exactly that chunk's blocks (a one-shot signal
keyed to the scheduling thread, the request and the block count, evicting nothing), and ``_trigger_preempt``
then declines for that request without preempting and puts it into the pass's ``preempted_reqs`` (the host
skips its waiting pass when that list is not empty).

``off`` on the new host restores the pre-change running pass too: a running chunk short of blocks
preempts instead of waiting. The plugin preempts (``_trigger_preempt``) into lists of its own, kept in the
pass's budget, and closes admission for the rest of that pass (the pre-change pass skips admission after a
preemption): the waiting queue is replaced by a copy that holds every request but reads as empty to the host's
``while self.waiting`` (:func:`admission_closed`). The ``schedule`` wrapper, the host's own seam for the pass,
ends it: under the host's lock it gives the queue its own type back (with every request that arrived meanwhile in
its place) and puts the preempt tasks into the pass's list just before the chunk's own task. Nothing depends on
who called whom: a class between the host's ``schedule()`` and these methods changes nothing. Left as the new
host has it: the token budget that 7783 pre-deducts for decoding requests at the start of a pass.

One-shot signals (the refusal, the refusal count) go to the cache manager keyed to the thread, the request the
scheduler is deciding on (``get_new_block_nums`` puts it in focus) and the block count; a check by another thread
(the token processor, the transfer receiver, the PD preallocation) neither takes nor is bent by one. The
budget belongs to the thread that opened it: a threshold asked on another thread gets a budget of its own.
A signal, a guard's decline or a pre-change running chunk's threshold still pending at the end of a pass is dropped,
logged and counted in ``fastdeploy:fdsched_unconsumed_signals_total{signal}``.

Beyond upstream: the adaptive estimator (``FDSCHED_RESERVE_ESTIMATOR=adaptive``, profile ``adaptive``;
pure code in :mod:`fdsched.core.adaptive`). Through the same seam, each running request reserves its expected
remaining output ``E[L - g | L > g]`` learned from the engine's own finished requests (samples taken in
the host's ``finish_requests`` seam, before the host forgets the request: its output length and, where
the client bounded it, its ``max_tokens``); one margin, ``k x sqrt(sum of variances)``, covers the running
set: the budget asks the strategy for the whole set at once, ``ceil((sum of means + margin) / block_size)``
(:meth:`fdsched.core.adaptive.AdaptiveReserve.set_reservation`: order-independent, never negative), never more
than upstream's ratio formula gives
the same requests (``k`` defaults to -2: see fdsched.core.adaptive). A preemption raises ``k`` (and resets the
warm-up fallback); a preempted or still-running request is never a sample. Until a kind (bounded /
unbounded) has enough samples it answers with :func:`fdsched.core.adaptive.warmup_reserve_blocks`. A third-party
``fdsched_estimate_reserve_blocks`` hook still answers first, per request (outside the set's margin). Cost per running request and
decision: O(1) amortised (a bucket's tail sums are cached until the next finished request), O(log buckets)
at worst; within a pass, a request that generated nothing since the last ask is neither viewed nor estimated
again (the budget keeps its view, the estimator its terms), and the gauges are set once, at the pass's end.

Beyond upstream: on a prefill node (``splitwise_role == "prefill"``) running requests reserve nothing:
such a node never decodes, and upstream's reservation there stalls it for good (a chunk that needs no
new block is refused while preallocated requests hold the pool, and the ratio only decays after a pass
that scheduled something). The new host's own code (``auto`` there) still has that stall.
"""

from __future__ import annotations

import functools
import inspect
import threading

from fdsched.core.adaptive import K_BOUND, AdaptiveReserve, client_bound, track_live
from fdsched.core.admission import AdaptiveStrategy, AdmissionBudget, FixedBlockStrategy, RatioStrategy, RunningView
from fdsched.core.metrics import METRICS
from fdsched.core.policies import FixedBlockReserve, NewTokenRatio, max_new_tokens_of

from fdsched.patches._spec import PatchSpec, Reliance, Shapes, Variant
from fdsched.patches._base import PluginBase, block_checks, finished_ids, host_global

RM = "fastdeploy.engine.sched.resource_manager_v1"

# What a one-shot signal is for (also the `signal` label of the unconsumed-signals metric).
REFUSE_RUNNING_CHUNK = "refuse-running-chunk"  # the host's check of a running chunk's blocks answers False
COUNT_REFUSAL = "count-refusal"  # a refused threshold check counts as a blocked admission
DECLINE_PREEMPTION = "decline-guarded-preemption"  # old host: _trigger_preempt declines for the guarded chunk
THRESHOLD_FOR_RUNNING_CHUNK = "threshold-for-running-chunk"  # off, new host: the next threshold is a running chunk's

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
_FIXED = (
    "host_tunables.FD_RESERVE_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL",
    "host_tunables.FD_RESERVE_DECAY_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL",
    "host_tunables.FD_RESERVE_MIN_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL",
)


class ReservationMixin(PluginBase):
    """Base of change 3's scheduler mixins (one per impl, host version and estimator: see ``SPEC.variants``)."""


# ---- impl "host": the host's own code, fed the profile's values ----------------------------------------
class HostReserveMixin(ReservationMixin):
    """The host's own reservation code runs; a profile may set the values it reads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        s = self._fdsched_settings
        for attr, key in _HOST_ATTRS.items():
            if hasattr(self, attr):
                setattr(self, attr, s[key])
        if hasattr(self, "new_token_ratio"):
            self.new_token_ratio = self.init_new_token_ratio
        if hasattr(self, "current_reserve_output_block_num"):
            self.current_reserve_output_block_num = self.init_reserve_output_block_num
            self.current_reserve_output_block_num_float = float(self.init_reserve_output_block_num)


class HostReserveOldHostMixin(HostReserveMixin):
    """The old host's own fixed-block code: its preemption loop resets the reservation at the end of every
    ``_trigger_preempt`` call; done here too, so it still happens when change 2 replaced that loop. Only on a host
    that keeps that reservation (:data:`HOST_RESERVE_OLD_HOST`; elsewhere :class:`HostReserveMixin`)."""

    fdsched_attributes = ("init_reserve_output_block_num",)

    def _trigger_preempt(self, request, num_new_blocks, preempted_reqs, scheduled_reqs):
        result = super()._trigger_preempt(request, num_new_blocks, preempted_reqs, scheduled_reqs)
        self.current_reserve_output_block_num = self.init_reserve_output_block_num
        self.current_reserve_output_block_num_float = self.init_reserve_output_block_num
        self.can_relax_prefill_strategy = False
        return result


HOST_RESERVE_OLD_HOST = Shapes(HostReserveOldHostMixin, HostReserveMixin)


# ---- what the plugin's reservation (impls "plugin" and "off") shares -----------------------------------
class _BudgetedReserve(ReservationMixin):
    """One :class:`fdsched.core.admission.AdmissionBudget` per ``schedule()`` pass, with this arm's strategy
    behind it: opened by the ``schedule`` wrapper, asked at the host's threshold seam (and by the old host's
    guard), closed when the pass ends. The budget belongs to the thread that opened it: a threshold asked on
    another thread while the pass is open (the old host's PD preallocation) gets a budget of its own."""

    fdsched_globals = {RM: ("llm_logger",)}
    fdsched_attributes = ("config", "running", "lock", "cache_manager")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        s = self._fdsched_settings
        self._fdsched_ratio = NewTokenRatio(
            s["host_tunables.FD_INIT_NEW_TOKEN_RATIO"],
            s["host_tunables.FD_MIN_NEW_TOKEN_RATIO"],
            s["host_tunables.FD_NEW_TOKEN_RATIO_DECAY"],
            s.reestimate_cap,
        )
        self._fdsched_fixed = FixedBlockReserve(*(s[key] for key in _FIXED))
        self._fdsched_open: dict = {}  # thread id -> the budget of the schedule() pass that thread has open
        # A draft model (speculative decoding) needs one block more per chunk; fixed for the scheduler's life.
        speculative = self.config.speculative_config.method is not None
        self._fdsched_speculative_slack = self._fdsched_draft_slack if speculative else _no_slack

    @functools.cached_property
    def _fdsched_strategy(self):
        """This arm's strategy (built on first use: it reads the host's config)."""
        return self._fdsched_make_strategy()

    def _fdsched_make_strategy(self):
        raise NotImplementedError

    def _fdsched_new_budget(self) -> AdmissionBudget:
        return AdmissionBudget(self._fdsched_strategy, self._fdsched_speculative_slack)

    def _fdsched_budget(self):
        """The budget of the pass this thread has open, else None."""
        return self._fdsched_open.get(threading.get_ident())

    # ---- the pass ---------------------------------------------------------------------------------
    def schedule(self):
        # Keyed by thread: a second thread calling schedule() (it then waits for the host's lock) neither
        # replaces nor sees this pass's budget.
        thread, budget = threading.get_ident(), self._fdsched_new_budget()
        outer = self._fdsched_open.get(thread)
        self._fdsched_open[thread] = budget
        result = None
        try:
            result = super().schedule()
        finally:
            if outer is None:
                del self._fdsched_open[thread]
            else:
                self._fdsched_open[thread] = outer
            with self.lock:
                self._fdsched_end_pass(budget, result[0] if result else None)
        with self.lock:
            self._fdsched_strategy.after_pass(bool(result[0]))
            self._fdsched_strategy.report(of=self)
        return result

    def _fdsched_end_pass(self, budget: AdmissionBudget, scheduled_reqs) -> None:
        if budget.asks:
            self._fdsched_report(budget)
        logger = host_global(RM, "llm_logger")
        for request_id in sorted(budget.close()):
            METRICS.signal_unconsumed(DECLINE_PREEMPTION, of=self)
            logger.warning(f"[fdsched] the guard refused running chunk {request_id} but no preemption call followed")
        block_checks(self.cache_manager).end_pass(logger, of=self)

    # ---- the admission threshold ---------------------------------------------------------------------
    def get_new_block_nums(self, request, num_new_tokens):
        # The host asks for a request's block count right before that request's block checks.
        block_checks(self.cache_manager).focus(request.request_id)
        return super().get_new_block_nums(request, num_new_tokens)

    def _get_can_schedule_prefill_threshold_block(self, num_chunk_new_block):
        return self._fdsched_threshold_seam(num_chunk_new_block)

    def _fdsched_threshold_seam(self, num_chunk_new_block: int) -> int:
        """The answer at the host's threshold seam, whichever shape the host gives it."""
        threshold = self._fdsched_threshold(num_chunk_new_block)
        # Its caller checks the threshold with can_allocate_gpu_blocks next: count that check's refusal.
        block_checks(self.cache_manager).expect(COUNT_REFUSAL, threshold)
        return threshold

    def _fdsched_threshold(self, chunk_blocks: int) -> int:
        budget = self._fdsched_budget()
        if budget is not None:
            # The pass's figures go to the metrics once, when it ends (_fdsched_end_pass): a pass may ask once
            # per admission, and the gauges' updates cost a fair part of an ask.
            return budget.threshold(chunk_blocks, self._fdsched_views(kept=budget.views))
        budget = self._fdsched_new_budget()  # asked outside a pass: a budget of its own, reported now
        threshold = budget.threshold(chunk_blocks, self._fdsched_views())
        self._fdsched_report(budget)
        return threshold

    def _fdsched_report(self, budget: AdmissionBudget) -> None:
        """The running set's blocks at ``budget``'s last ask, and the strategy's last decision, to the metrics."""
        METRICS.reserved(budget.reserved, of=self)
        self._fdsched_strategy.report_decision(of=self)

    def fdsched_running_reserve(self) -> int:
        """The blocks the running set keeps free now (what an admission's threshold adds to its chunk); the
        decision's figures go to the metrics as an admission's do."""
        blocks = self._fdsched_strategy.set_blocks(self._fdsched_views())
        self._fdsched_strategy.report_decision(of=self)
        return blocks

    def _fdsched_draft_slack(self, threshold: int) -> int:
        return min(threshold + 1, self.config.cache_config.max_block_num_per_seq)

    def _fdsched_views(self, requests=None, with_phase: bool = False, kept: dict = None) -> list:
        """``requests`` (default: the running ones) as the strategy sees them (``with_phase``: whether each is
        decoding, asked only where it is used: the hook may be a third party's).

        ``kept``: the open pass's views by request id (:attr:`fdsched.core.admission.AdmissionBudget.views`): a
        request found there, the same object with as many output tokens, is seen as it was at the pass's last
        ask (its client bound and prompt do not change while the scheduler holds its lock; its output grows
        when the token processor appends, and then it is seen afresh). Not with ``with_phase``.
        """
        # Built for every running request at every admission decision: names are bound once per call.
        max_model_len = self.config.model_config.max_model_len
        is_decoding = self._fdsched_is_decoding if with_phase else None
        if with_phase:
            kept = None
        view, budget_of, bound_of = RunningView, max_new_tokens_of, client_bound
        views = []
        append = views.append
        for r in self.running if requests is None else requests:
            generated = len(r.output_token_ids)
            if kept is not None:
                seen = kept.get(r.request_id)
                if seen is not None and seen[0] is r and seen[1] == generated:
                    append(seen[2])
                    continue
            max_tokens = getattr(r.sampling_params, "max_tokens", None)
            prompt_len = r.prompt_token_ids_len
            made = view(
                r.request_id,
                budget_of(max_tokens, max_model_len, prompt_len),
                generated,
                bound_of(max_tokens, max_model_len, prompt_len),
                is_decoding(r) if with_phase else None,
            )
            if kept is not None:
                kept[r.request_id] = (r, generated, made)
            append(made)
        return views

    def _fdsched_is_running_prefill(self, request) -> bool:
        return request.status == self._fdsched_prefill_status and request.num_computed_tokens < request.need_prefill_tokens


# ---- impl "plugin": upstream's ratio formula, or the adaptive estimator -----------------------------------
class _RatioCore(_BudgetedReserve):
    """The plugin's version of change 3 with upstream's ratio formula (:class:`RatioStrategy`), on any host."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A prefill node never decodes: its requests leave after their first token. Reserving decode blocks
        # there (as 7783 does) can stall it for good: a chunk that needs no new block is refused while the
        # preallocated requests hold the pool, and the ratio decays only after a pass that scheduled something.
        self._fdsched_decodes = self.config.scheduler_config.splitwise_role != "prefill"
        METRICS.ratio(self._fdsched_ratio.value, of=self)

    def _fdsched_make_strategy(self):
        return RatioStrategy(
            self._fdsched_ratio,
            self._fdsched_settings["host_tunables.FD_CLIP_MAX_NEW_TOKENS"],
            self.config.cache_config.block_size,
            self._fdsched_settings["tunables.ratio_reestimate_extra_blocks"],
            self._fdsched_policies.reserve_blocks,
            decodes=self._fdsched_decodes,
        )

    def _fdsched_reestimate(self, preemptions: int = 1) -> None:
        self._fdsched_strategy.on_preemption(self._fdsched_views(with_phase=True), preemptions)
        METRICS.ratio(self._fdsched_ratio.value, of=self)

    def fdsched_adaptive_state(self):
        """The adaptive estimator's state (:meth:`fdsched.core.adaptive.AdaptiveReserve.state`), or None when this
        scheduler does not run it."""
        return None


class _AdaptiveCore(_RatioCore):
    """The plugin's own estimator (:class:`AdaptiveStrategy`); every request that finishes running is a sample."""

    fdsched_attributes = ("requests",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        s = self._fdsched_settings
        # Built now (it needs nothing of the host's config), so `fdsched doctor` and the metrics see it from the
        # start; the strategy around it is built on first use, as every arm's is.
        self._fdsched_adaptive = AdaptiveReserve(
            window=s["tunables.adaptive_window"],
            min_samples=s["tunables.adaptive_min_samples"],
            k=s["tunables.adaptive_margin_k"],
            k_step=s["tunables.adaptive_k_step"],
            k_max=K_BOUND,
            k_decay=s["tunables.adaptive_k_decay"],
        )
        track_live(self._fdsched_adaptive)
        METRICS.adaptive_samples(self._fdsched_adaptive.state(), of=self)
        # A prefill node's requests leave after their first token: not samples of the output length.
        self._fdsched_take_samples = self._fdsched_observe_finished if self._fdsched_decodes else _no_samples

    def _fdsched_make_strategy(self):
        s = self._fdsched_settings
        return AdaptiveStrategy(
            self._fdsched_ratio,
            s["host_tunables.FD_CLIP_MAX_NEW_TOKENS"],
            self.config.cache_config.block_size,
            s["tunables.ratio_reestimate_extra_blocks"],
            self._fdsched_policies.reserve_blocks_override,
            self._fdsched_adaptive,
            self._fdsched_fixed,
            decodes=self._fdsched_decodes,
        )

    def _fdsched_reestimate(self, preemptions: int = 1) -> None:
        super()._fdsched_reestimate(preemptions)
        METRICS.adaptive_samples(self._fdsched_adaptive.state(), of=self)

    def fdsched_adaptive_state(self):
        return self._fdsched_adaptive.state()

    def finish_requests(self, request_ids):
        request_ids, ids = finished_ids(request_ids)  # read here and by the host
        self._fdsched_take_samples(ids)
        return super().finish_requests(request_ids)

    def _fdsched_observe_finished(self, ids) -> None:
        running = self._fdsched_running_statuses
        max_model_len = self.config.model_config.max_model_len
        adaptive = self._fdsched_adaptive
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


class _NewHostSeams(ReservationMixin):
    """The seams a host with 7783 calls: one running request's reserve, and the re-estimate after a preemption."""

    def _get_running_request_reserve_blocks(self, request) -> int:
        (view,) = self._fdsched_views((request,))
        return self._fdsched_strategy.request_blocks(view)

    def _reset_reserve_on_preemption(self):
        self._fdsched_reestimate()


class RatioReserveMixin(_NewHostSeams, _RatioCore):
    """Upstream's ratio formula on a host with 7783 (through its seams)."""


class AdaptiveReserveMixin(_NewHostSeams, _AdaptiveCore):
    """The adaptive estimator on a host with 7783 (through its seams)."""


class _OldHostGuard(_BudgetedReserve):
    """The old host checks a running chunk against its own blocks only, and has no per-preemption seam: the
    budget is asked for the chunk in ``get_new_block_nums``; a refused chunk's check is refused (a signal keyed
    to it) and its preemption call declined; the ratio is re-estimated after a ``_trigger_preempt`` call that
    preempted."""

    fdsched_calls = {"PrefixCacheManager.can_allocate_gpu_blocks": ("num_blocks",)}

    def get_new_block_nums(self, request, num_new_tokens):
        blocks = super().get_new_block_nums(request, num_new_tokens)
        budget = self._fdsched_budget()
        if budget is None or not self._fdsched_is_running_prefill(request):
            return blocks
        if self.cache_manager.can_allocate_gpu_blocks(self._fdsched_threshold(blocks)):
            return blocks
        METRICS.admission_blocked(of=self)
        block_checks(self.cache_manager).expect(REFUSE_RUNNING_CHUNK, blocks)
        budget.declined.add(request.request_id)
        return blocks

    def _trigger_preempt(self, request, num_new_blocks, preempted_reqs, scheduled_reqs):
        budget = self._fdsched_budget()
        if budget is not None and request.request_id in budget.declined:
            # The guard refused this running chunk. Decline without preempting; a non-empty list makes the
            # host skip its waiting pass, as upstream does after a refused chunk.
            budget.declined.discard(request.request_id)
            preempted_reqs.append(request)
            return False
        already = len(preempted_reqs)
        result = super()._trigger_preempt(request, num_new_blocks, preempted_reqs, scheduled_reqs)
        if len(preempted_reqs) > already:
            self._fdsched_reestimate(len(preempted_reqs) - already)
        return result


class RatioReserveOldHostMixin(_OldHostGuard, _RatioCore):
    """Upstream's ratio formula on the old host (with the guard)."""


class AdaptiveReserveOldHostMixin(_OldHostGuard, _AdaptiveCore):
    """The adaptive estimator on the old host (with the guard)."""


class _ThresholdTakesRequest(ReservationMixin):
    """The threshold seam where the host passes the request too, ``(request, num_chunk_new_block)`` (FastDeploy
    2.4 and 2.5): the same answer; the request is not needed for it."""

    def _get_can_schedule_prefill_threshold_block(self, request, num_chunk_new_block):
        return self._fdsched_threshold_seam(num_chunk_new_block)


class RatioReserveRequestArgMixin(_ThresholdTakesRequest, RatioReserveOldHostMixin):
    """:class:`RatioReserveOldHostMixin` on a host whose threshold seam takes the request."""


class AdaptiveReserveRequestArgMixin(_ThresholdTakesRequest, AdaptiveReserveOldHostMixin):
    """:class:`AdaptiveReserveOldHostMixin` on a host whose threshold seam takes the request."""


RATIO_OLD_HOST = Shapes(RatioReserveOldHostMixin, RatioReserveRequestArgMixin)
ADAPTIVE_OLD_HOST = Shapes(AdaptiveReserveOldHostMixin, AdaptiveReserveRequestArgMixin)


def _no_slack(threshold: int) -> int:
    return threshold


def _no_samples(ids) -> None:
    """A prefill node: finished requests are not samples."""


def _plugin_variant(host_has: bool, settings):
    adaptive = settings is not None and settings["tunables.reserve_estimator"] == "adaptive"
    if host_has:
        return AdaptiveReserveMixin if adaptive else RatioReserveMixin
    return ADAPTIVE_OLD_HOST if adaptive else RATIO_OLD_HOST


# ---- impl "off" (a host that has the change): the pre-change policy and running pass -----------------------
class _PreChangePass(AdmissionBudget):
    """The budget of a pre-change pass, with what the pre-change running pass does that 7783's does not: a
    running chunk short of blocks preempts (into lists of the plugin's own, added to the pass's task list at
    its end, right before the chunk's task), and a pass that preempted admits nobody (the waiting queue reads as
    empty until the pass ends: :func:`admission_closed`)."""

    def __init__(self, strategy, slack):
        super().__init__(strategy, slack)
        self.running_chunk = None  # (request id, blocks): the next threshold is that running chunk's
        self.preemptions: list = []  # (the running chunk, its preempt tasks), in order
        self.queue_type = None  # the waiting queue's own type, while admission is closed for the pass


@functools.lru_cache(maxsize=None)
def admission_closed(queue_type: type) -> type:
    """A ``queue_type`` that holds every request as the host's does but reads as empty to a truth test: the host's
    waiting pass starts with ``while self.waiting``, its only gate before its side effects (prefix matching,
    swap-in) that the plugin can reach. Every other operation (append, appendleft, len, remove, iteration) is the
    queue's own, so a request that arrives meanwhile keeps its place and the pass's metrics count the queue."""
    return type(f"AdmissionClosed{queue_type.__name__.capitalize()}", (queue_type,), {
        "__slots__": (),
        "__bool__": lambda self: False,
        "__doc__": f"A {queue_type.__name__} that reads as empty for the rest of a pass that preempted.",
    })


class PreChangeReserveMixin(_BudgetedReserve):
    """``off`` on a host that has 7783: the fixed-block policy (:class:`FixedBlockStrategy`) and the pre-change
    running pass (a running chunk short of blocks preempts instead of waiting). The pass ends where the host's
    ``schedule()`` returns: the ``schedule`` wrapper gives it back what the plugin held, under the host's lock."""

    fdsched_calls = {"PrefixCacheManager.can_allocate_gpu_blocks": ("num_blocks",)}
    fdsched_attributes = ("waiting",)

    def _fdsched_make_strategy(self):
        return FixedBlockStrategy(self._fdsched_fixed)

    def _fdsched_new_budget(self) -> AdmissionBudget:
        return _PreChangePass(self._fdsched_strategy, self._fdsched_speculative_slack)

    def get_new_block_nums(self, request, num_new_tokens):
        blocks = super().get_new_block_nums(request, num_new_tokens)
        budget = self._fdsched_budget()
        if budget is not None and self._fdsched_is_running_prefill(request):
            self._fdsched_pre_change_running_chunk(budget, request, blocks)
        return blocks

    def _fdsched_pre_change_running_chunk(self, budget: _PreChangePass, request, blocks) -> None:
        budget.running_chunk = (request.request_id, blocks)  # before 7783 it needed only its own blocks
        if self.cache_manager.can_allocate_gpu_blocks(blocks):
            return
        preempted, tasks = [], self._fdsched_task_list()
        can_schedule = self._trigger_preempt(request, blocks, preempted, tasks)
        if len(tasks):
            budget.preemptions.append((request, tasks))
        if preempted and budget.queue_type is None:
            # Before 7783 a pass that preempted admitted nobody: close admission until the pass ends. The
            # scheduler lock is held for the whole pass, so nothing else reads or fills the queue meanwhile.
            budget.queue_type = type(self.waiting)
            self.waiting = admission_closed(budget.queue_type)(self.waiting)
        if not can_schedule:
            # The host then stops its running pass (and, as before 7783, admits nobody in this step).
            block_checks(self.cache_manager).expect(REFUSE_RUNNING_CHUNK, blocks)

    def _get_can_schedule_prefill_threshold_block(self, num_chunk_new_block):
        budget = self._fdsched_budget()
        if budget is not None and budget.running_chunk is not None and budget.running_chunk[1] == num_chunk_new_block:
            budget.running_chunk = None
            # pre-change: a running chunk needed only its own blocks
            block_checks(self.cache_manager).expect(COUNT_REFUSAL, num_chunk_new_block)
            return num_chunk_new_block
        return super()._get_can_schedule_prefill_threshold_block(num_chunk_new_block)

    def _trigger_preempt(self, request, num_new_blocks, preempted_reqs, scheduled_reqs):
        result = super()._trigger_preempt(request, num_new_blocks, preempted_reqs, scheduled_reqs)
        self._fdsched_strategy.on_preemption()  # pre-change: at the end of every call, as the old host did
        return result

    def _reset_reserve_on_preemption(self):
        """Nothing: before 7783 the reservation was reset at the end of the ``_trigger_preempt`` call."""

    def _fdsched_task_list(self):
        """An empty container of the kind the host's ``_trigger_preempt`` appends preempt tasks to (a list)."""
        return []

    def _fdsched_insert_before(self, scheduled_reqs, chunk, tasks) -> None:
        at = next((i for i, task in enumerate(scheduled_reqs) if task is chunk), len(scheduled_reqs))
        scheduled_reqs[at:at] = tasks

    def _fdsched_end_pass(self, budget: _PreChangePass, scheduled_reqs) -> None:
        """Give the pass back what the plugin held for it (under the host's lock): the waiting queue, every request
        that arrived meanwhile in its place, and its preempt tasks in order."""
        if budget.queue_type is not None:
            self.waiting, budget.queue_type = budget.queue_type(self.waiting), None
        if scheduled_reqs is None:  # the host's pass raised: its tasks are gone, and so are the plugin's
            scheduled_reqs = self._fdsched_task_list()
        for chunk, tasks in budget.preemptions:
            # Before 7783 the preempt tasks went into the pass's list right before the chunk's own task.
            self._fdsched_insert_before(scheduled_reqs, chunk, tasks)
        budget.preemptions = []
        if budget.running_chunk is not None:
            METRICS.signal_unconsumed(THRESHOLD_FOR_RUNNING_CHUNK, of=self)
            host_global(RM, "llm_logger").warning(
                f"[fdsched] no threshold was computed for running chunk {budget.running_chunk[0]} "
                f"({budget.running_chunk[1]} blocks) after its block count"
            )
        super()._fdsched_end_pass(budget, scheduled_reqs)


class PreChangeReserveBatchMixin(PreChangeReserveMixin):
    """:class:`PreChangeReserveMixin` on a host whose pass collects its tasks in a ``BatchRequest`` (develop:
    ``_trigger_preempt(..., batch_request)``): the plugin's own preemptions go into a ``BatchRequest`` of their
    own, and at the pass's end into the pass's, right before the chunk's task, with any swap / evict metadata
    they carry."""

    fdsched_globals = {RM: ("llm_logger", "BatchRequest")}

    def _trigger_preempt(self, request, num_new_blocks, preempted_reqs, batch_request):
        result = super(PreChangeReserveMixin, self)._trigger_preempt(request, num_new_blocks, preempted_reqs, batch_request)
        self._fdsched_strategy.on_preemption()  # pre-change: at the end of every call, as the old host did
        return result

    def _fdsched_task_list(self):
        return host_global(RM, "BatchRequest")()

    def _fdsched_insert_before(self, batch_request, chunk, tasks) -> None:
        requests = batch_request.requests
        at = next((i for i, task in enumerate(requests) if task is chunk), len(requests))
        requests[at:at] = tasks.requests
        if tasks.cache_swap_metadata:
            batch_request.append_swap_metadata([tasks.cache_swap_metadata])
        if tasks.cache_evict_metadata:
            batch_request.append_evict_metadata([tasks.cache_evict_metadata])


PRE_CHANGE_SHAPES = Shapes(PreChangeReserveMixin, PreChangeReserveBatchMixin)


# ---- the cache manager's side ----------------------------------------------------------------------------
class RatioReserveCacheMixin(PluginBase):
    """The host's block check, seen by the scheduler: a keyed refusal of one check (evicting nothing), and a
    refused threshold check counted for the metrics (signals: :class:`fdsched.patches._base.BlockCheckSignals`)."""

    def can_allocate_gpu_blocks(self, num_blocks, try_free_gpu_blocks=True):
        kinds = self._fdsched_signals_for(num_blocks)
        allowed = REFUSE_RUNNING_CHUNK not in kinds and super().can_allocate_gpu_blocks(num_blocks, try_free_gpu_blocks)
        return self._fdsched_counted(kinds, allowed)

    def _fdsched_signals_for(self, num_blocks) -> frozenset:
        signals = self.__dict__.get("_fdsched_block_checks")
        return signals.take(num_blocks) if signals is not None else frozenset()

    def _fdsched_counted(self, kinds, allowed: bool) -> bool:
        if COUNT_REFUSAL in kinds and not allowed:
            METRICS.admission_blocked(of=self)
        return allowed


class RatioReserveCacheOneArgMixin(RatioReserveCacheMixin):
    """The block check where the host's takes the count only, ``(num_blocks)`` (FastDeploy 2.4 and 2.5)."""

    def can_allocate_gpu_blocks(self, num_blocks):
        kinds = self._fdsched_signals_for(num_blocks)
        allowed = REFUSE_RUNNING_CHUNK not in kinds and super(RatioReserveCacheMixin, self).can_allocate_gpu_blocks(num_blocks)
        return self._fdsched_counted(kinds, allowed)


CACHE_SHAPES = Shapes(RatioReserveCacheMixin, RatioReserveCacheOneArgMixin)


def _has_ratio_reserve(info) -> bool:
    return hasattr(info.rm_class, "_get_running_request_reserve_blocks") and hasattr(
        info.rm_class, "_reset_reserve_on_preemption"
    )


def _uses(func, names) -> str | None:
    from fdsched.patches._base import code_names

    missing = set(names) - code_names(func)
    return f"{func.__qualname__} no longer uses {', '.join(sorted(missing))}" if missing else None


def _running_chunk_check(info):
    names = {"get_new_block_nums", "can_allocate_gpu_blocks"}
    if _has_ratio_reserve(info):
        names.add("_get_can_schedule_prefill_threshold_block")
    else:  # the old host's guard declines the chunk's preemption call and relies on the pass's two lists
        names |= {"_trigger_preempt", "preempted_reqs", "scheduled_reqs"}
    return _uses(info.rm_class.schedule, names)


def _pass_end(info):
    if not _has_ratio_reserve(info):
        return None  # only off on the new host uses it
    return _uses(info.rm_class.schedule, {"waiting", "lock"})


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
        "ResourceManagerV1.finish_requests",
        "PrefixCacheManager.can_allocate_gpu_blocks",
    ),
    why="Fixed 16 blocks per running request ignore how much each request still has to generate.",
    how="Admit a prefill only if free >= chunk + sum(ceil(min(max_tokens - generated, clip) * ratio / block)); "
    "ratio decays per pass, re-estimated on preemption; a refused running chunk blocks admission for the step.",
    hosts_needing="2.6 before PR 7783 (old host e7c8dc2)",
    switch="FDSCHED_RATIO_RESERVE",
    delete_when="every supported host carries 7783 and exposes the re-estimate term and cap as settings",
    mixins={"ResourceManagerV1": ReservationMixin, "PrefixCacheManager": RatioReserveCacheMixin},
    host_has=_has_ratio_reserve,
    relies_on=(
        Reliance("running-chunk-check", "the running pass checks a running chunk's blocks right after "
                 "get_new_block_nums (old host: a failed check calls _trigger_preempt with the pass's lists)",
                 _running_chunk_check),
        Reliance("pass-end", "schedule() holds self.lock for the whole pass, whose waiting pass starts with a "
                 "truth test of self.waiting (nothing before it reads the queue), and returns the pass's task list",
                 _pass_end, when=("off",)),
        Reliance("threshold-check", "every threshold is checked with can_allocate_gpu_blocks next",
                 _threshold_check),
        Reliance("finish-seam", "every finished request goes through finish_requests (finish_requests_async "
                 "submits it), found in self.requests with its running status and taken out of running",
                 _finish_seam, when=("plugin",)),
    ),
    host_has_as_selected=_as_selected,
    variants={
        "host": {"ResourceManagerV1": Variant.by_host(HostReserveMixin, HOST_RESERVE_OLD_HOST)},
        "plugin": {
            "ResourceManagerV1": Variant(_plugin_variant, (
                RatioReserveMixin, AdaptiveReserveMixin, RATIO_OLD_HOST, ADAPTIVE_OLD_HOST,
            )),
            "PrefixCacheManager": CACHE_SHAPES,
        },
        # only on a host that has the change (elsewhere off is the host's own code: impl "host")
        "off": {"ResourceManagerV1": PRE_CHANGE_SHAPES, "PrefixCacheManager": CACHE_SHAPES},
    },
)
