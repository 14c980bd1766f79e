"""Change 3, what the plugin's reservation reads of the running requests (impls ``plugin`` and ``off``): each
request's budget, client bound and most possible reservation, kept from the first time they are read, and the
pool's free blocks where the host's block check reads its free list. The catalogue entry is
:mod:`fdsched.patches.ratio_reserve`.
"""

from __future__ import annotations

import functools
import math
import weakref
from operator import attrgetter, itemgetter

from fdsched.core.terms import numpy_or_none


def free_blocks_of(cache_manager):
    """A function that gives ``cache_manager``'s free GPU blocks now, where the host's block check
    (``can_allocate_gpu_blocks``, the first definition in its class that is not the plugin's) answers True, taking
    nothing, whenever its free list covers the count (:func:`answers_true_when_covered`; every FastDeploy 2.x's
    does); else None: the budget then counts every ask."""
    for cls in type(cache_manager).__mro__:
        check = cls.__dict__.get("can_allocate_gpu_blocks")
        if check is None or cls.__module__.startswith("fdsched."):
            continue
        if answers_true_when_covered(check) and isinstance(getattr(cache_manager, "gpu_free_block_list", None), list):
            return functools.partial(_free_list_length, cache_manager)
        return None
    return None


class _FreeListOnly:
    """A stand-in for a cache manager that has a free list and nothing else: reading or setting any other attribute
    raises."""

    __slots__ = ("gpu_free_block_list",)

    def __init__(self, free: int) -> None:
        self.gpu_free_block_list = list(range(free))


# (free blocks, blocks asked) pairs where the free list covers the count
_COVERED = ((1, 1), (4, 3), (8, 8), (2, 0))


def answers_true_when_covered(check) -> bool:
    """Whether the block check ``check(self, num_blocks, ...)`` answers True whenever ``self.gpu_free_block_list``
    covers the count, reading nothing else of ``self`` and changing nothing: probed by calling it on a stand-in
    cache manager that has only a free list (:class:`_FreeListOnly`), so that a check that keeps a watermark, or
    does anything before it answers, is not taken for one. Never raises."""
    for free, asked in _COVERED:
        stand_in = _FreeListOnly(free)
        try:
            answer = check(stand_in, asked)
        except Exception:  # noqa: BLE001 - anything but the answer is "not this shape"
            return False
        if answer is not True or stand_in.gpu_free_block_list != list(range(free)):
            return False
    return True


def _free_list_length(cache_manager) -> int:
    return len(cache_manager.gpu_free_block_list)


class _RunningReader:
    """What a strategy reads of a scheduler's running requests (:class:`fdsched.core.views.RunningReader`),
    read afresh from each request every time."""

    __slots__ = ("scheduler", "_views", "most")

    def __init__(self, scheduler, views, most) -> None:
        self.scheduler = scheduler
        self._views = views  # the scheduler's views of requests (fdsched.patches.ratio_reserve.budget.running_views)
        self.most = most  # a request's most possible reservation, from its output budget

    def views(self, requests, kept=None) -> list:
        return self._views(requests, kept=kept)

    def terms(self, request) -> tuple:
        """``(budget, client bound)`` of ``request``: its output budget
        (:func:`fdsched.core.admission.max_new_tokens_of`) and its view's client bound
        (:func:`fdsched.core.adaptive.client_bound`), computed inline (this runs for every running request)."""
        max_tokens = getattr(request.sampling_params, "max_tokens", None)
        room = self.scheduler.config.model_config.max_model_len - request.prompt_token_ids_len
        if max_tokens is None:
            return room, None
        budget = int(max_tokens)
        return budget, (None if max_tokens < 1 or max_tokens >= room else budget)

    def lefts(self, requests) -> list:
        """Each request's budget left: its budget minus its output so far. The first ask of every pass reads every
        running request, so this is the loop to keep short."""
        terms = self.terms
        return [terms(r)[0] - len(r.output_token_ids) for r in requests]

    def keys(self, requests) -> list:
        """Each request as ``(max_tokens, budget, generated)``: its view's client bound, budget and output so far,
        without the view."""
        keys = []
        append, terms = keys.append, self.terms
        for r in requests:
            budget, bound = terms(r)
            append((bound, budget, len(r.output_token_ids)))
        return keys

    def entry(self, request) -> tuple:
        """``(budget, client bound, client bound as a float)`` of ``request`` (no bound: None, and NaN)."""
        budget, bound = self.terms(request)
        return budget, bound, math.nan if bound is None else float(bound)

    def mosts(self, requests) -> int:
        most, terms = self.most, self.terms
        return sum(most(terms(r)[0]) for r in requests)

    def columns(self, requests) -> tuple:
        """The requests' keys as three arrays (:func:`fdsched.core.terms.columns_of_keys`): the client's bound
        (NaN for none), the budget and the output so far, without a tuple per request."""
        entries = list(map(self.entry, requests))
        return (*_bound_and_budget(numpy_or_none(), entries), _outputs(requests))


class _Gone(weakref.ref):
    """A weak reference to a kept request whose callback drops the request's entry (``key``) when it goes."""

    __slots__ = ("key",)


