"""The length mark: how a served request tells the simulated worker where its answer ends.

A real model ends an answer with its end-of-sequence token; the simulated worker has no model, so the load
generator writes each request's true output length into the tail of its prompt and the worker reads it back
from the prompt token ids the engine hands it. The client then sends ``max_tokens`` exactly as the trace's
client did (unset included), the engine fills in its own default, and the scheduler reserves with that.

The mark is the prompt's last ``k + 1`` tokens: one marker word saying how many digits follow
(``fdsched_len1`` .. ``fdsched_len3``), then the length in base 900 as ``k`` ordinary words ``w0`` ..
``w899``, most significant first. The marker words are words of the served engine's tiny model
(:mod:`fdsched.serve.model`) that no trace prompt produces, so an unmarked prompt never reads as marked, and a
digit can never be mistaken for a marker. The mark overwrites the last tokens of the prompt, so the prompt keeps
its exact length; a prompt shorter than the mark needs cannot carry it (:func:`mark_words` answers None).

Text side (the load generator): :func:`mark_words`. Token side (the worker): :func:`read_mark`. Both import
nothing from FastDeploy.
"""

from __future__ import annotations

from typing import Optional, Sequence

from fdsched.serve.model import MARKER_WORDS, NUM_WORDS, SPECIALS

__all__ = ["BASE", "MAX_DIGITS", "MAX_LENGTH", "MARKER_IDS", "mark_size", "mark_words", "read_mark"]

BASE = NUM_WORDS  # one digit per ordinary word w0 .. w899
MAX_DIGITS = len(MARKER_WORDS)
MAX_LENGTH = BASE ** MAX_DIGITS - 1
_FIRST_WORD_ID = len(SPECIALS)  # token id of w0
MARKER_IDS = tuple(_FIRST_WORD_ID + NUM_WORDS + i for i in range(MAX_DIGITS))  # fdsched_len1 .. fdsched_len3


def _digits(length: int) -> list:
    out = []
    while True:
        length, digit = divmod(length, BASE)
        out.append(digit)
        if not length:
            return out[::-1]


def mark_size(length: int) -> int:
    """Tokens the mark of ``length`` takes (marker word + digits)."""
    if not isinstance(length, int) or isinstance(length, bool) or not 1 <= length <= MAX_LENGTH:
        raise ValueError(f"an output length of 1 .. {MAX_LENGTH} tokens")
    return 1 + len(_digits(length))


def mark_words(words: Sequence[str], length: int) -> Optional[list]:
    """``words`` with its tail replaced by the mark of ``length`` (same number of words), or None when the prompt
    is shorter than the mark. ``ValueError("<what is allowed>")`` for a length outside 1 .. MAX_LENGTH."""
    size = mark_size(length)
    if len(words) < size:
        return None
    digits = _digits(length)
    return list(words[: len(words) - size]) + [MARKER_WORDS[len(digits) - 1]] + [f"w{d}" for d in digits]


def read_mark(token_ids: Sequence[int]) -> Optional[int]:
    """The output length the prompt's tail carries, or None when it carries no mark."""
    ids = list(token_ids[-(MAX_DIGITS + 1):]) if len(token_ids) else []
    for k in range(1, MAX_DIGITS + 1):
        if len(ids) < k + 1 or int(ids[-k - 1]) != MARKER_IDS[k - 1]:
            continue
        digits = [int(t) - _FIRST_WORD_ID for t in ids[-k:]]
        if not all(0 <= d < BASE for d in digits):
            return None
        length = 0
        for d in digits:
            length = length * BASE + d
        return length or None
    return None
