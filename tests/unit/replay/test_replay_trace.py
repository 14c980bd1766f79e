"""Trace format: parsing, validation errors (file, line, field), deterministic prompts. No host."""

from __future__ import annotations

import json

import pytest

from fdsched.replay.trace import (
    ENGINE_DEFAULTS,
    TraceError,
    TraceRequest,
    check_engine,
    dump_trace,
    group_tokens,
    request_tokens,
)
from fdsched.replay.tracefile import load_trace, parse_trace, resolve_trace, shipped_traces


def lines(*objects):
    return [json.dumps(o) for o in objects]


REQ = {"id": "a", "arrival": 0, "prompt_len": 10, "max_tokens": None, "output_len": 5}


def test_parses_header_and_both_prompt_forms():
    trace = parse_trace(
        lines(
            {"header": {"description": "d", "engine": {"block_size": 8, "splitwise_role": "prefill"}, "generator": {"k": 1}}},
            {"id": "x", "arrival": 2, "prompt": [5, 6, 7], "max_tokens": 4, "output_len": 9},
            {"id": "y", "arrival": 1, "prompt_len": 20, "prefix_group": "g", "prefix_len": 12, "max_tokens": None, "output_len": 3},
        ),
        source="t.jsonl",
    )
    assert trace.description == "d"
    assert trace.engine == {"block_size": 8, "splitwise_role": "prefill"}
    assert trace.generator == {"k": 1}
    x, y = trace.requests
    assert (x.id, x.arrival, x.prompt_len, x.prompt_tokens(), x.max_tokens, x.effective_output_len) == ("x", 2, 3, [5, 6, 7], 4, 4)
    assert (y.prefix_group, y.prefix_len, y.line) == ("g", 12, 3)
    assert len(y.prompt_tokens()) == 20
    assert [r.id for r in trace.in_feed_order()] == ["y", "x"]


def test_feed_order_is_stable_by_arrival_then_line():
    trace = parse_trace(lines(dict(REQ, id="b", arrival=3), dict(REQ, id="c", arrival=1), dict(REQ, id="d", arrival=3)))
    assert [r.id for r in trace.in_feed_order()] == ["c", "b", "d"]


def test_group_prefix_is_shared_and_suffix_is_private():
    a = request_tokens("r1", 30, "sys", 16)
    b = request_tokens("r2", 40, "sys", 24)
    assert a[:16] == b[:16] == group_tokens("sys", 16)
    assert b[:24] == group_tokens("sys", 24)  # a shorter group prefix is a prefix of a longer one
    assert a[16:] != b[16:30]
    assert request_tokens("r1", 30, "sys", 16) == a  # deterministic across calls (no hash())
    assert request_tokens("r1", 30, "other", 16)[:16] != a[:16]
    assert all(1 <= t < 50_000 for t in a + b)


def test_effective_output_len_respects_max_tokens():
    assert TraceRequest("a", 0, 4, output_len=10, max_tokens=3).effective_output_len == 3
    assert TraceRequest("a", 0, 4, output_len=10, max_tokens=None).effective_output_len == 10
    assert TraceRequest("a", 0, 4, output_len=2, max_tokens=30).effective_output_len == 2


@pytest.mark.parametrize(
    "bad, line, field_name, words",
    [
        (dict(REQ, arrival=-1), 1, "arrival", "integer in [0, 10000000]"),
        (dict(REQ, arrival=1.5), 1, "arrival", "integer"),
        (dict(REQ, arrival=True), 1, "arrival", "integer"),
        (dict(REQ, output_len=0), 1, "output_len", "in [1, 2147483647]"),
        (dict(REQ, max_tokens=0), 1, "max_tokens", "in [1, 2147483647]"),
        (dict(REQ, id=""), 1, "id", "non-empty"),
        (dict(REQ, colour="red"), 1, "colour", "unknown field"),
        ({k: v for k, v in REQ.items() if k != "output_len"}, 1, "output_len", "missing"),
        ({k: v for k, v in REQ.items() if k != "max_tokens"}, 1, "max_tokens", "missing"),
        ({k: v for k, v in REQ.items() if k != "prompt_len"}, 1, "prompt", "exactly one"),
        (dict(REQ, prompt=[1, 2]), 1, "prompt", "exactly one"),
        (dict({k: v for k, v in REQ.items() if k != "prompt_len"}, prompt=[1, -2]), 1, "prompt", "index 1"),
        (dict({k: v for k, v in REQ.items() if k != "prompt_len"}, prompt=[]), 1, "prompt", "non-empty"),
        (dict({k: v for k, v in REQ.items() if k != "prompt_len"}, prompt=[1], prefix_group="g"), 1, "prefix_group", "only allowed"),
        (dict(REQ, prefix_group="g"), 1, "prefix_len", "go together"),
        (dict(REQ, prefix_len=3), 1, "prefix_group", "go together"),
        (dict(REQ, prefix_group="g", prefix_len=11), 1, "prefix_len", "[0, 10]"),
    ],
)
def test_request_errors_name_line_and_field(bad, line, field_name, words):
    with pytest.raises(TraceError) as info:
        parse_trace(lines(bad), source="f.jsonl")
    message = str(info.value)
    assert f"f.jsonl line {line}" in message
    assert f"field {field_name!r}" in message
    assert words in message