class _KeptTermsReader(_RunningReader):
    """A :class:`_RunningReader` that keeps each request's terms from the first time it reads them.

    A request's budget and client bound are set before it reaches the scheduler (its prompt length and
    ``max_tokens``) and stay as they are while it runs; only its output grows. So they are read once and kept by
    the request object's identity (``id``), and a count reads only each request's output.

    An entry lives exactly as long as its request: it is kept with a weak reference whose callback drops it when the
    request goes (before its memory can be used again, so no other object is ever found under its address), and
    nothing here keeps a request alive. With no check of its own per request, a count costs about a quarter less than
    one that asks each entry's weak reference whether it is still that request.
    """

    __slots__ = ("_terms", "_mosts", "_refs", "_gone", "_last")

    def __init__(self, scheduler, views, most) -> None:
        super().__init__(scheduler, views, most)
        terms: dict = {}  # id(request) -> (budget, client bound, the bound as a float), while the request lives
        mosts: dict = {}  # id(request) -> its most possible reservation (apart: a bound reads nothing else)
        refs: dict = {}  # id(request) -> its _Gone reference (which must live as long as the entry)

        def gone(ref) -> None:  # the request went: drop its entry (runs on whichever thread let it go)
            if refs.get(ref.key) is ref:
                del refs[ref.key]
                terms.pop(ref.key, None)
                mosts.pop(ref.key, None)

        self._terms, self._mosts, self._refs, self._gone = terms, mosts, refs, gone
        self._last = ((), None, None)  # the last columns call's entries, and its bound and budget arrays

    def _keep(self, request) -> tuple:
        """Read ``request``'s entry (:meth:`_RunningReader.entry`) and keep it as long as the request lives (called
        where the table has none for it)."""
        key = id(request)
        ref = _Gone(request, self._gone)
        ref.key = key
        entry = self.entry(request)
        self._refs[key] = ref
        self._mosts[key] = self.most(entry[0])
        self._terms[key] = entry
        return entry

    def lefts(self, requests) -> list:
        # an entry is a non-empty tuple: a request without one is kept on the spot
        get, keep = self._terms.get, self._keep
        return [(get(id(r)) or keep(r))[0] - len(r.output_token_ids) for r in requests]

    def mosts(self, requests) -> int:
        return sum(self._read(self._mosts, requests))

    def _read(self, table: dict, requests) -> list:
        """Each request's value in ``table`` (one of the kept tables); the requests not kept yet (admitted after their
        pass's last ask) are kept now. A whole running list is read in C (map, and ``index`` for the ones not kept);
        the one or few a pass's later asks add, in a loop."""
        if len(requests) <= _FEW:
            get, values = table.get, []
            for request in requests:
                value = get(id(request))
                if value is None:
                    self._keep(request)
                    value = table[id(request)]
                values.append(value)
            return values
        values = list(map(table.get, map(id, requests)))
        place = -1
        for _ in range(values.count(None)):
            place = values.index(None, place + 1)
            self._keep(requests[place])
            values[place] = table[id(requests[place])]
        return values

    def keys(self, requests) -> list:
        get, keep = self._terms.get, self._keep
        keys = []
        append = keys.append
        for r in requests:
            budget, bound, _ = get(id(r)) or keep(r)
            append((bound, budget, len(r.output_token_ids)))
        return keys

    def columns(self, requests) -> tuple:
        entries = self._read(self._terms, requests)
        # A running list mostly keeps its order from one pass to the next and grows at its end: where the last
        # call's entries begin this one's, its bound and budget arrays are this one's too, and only the entries
        # after them are read (entries are compared, not requests: equal entries give equal arrays).
        np, n = numpy_or_none(), len(entries)
        last, bound, budget = self._last
        m = len(last)
        if not m or m > n or (entries[:m] != last if m < n else entries != last):
            bound, budget = _bound_and_budget(np, entries)
        elif m < n:
            more_bound, more_budget = _bound_and_budget(np, entries[m:])
            bound, budget = np.concatenate((bound, more_bound)), np.concatenate((budget, more_budget))
        self._last = (entries, bound, budget)
        return bound, budget, _outputs(requests)


_BUDGET, _BOUND_FLOAT, _OUTPUT = itemgetter(0), itemgetter(2), attrgetter("output_token_ids")
_FEW = 8  # up to this many a loop reads the kept table faster than _read (1 request 0.4 us, not 1.4; 8: 1.6, not 2.8)


def _bound_and_budget(np, entries: list) -> tuple:
    """The (bound, budget) arrays of the requests' entries."""
    n = len(entries)
    return np.fromiter(map(_BOUND_FLOAT, entries), np.float64, n), np.fromiter(map(_BUDGET, entries), np.int64, n)


def _outputs(requests):
    """Each request's output so far (its length), as an array: read afresh at every call."""
    np = numpy_or_none()
    return np.fromiter(map(len, map(_OUTPUT, requests)), np.int64, len(requests))


def reader_for(scheduler, request_class, views, most) -> _RunningReader:
    """The reader for a scheduler whose running requests are ``request_class`` objects: one that keeps their terms
    where the class allows a weak reference to its objects (every FastDeploy 2.x does), else one that reads
    afresh. ``views(requests, kept=None)``: the scheduler's views of requests; ``most(budget)``: a request's most
    possible reservation."""
    kind = _KeptTermsReader if getattr(request_class, "__weakrefoffset__", 0) else _RunningReader
    return kind(scheduler, views, most)
