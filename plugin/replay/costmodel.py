"""The replay's step-cost model. Imports nothing from FastDeploy.

The replay runs the real scheduler but no model, so time is modelled. One engine step costs::

    step_ms = fixed_ms + per_prefill_token_ms * (prefill tokens scheduled in the step)
                       + per_decode_request_ms * (decoding requests that produced a token in the step)

A step in which nothing runs (waiting for arrivals) costs ``fixed_ms``. Modelled time starts at 0
at the beginning of step 0; a request arriving at step ``s`` arrives at the modelled time at which
step ``s`` begins, and a token produced in step ``s`` exists when step ``s`` ends. In a time-based
trace (arrivals in seconds) a step may be preceded by a gap: idle time skipped until the next
arrival while nothing runs; a request arrives at its own time.

Defaults come from the profile (``replay.step_fixed_ms``, ``replay.per_prefill_token_ms``,
``replay.per_decode_request_ms``); the command line overrides them. The model is a coarse linear
stand-in for a GPU (a fixed launch/sync overhead, prefill cost linear in tokens, decode cost per
sequence); use it to compare profiles on the same trace, not as a latency prediction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Mapping, Optional, Sequence

__all__ = ["StepCost", "cost_from_settings", "step_times"]


@dataclass(frozen=True)
class StepCost:
    fixed_ms: float = 5.0
    per_prefill_token_ms: float = 0.02
    per_decode_request_ms: float = 0.1

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value or value < 0:
                raise ValueError(f"cost model {name}={value!r}; allowed: a number >= 0")

    def step_ms(self, prefill_tokens: int, decode_requests: int) -> float:
        return self.fixed_ms + self.per_prefill_token_ms * prefill_tokens + self.per_decode_request_ms * decode_requests

    def to_json(self) -> dict:
        return {
            "step_fixed_ms": self.fixed_ms,
            "per_prefill_token_ms": self.per_prefill_token_ms,
            "per_decode_request_ms": self.per_decode_request_ms,
        }


def cost_from_settings(settings: Mapping, overrides: Optional[Mapping] = None) -> StepCost:
    """The profile's ``replay.*`` costs, each replaced by a non-None override (keys as in to_json)."""
    values = {
        "step_fixed_ms": settings["replay.step_fixed_ms"],
        "per_prefill_token_ms": settings["replay.per_prefill_token_ms"],
        "per_decode_request_ms": settings["replay.per_decode_request_ms"],
    }
    for key, value in (overrides or {}).items():
        if key not in values:
            raise KeyError(f"unknown cost key {key!r}; allowed: {', '.join(values)}")
        if value is not None:
            values[key] = value
    return StepCost(values["step_fixed_ms"], values["per_prefill_token_ms"], values["per_decode_request_ms"])


def step_times(
    cost: StepCost, prefill_tokens: Sequence[int], decode_requests: Sequence[int], gaps_ms: Optional[Sequence[float]] = None
) -> tuple:
    """(start_ms, end_ms) lists, one entry per step; ``gaps_ms``: idle time skipped before each step."""
    starts, ends = [], []
    now = 0.0
    gaps = gaps_ms if gaps_ms is not None else [0.0] * len(prefill_tokens)
    for prefill, decode, gap in zip(prefill_tokens, decode_requests, gaps):
        now += gap
        starts.append(now)
        now += cost.step_ms(prefill, decode)
        ends.append(now)
    return starts, ends
