"""What a reservation strategy is given and reports to, in plain values: one running request as a strategy sees
it (:class:`RunningView`), what the scheduler reads of its running requests for it (:class:`RunningReader`,
implemented over the host's requests in ``fdsched.patches.ratio_reserve.reader``) and where it reports its
decisions (:class:`Gauges`, the scheduler's metrics by arm; none in the replay and the tests)."""

from __future__ import annotations

from typing import NamedTuple, Optional, Protocol, Sequence

__all__ = ["RunningView", "RunningReader", "Gauges"]


class RunningView(NamedTuple):
    """What a strategy knows about one running request.

    A named tuple rather than a frozen dataclass: the scheduler builds one per running request at every
    admission decision, and a frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field) costs
    several times a tuple's construction; it is as immutable and reads the same."""

    request_id: str
    budget: int  # its output budget: max_tokens, else what the context leaves
    generated: int  # output tokens so far
    max_tokens: Optional[int]  # the client's bound (fdsched.core.adaptive.client_bound), None when it says nothing
    decoding: bool


class Gauges(Protocol):
    """Where a strategy reports what it decided (the scheduler's metrics, labelled by its arm); a strategy given
    none reports nothing (the replay, the tests)."""

    def ratio(self, value: float) -> None: ...

    def adaptive_decision(self, expected_tokens: float, margin_tokens: float, k: float, fallbacks: int) -> None: ...


class RunningReader(Protocol):
    """What the scheduler reads of its running requests for a strategy (``requests``: the host's own objects)."""

    def views(self, requests: Sequence, kept: Optional[dict] = None) -> list:
        """One :class:`RunningView` per request (``kept``: a pass's views by request id, reused while a request's
        output has not grown)."""

    def lefts(self, requests: Sequence) -> list:
        """Each request's budget left: its output budget minus what it generated."""

    def mosts(self, requests: Sequence) -> int:
        """The most the requests can ever reserve together: each one's
        :meth:`fdsched.core.admission.RatioStrategy.most_blocks`, which depends only on its output budget."""

    def keys(self, requests: Sequence) -> list:
        """Each request as ``(max_tokens, budget, generated)``, as its :class:`RunningView` has them."""

    def columns(self, requests: Sequence) -> tuple:
        """Optional: the same as three arrays (:func:`fdsched.core.terms.columns_of_keys`), for many requests at
        once."""
