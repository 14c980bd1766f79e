"""The length mark: the load generator writes a request's true output length into its prompt's tail, the simulated
worker reads it from the prompt token ids. Encoding, decoding, the tiny model's tokenizer, the worker's end of an
answer, and what `fdsched serve` sends. No host."""

from __future__ import annotations

import json

import pytest

from fdsched.replay.tracefile import load_trace, parse_trace, resolve_trace
from fdsched.serve.lengthmark import BASE, MARKER_IDS, MAX_LENGTH, mark_size, mark_words, read_mark
from fdsched.serve.load import _prompts, prompt_text, request_prompt
from fdsched.serve.model import MARKER_WORDS, NUM_WORDS, SPECIALS
from fdsched.serve.worker import answer_length

VOCAB = {w: i for i, w in enumerate(SPECIALS + [f"w{i}" for i in range(NUM_WORDS)] + list(MARKER_WORDS))}


def _ids(words):
    """The tiny model's word-level token ids (an unknown word is <unk>, id 0)."""
    return [VOCAB.get(w, 0) for w in words]


def _trace(lines):
    return parse_trace([json.dumps(dict({"max_tokens": None}, **x)) for x in lines], source="t.jsonl", name="t")


@pytest.mark.parametrize("length, size", [(1, 2), (17, 2), (BASE - 1, 2), (BASE, 3), (BASE + 1, 3), (2019, 3),
                                          (BASE * BASE - 1, 3), (BASE * BASE, 4), (MAX_LENGTH, 4)])
def test_a_length_survives_the_round_trip_through_token_ids(length, size):
    words = [f"w{i}" for i in range(10)]
    marked = mark_words(words, length)
    assert mark_size(length) == size
    assert len(marked) == len(words)  # the prompt keeps its length
    assert marked[: len(words) - size] == words[: len(words) - size]  # only the tail is overwritten
    assert marked[-size] == MARKER_WORDS[size - 2]
    assert read_mark(_ids(marked)) == length


def test_the_digits_are_base_900_most_significant_first():
    assert mark_words(["w1"] * 4, 2019) == ["w1", "fdsched_len2", "w2", "w219"]  # 2 * 900 + 219
    assert read_mark([7, MARKER_IDS[1], 5 + 2, 5 + 219]) == 2019


def test_a_prompt_shorter_than_its_mark_is_left_unmarked():
    assert mark_words(["w3"], 5) is None
    assert mark_words(["w3", "w4"], 5) == ["fdsched_len1", "w5"]
    assert mark_words(["w3", "w4"], BASE) is None  # needs three words


@pytest.mark.parametrize("bad", [0, -3, MAX_LENGTH + 1, True, 2.5])
def test_a_length_the_mark_cannot_carry_is_refused_naming_what_is_allowed(bad):
    with pytest.raises(ValueError, match=f"an output length of 1 .. {MAX_LENGTH} tokens"):
        mark_words(["w1"] * 8, bad)


@pytest.mark.parametrize("name", ["azure-conv", "shared-prefix", "burstgpt"])
def test_a_trace_prompt_without_the_mark_never_reads_as_marked(name):
    trace = load_trace(resolve_trace(name))
    for r in trace.requests[:80]:
        assert read_mark(_ids(prompt_text(r.prompt_tokens()).split())) is None


def test_tails_that_only_look_like_a_mark_read_as_none():
    assert read_mark([]) is None
    assert read_mark([MARKER_IDS[0]]) is None  # a marker with no digit after it
    assert read_mark([9, MARKER_IDS[0], MARKER_IDS[0]]) is None  # a marker where a digit belongs
    assert read_mark([MARKER_IDS[1], 9]) is None  # says two digits, has one
    assert read_mark([9, MARKER_IDS[0], 0]) is None  # <unk> is no digit
    assert read_mark([9, MARKER_IDS[0], 5]) is None  # length 0 is no answer
    assert read_mark([MARKER_IDS[0], 9, 10]) is None  # the marker must sit right before the digits