def test_line_numbers_count_blank_lines_and_header():
    text = [json.dumps({"header": {}}), "", json.dumps(REQ), json.dumps(dict(REQ, id="b", arrival="x"))]
    with pytest.raises(TraceError, match=r"t line 4, field 'arrival'"):
        parse_trace(text, source="t")


def test_duplicate_id_names_first_line():
    with pytest.raises(TraceError, match=r"line 2, field 'id': duplicate id 'a' \(first on line 1\)"):
        parse_trace(lines(REQ, REQ))


@pytest.mark.parametrize(
    "header, field_name",
    [
        ({"colour": 1}, "header.colour"),
        ({"engine": {"gpus": 1}}, "header.engine.gpus"),
        ({"engine": {"splitwise_role": "decode"}}, "header.engine.splitwise_role"),
        ({"engine": {"block_size": 0}}, "header.engine.block_size"),
        ({"engine": {"enable_prefix_caching": 1}}, "header.engine.enable_prefix_caching"),
        ({"engine": []}, "header.engine"),
        ({"description": 3}, "header.description"),
    ],
)
def test_header_errors(header, field_name):
    with pytest.raises(TraceError) as info:
        parse_trace(lines({"header": header}, REQ))
    assert f"field {field_name!r}" in str(info.value)


def test_header_only_first_and_alone():
    with pytest.raises(TraceError, match="only allowed on the first line"):
        parse_trace(lines(REQ, {"header": {}}))
    with pytest.raises(TraceError, match="holds only the 'header'"):
        parse_trace(lines({"header": {}, "id": "x"}, REQ))


def test_not_json_and_not_object_and_empty():
    with pytest.raises(TraceError, match=r"line 2: not valid JSON"):
        parse_trace([json.dumps(REQ), "{nope"])
    with pytest.raises(TraceError, match="must be a JSON object"):
        parse_trace(["[1, 2]"])
    with pytest.raises(TraceError, match="no requests"):
        parse_trace([json.dumps({"header": {}})])


def test_engine_precedence_defaults_header_overrides():
    trace = parse_trace(lines({"header": {"engine": {"block_size": 8, "max_num_seqs": 4}}}, REQ))
    engine = trace.engine_with({"max_num_seqs": 2, "num_gpu_blocks": None})
    assert engine["block_size"] == 8
    assert engine["max_num_seqs"] == 2
    assert engine["num_gpu_blocks"] == ENGINE_DEFAULTS["num_gpu_blocks"]


def test_check_engine_rejects_requests_that_cannot_fit():
    trace = parse_trace(lines(REQ, dict(REQ, id="big", prompt_len=50, output_len=20)), source="s")
    engine = dict(ENGINE_DEFAULTS, block_size=4, max_model_len=64, num_gpu_blocks=18)
    with pytest.raises(TraceError, match=r"s line 2, field 'output_len': prompt \(50\) \+ output \(20\) = 70 exceeds"):
        check_engine(trace, engine)
    ok = parse_trace(lines(REQ, dict(REQ, id="fits", prompt_len=50, max_tokens=14, output_len=20)))
    check_engine(ok, engine)  # max_tokens caps the output at 14: 64 fits
    with pytest.raises(TraceError, match="at least max_model_len / block_size \\+ 2 = 18"):
        check_engine(ok, dict(engine, num_gpu_blocks=17))
    with pytest.raises(TraceError, match="max_num_batched_tokens"):
        check_engine(ok, dict(engine, max_num_batched_tokens=2))
    with pytest.raises(TraceError, match="field 'prompt_len'"):
        check_engine(parse_trace(lines(dict(REQ, prompt_len=64))), engine)


