"""What a trace error tells the operator: which trace (a shipped one by its name, not by where it is installed),
what a trace should have been, and the context length that fits it."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["TRACE_FORMAT", "shown_source", "fitting_max_model_len"]

TRACE_FORMAT = ("a JSONL trace: one JSON object per line, an optional header first (the format: examples/replay.md, "
                "\"Trace format (JSONL)\"; fdsched trace validate checks a file)")


def shown_source(source) -> str:
    """A shipped trace by its name (its installed path means nothing to the operator); any other file as given."""
    text = str(source)
    path = Path(text)
    if path.suffix == ".jsonl" and path.parent == Path(str(resources.files("fdsched.replay") / "traces")):
        return path.stem
    return text


def fitting_max_model_len(requests) -> int:
    """The smallest context length every request fits: its prompt and the output it runs to, and one token more
    than the prompt (an engine refuses a prompt as long as its context)."""
    return max(max(r.prompt_len + 1, r.prompt_len + r.effective_output_len) for r in requests)