def test_the_tiny_models_own_tokenizer_gives_the_ids_the_worker_reads(tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    from fdsched.serve.model import make_model

    directory = make_model(str(tmp_path / "model"))
    tok = Tokenizer.from_file(str(tmp_path / "model" / "tokenizer.json"))
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["vocab_size"] == len(VOCAB) and directory
    for length in (3, 899, 900, 4095):
        text = " ".join(mark_words([f"w{i}" for i in range(12)], length))
        ids = tok.encode(text).ids
        assert len(ids) == 12 and ids == _ids(text.split())
        assert read_mark(ids) == length


class _Task(dict):
    """What the worker reads of an engine task: ``get("max_tokens")``, ``prompt_token_ids``, ``request_id``."""

    def __init__(self, prompt_ids, max_tokens):
        super().__init__(max_tokens=max_tokens)
        self.prompt_token_ids, self.request_id = prompt_ids, "q1"


def test_the_worker_ends_at_the_mark_cut_at_the_engines_max_tokens():
    marked = _ids(mark_words([f"w{i}" for i in range(20)], 57))
    lines = []
    assert answer_length(_Task(marked, 4096 - 20), lines.append) == 57  # the engine's default: the mark decides
    assert "max_tokens 4076 (as the engine holds it), length mark 57, ends after 57 tokens" in lines[0]
    assert answer_length(_Task(marked, 30)) == 30  # a client bound below the true length ends it first
    assert answer_length(_Task(marked, None)) == 57
    assert answer_length(_Task(_ids([f"w{i}" for i in range(20)]), 12)) == 12  # unmarked: max_tokens
    assert answer_length(_Task(_ids([f"w{i}" for i in range(20)]), None)) == 16
    assert answer_length(_Task(None, 9)) == 9


def test_the_load_generator_marks_each_prompt_and_keeps_its_length_and_sharing():
    trace = load_trace(resolve_trace("shared-prefix"))
    for r in trace.requests[:40]:
        text, mark = request_prompt(r)
        words = text.split()
        assert len(words) == r.prompt_len and mark == r.effective_output_len
        assert read_mark(_ids(words)) == r.effective_output_len
        assert words[: r.prefix_len] == prompt_text(r.prompt_tokens()).split()[: r.prefix_len]
    text, mark = request_prompt(trace.requests[0], length_mark=False)
    assert mark is None and text == prompt_text(trace.requests[0].prompt_tokens())


def test_a_request_too_short_for_its_mark_is_bounded_instead_of_running_to_the_end_of_the_context():
    trace = _trace([{"id": "short", "arrival": 0, "prompt_len": 2, "output_len": 950},
                    {"id": "ok", "arrival": 0, "prompt_len": 2, "output_len": 40},
                    {"id": "set", "arrival": 0, "prompt_len": 1, "max_tokens": 7, "output_len": 9}])
    sent, prompts, bounded = _prompts(trace, True)
    by_id = {r.id: r for r in sent.requests}
    assert bounded == ["short"]
    assert by_id["short"].max_tokens == 950 and prompts["short"][1] is None
    assert by_id["ok"].max_tokens is None and prompts["ok"][1] == 40  # sent as the trace has it
    assert by_id["set"].max_tokens == 7 and prompts["set"][1] is None  # the client's own bound ends it
    unmarked, _p, none = _prompts(trace, False)
    assert none == [] and [r.max_tokens for r in unmarked.requests] == [None, None, 7]


def _serve_args(*argv):
    from fdsched.tools.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_serve_sends_the_trace_as_its_clients_did_unless_asked_for_exact_max_tokens(capsys):
    from fdsched.serve.cli import _sendable, check_serve_args

    args = _serve_args("--arms", "baseline,recommended", "--trace", "azure-conv")
    problems, trace, _configs = check_serve_args(args)
    assert problems == []
    sent = _sendable(trace, args)
    assert all(r.max_tokens is None for r in sent.requests) and len(sent.requests) == 191
    assert "191 of 191 requests of trace azure-conv are sent without max_tokens" in capsys.readouterr().err
    exact = _sendable(trace, _serve_args("--trace", "azure-conv", "--exact-max-tokens"))
    assert [r.max_tokens for r in exact.requests] == [r.effective_output_len for r in trace.requests]
    problems, _t, _c = check_serve_args(_serve_args("--exact-max-tokens"))
    assert "--exact-max-tokens: allowed only with --trace (it changes what the trace's clients send)" in problems


def test_the_served_report_says_how_many_requests_went_without_max_tokens():
    from fdsched.serve.load import RequestResult, Target
    from fdsched.serve.served_report import build_served_report, format_served_table, merge_loads

    trace = _trace([{"id": "a", "arrival": 0, "prompt_len": 8, "output_len": 3},
                    {"id": "b", "arrival": 0, "prompt_len": 8, "max_tokens": 2, "output_len": 3}])
    targets = [Target("x", "http://127.0.0.1:1"), Target("y", "http://127.0.0.1:2")]

    def load(arm):
        return {"results": [RequestResult(r.id, arm, 8, r.max_tokens, 0.0, sent_s=0.0, token_s=[0.1, 0.2], status=200,
                                           finish_reason="stop") for r in trace.requests],
                "servers": {arm: {}}, "wall_seconds": 1.0, "assignment_seed": None, "time_scale": 1.0, "step_ms": None}

    report = build_served_report(trace, merge_loads([load("x"), load("y")]), targets)
    assert report["load"]["sent_without_max_tokens"] == 1  # request a, counted once over the two arms
    assert "2 requests, time scale 1.0, 1 sent without max_tokens;" in format_served_table(report)