def test_dump_parse_round_trip(tmp_path):
    requests = [
        TraceRequest("a", 0, 3, 4, None, prompt=(1, 2, 3)),
        TraceRequest("b", 5, 20, 2, 7, prefix_group="g", prefix_len=8),
    ]
    text = dump_trace(requests, engine={"block_size": 4}, description="round trip")
    path = tmp_path / "rt.jsonl"
    path.write_text(text)
    trace = load_trace(path)
    assert trace.name == "rt"
    assert trace.engine == {"block_size": 4}
    assert [r.to_json() for r in trace.requests] == [r.to_json() for r in requests]
    assert dump_trace(trace.requests, engine=trace.engine, description=trace.description) == text


def test_shipped_traces_resolve_and_parse():
    shipped = shipped_traces()
    assert {"pressure", "shared-prefix", "pd-prefill"} <= set(shipped)
    for name in ("pressure", "shared-prefix", "pd-prefill"):
        trace = load_trace(resolve_trace(name))
        check_engine(trace, trace.engine_with())
        assert trace.name == name and trace.description
    assert load_trace(resolve_trace("pd-prefill")).engine["splitwise_role"] == "prefill"


def test_resolve_errors(tmp_path):
    with pytest.raises(TraceError, match="unknown; allowed: a shipped trace .*pressure"):
        resolve_trace("no-such-trace")
    with pytest.raises(TraceError, match="no such file"):
        resolve_trace(str(tmp_path / "missing.jsonl"))
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps(REQ) + "\n")
    assert resolve_trace(str(path)) == path


def test_time_based_requests_parse_order_and_round_trip(tmp_path):
    lines = [
        '{"id": "b", "arrival_s": 2.5, "prompt_len": 4, "max_tokens": null, "output_len": 2}',
        '{"id": "a", "arrival_s": 0.25, "prompt_len": 4, "max_tokens": 8, "output_len": 2}',
    ]
    trace = parse_trace(lines)
    assert trace.time_based
    assert [r.id for r in trace.in_feed_order()] == ["a", "b"]
    path = tmp_path / "t.jsonl"
    path.write_text(dump_trace(trace.requests), encoding="utf-8")
    assert [(r.id, r.arrival_s) for r in load_trace(path).requests] == [("b", 2.5), ("a", 0.25)]
    assert not parse_trace(['{"id": "s", "arrival": 3, "prompt_len": 4, "max_tokens": null, "output_len": 2}']).time_based


@pytest.mark.parametrize(
    "second, field_name, words",
    [
        ('{"id": "b", "arrival": 1, "prompt_len": 4, "max_tokens": null, "output_len": 2}', "arrival", "mixes step and time"),
        ('{"id": "b", "arrival_s": -1, "prompt_len": 4, "max_tokens": null, "output_len": 2}', "arrival_s", "seconds in [0, 31536000]"),
        ('{"id": "b", "arrival_s": "soon", "prompt_len": 4, "max_tokens": null, "output_len": 2}', "arrival_s", "seconds"),
        ('{"id": "b", "arrival_s": 1, "arrival": 1, "prompt_len": 4, "max_tokens": null, "output_len": 2}', "arrival",
         "exactly one"),
        ('{"id": "b", "prompt_len": 4, "max_tokens": null, "output_len": 2}', "arrival", "exactly one"),
    ],
)
def test_time_based_errors_name_line_and_field(second, field_name, words):
    first = '{"id": "a", "arrival_s": 0, "prompt_len": 4, "max_tokens": null, "output_len": 2}'
    with pytest.raises(TraceError) as info:
        parse_trace([first, second], source="t.jsonl")
    assert f"line 2, field {field_name!r}" in str(info.value) and words in str(info.value)


def test_split_across_ranks_is_uniform_seeded_and_keeps_every_request():
    import collections
    import random

    from fdsched.replay.trace import Trace, split_across_ranks

    requests = tuple(
        TraceRequest(id=f"r{i}", arrival=i, prompt_len=8, output_len=4) for i in range(400)
    )
    trace = Trace(requests=requests, name="t")
    shares = split_across_ranks(trace, [1, 0], seed=7)
    assert sorted(shares) == [0, 1] and shares[1].name == "t@dp1"
    assert sorted(r.id for s in shares.values() for r in s.requests) == sorted(r.id for r in requests)
    rng = random.Random(7)  # one draw per request, in trace order, over the sorted ranks
    assert [r.id for r in shares[0].requests] == [r.id for r in requests if rng.randrange(2) == 0]
    assert 150 < len(shares[0].requests) < 250  # uniform
    assert split_across_ranks(trace, [0, 1], seed=7) == shares  # deterministic
    assert collections.Counter(len(s.requests) for s in split_across_ranks(trace, [0, 1, 2]).values())
    with pytest.raises(TraceError):
        split_across_ranks(trace, [])
