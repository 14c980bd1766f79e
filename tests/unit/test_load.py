"""`fdsched load` without FastDeploy: prompts, per-request figures, arm attribution, the served report, bad
input, and a whole run against a small in-process OpenAI-style streaming server (aiohttp). No host."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest

from fdsched.tools.cli import main
from fdsched.replay.trace import split_across_ranks
from fdsched.replay.tracefile import load_trace, parse_trace, resolve_trace
from fdsched.serve.load import (
    WORDS, LoadError, RequestResult, Target, _stamp, assign_targets, check_servable, prompt_text, request_metrics,
    request_prompt, run_trace_load, send_times, server_info,
)
from fdsched.serve.served_report import build_served_report, client_figures, format_served_table, server_figures

aiohttp = pytest.importorskip("aiohttp")  # the test extra installs it
from aiohttp import web  # noqa: E402

USER_KEYS = ("e2e_ms_p50", "e2e_ms_p90", "e2e_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "stall_ms_p99", "stall_ms_max",
             "recomputed_tokens")


def _trace(lines, header=None):
    rows = ([json.dumps({"header": header})] if header else []) + [json.dumps(dict({"max_tokens": None}, **x)) for x in lines]
    return parse_trace(rows, source="t.jsonl", name="t")


# ------------------------------------------------------------------------------------------------ prompts
def _word_level_count(text):
    """What the served engine's tiny model does: whitespace pre-tokenizer, one token per known word."""
    vocab = {f"w{i}" for i in range(WORDS)}
    words = text.split()
    assert all(w in vocab for w in words), "a word outside the tiny model's vocabulary would become <unk> or split"
    return len(words)


@pytest.mark.parametrize("name", ["azure-conv", "shared-prefix", "burstgpt"])
def test_prompt_has_exactly_the_traces_token_count(name):
    trace = load_trace(resolve_trace(name))
    for r in trace.requests[:60]:
        assert _word_level_count(prompt_text(r.prompt_tokens())) == r.prompt_len


def test_prompt_keeps_the_prefix_groups_sharing():
    trace = load_trace(resolve_trace("shared-prefix"))
    by_group = {}
    for r in trace.requests:
        by_group.setdefault(r.prefix_group, []).append(r)
    group, members = next((g, m) for g, m in by_group.items() if g and len(m) >= 2)
    a, b = (prompt_text(r.prompt_tokens()).split() for r in members[:2])
    n = min(members[0].prefix_len, members[1].prefix_len)
    assert a[:n] == b[:n]
    assert a[n:] != b[n:]


def test_prompt_maps_ids_onto_the_vocabulary():
    assert prompt_text([0, 1, 959, 960, 1921]) == "w0 w1 w959 w0 w1"


# ------------------------------------------------------------------------------------------------ per request
def test_figures_from_a_token_stream_with_a_stall():
    r = RequestResult("r", "a", 10, None, scheduled_s=1.0, sent_s=1.0, token_s=[1.5, 1.6, 1.7, 2.7, 2.8])
    m = request_metrics(r)
    assert m["ttft_ms"] == pytest.approx(500.0)
    assert m["e2e_ms"] == pytest.approx(1800.0)
    assert m["tpot_ms"] == pytest.approx(1300.0 / 4)
    assert m["stall_ms"] == pytest.approx(1000.0)  # the gap between 1.7 and 2.7


def test_figures_of_a_single_token_request():
    m = request_metrics(RequestResult("r", "a", 10, 1, 0.0, sent_s=0.2, token_s=[0.45]))
    assert m["ttft_ms"] == pytest.approx(250.0) and m["e2e_ms"] == pytest.approx(250.0)
    assert m["tpot_ms"] is None and m["stall_ms"] is None
    assert request_metrics(RequestResult("r", "a", 10, 1, 0.0))["ttft_ms"] is None


def test_a_chunk_with_several_tokens_stamps_each():
    r = RequestResult("r", "a", 10, None, 0.0, sent_s=0.0)
    _stamp(r, {"choices": [{"text": "", "prompt_token_ids": [1, 2], "completion_token_ids": None}]}, 0.1)
    _stamp(r, {"choices": [{"text": "w1 w2", "completion_token_ids": [32, 33]}]}, 0.2)
    _stamp(r, {"choices": [{"text": "", "completion_token_ids": [2], "finish_reason": "length"}]}, 0.5)
    _stamp(r, {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 3}}, 0.5)
    assert r.token_s == [0.2, 0.2, 0.5]
    assert r.finish_reason == "length" and r.output_tokens == 3 and r.prompt_tokens == 10
    assert request_metrics(r)["stall_ms"] == pytest.approx(300.0)
    _stamp(r, {"object": "error", "message": "boom", "code": 400}, 0.6)
    assert "boom" in r.error


def test_client_figures_only_count_finished_requests():
    good = RequestResult("a", "x", 5, None, 0.0, sent_s=0.0, token_s=[0.1, 0.2, 0.3], end_s=0.3, output_tokens=3,
                         prompt_tokens=5, status=200, finish_reason="stop")
    bad = RequestResult("b", "x", 5, None, 0.0, sent_s=0.0, end_s=0.05, status=400, error="HTTP 400: no")
    short = RequestResult("c", "x", 5, None, 0.0, sent_s=0.1, token_s=[0.4, 1.4], end_s=1.4, output_tokens=2,
                          prompt_tokens=7, status=200, finish_reason="length")
    f = client_figures([good, bad, short])
    assert f["requests"] == 3 and f["requests_finished"] == 2 and f["errors"] == 1
    assert f["output_tokens"] == 5
    assert f["stall_ms_max"] == pytest.approx(1000.0)
    assert f["e2e_ms_p50"] == pytest.approx((300.0 + 1300.0) / 2)
    assert f["wall_seconds"] == pytest.approx(1.4)
    assert f["prompt_tokens_mismatch"] == 1


# ------------------------------------------------------------------------------------------------ arms, times
def test_one_target_gets_everything_several_get_the_routers_draw():
    trace = load_trace(resolve_trace("azure-conv"))
    a, b = Target("base", "http://x:1"), Target("rec", "http://y:2")
    assert {t.arm for t in assign_targets(trace, [a]).values()} == {"base"}
    two = assign_targets(trace, [a, b], seed=3)
    shares = split_across_ranks(trace, [0, 1], 3)
    assert {r.id for r in shares[0].requests} == {rid for rid, t in two.items() if t is a}
    assert {r.id for r in shares[1].requests} == {rid for rid, t in two.items() if t is b}
    assert 0 < sum(t is a for t in two.values()) < len(trace.requests)
    with pytest.raises(LoadError, match="own name"):
        assign_targets(trace, [a, Target("base", "http://z:3")])


def test_send_times_scale_arrivals():
    timed = _trace([{"id": "a", "arrival_s": 2.0, "prompt_len": 3, "output_len": 2},
                    {"id": "b", "arrival_s": 0.5, "prompt_len": 3, "output_len": 2}])
    assert send_times(timed, 0.5) == {"a": 1.0, "b": 0.25}
    stepped = _trace([{"id": "a", "arrival": 10, "prompt_len": 3, "output_len": 2}])
    assert send_times(stepped, 2.0, step_ms=5.0) == {"a": pytest.approx(0.1)}
    with pytest.raises(LoadError, match="--time-scale 0"):
        send_times(timed, 0)


def test_a_prompt_longer_than_the_servers_context_is_refused_before_sending():
    trace = _trace([{"id": "ok", "arrival_s": 0, "prompt_len": 100, "output_len": 5},
                    {"id": "long", "arrival_s": 1, "prompt_len": 5000, "output_len": 5}])
    with pytest.raises(LoadError) as info:
        check_servable(trace, 4096, "the server at http://h:1")
    message = str(info.value)
    assert "line 2" in message and "prompt_len=5000" in message and "max_model_len=4096" in message
    assert "\n" not in message
    check_servable(trace, 8192, "s")
    with pytest.raises(LoadError, match="max_tokens=4096"):
        check_servable(_trace([{"id": "m", "arrival_s": 0, "prompt_len": 5, "max_tokens": 4096, "output_len": 5}]), 4096, "s")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_url_is_one_line(capsys):
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(LoadError, match="cannot reach the server"):
        server_info(Target("a", url), timeout=2)
    assert main(["load", "--url", url, "--trace", "pressure", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("fdsched load: error: --url") and "cannot reach" in err and "\n" not in err


def test_bad_options_are_one_line(capsys):
    assert main(["load", "--url", "localhost:8000", "--trace", "pressure"]) == 1
    assert "--url 'localhost:8000'; allowed: an http(s) URL" in capsys.readouterr().err
    assert main(["load", "--url", "http://a:1", "--url", "http://b:2", "--arm", "x", "--trace", "pressure"]) == 1
    assert "one --arm per --url" in capsys.readouterr().err
    assert main(["load", "--url", "http://a:1", "--trace", "no-such-trace"]) == 1
    assert "unknown; allowed: a shipped trace" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ server side
def _exposition(arm, preempt_decode, preempt_prefill, recomputed, finished):
    return "\n".join([
        "# TYPE fastdeploy:fdsched_preemptions_total counter",
        f'fastdeploy:fdsched_preemptions_total{{arm="{arm}",dp_rank="0",victim_phase="decode"}} {preempt_decode}',
        f'fastdeploy:fdsched_preemptions_total{{arm="{arm}",dp_rank="0",victim_phase="prefill"}} {preempt_prefill}',
        "# TYPE fastdeploy:fdsched_recomputed_tokens_total counter",
        f'fastdeploy:fdsched_recomputed_tokens_total{{arm="{arm}",dp_rank="0"}} {recomputed}',
        "# TYPE fastdeploy:fdsched_requests_finished_total counter",
        f'fastdeploy:fdsched_requests_finished_total{{arm="{arm}",dp_rank="0"}} {finished}',
        "",
    ])


def test_server_figures_are_the_window_between_two_scrapes():
    pytest.importorskip("prometheus_client")
    f = server_figures(_exposition("b", 1, 1, 10, 5), _exposition("b", 4, 3, 110, 25))
    assert (f["preemptions"], f["preemptions_decode_victims"], f["preemptions_prefill_victims"]) == (5, 3, 2)
    assert f["recomputed_tokens"] == 100 and f["server_requests_finished"] == 20 and f["server_arms"] == ["b"]
    assert server_figures(None, "# nothing of the plugin here\n")["preemptions"] is None


# ------------------------------------------------------------------------------------------------ a whole run
class FakeServer:
    """OpenAI-style /v1/completions streaming ``max_tokens`` tokens (default 4) word by word, with a long gap
    before the last one when the prompt's first word is w7; /v1/models; /metrics counting finished requests."""

    def __init__(self, arm, max_model_len=2048, gap_s=0.02, stall_s=0.3):
        self.arm, self.max_model_len, self.gap_s, self.stall_s = arm, max_model_len, gap_s, stall_s
        self.finished = 0
        self.bodies = []

    async def models(self, request):
        return web.json_response({"data": [{"id": "tiny", "max_model_len": self.max_model_len}]})

    async def metrics(self, request):
        return web.Response(text=_exposition(self.arm, self.finished, 0, 0, self.finished))

    async def completions(self, request):
        body = await request.json()
        self.bodies.append(body)
        words = body["prompt"].split()
        if len(words) >= self.max_model_len:
            return web.json_response({"object": "error", "message": "too long"}, status=400)
        n = body.get("max_tokens", 4)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(obj):
            await response.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        await send({"choices": [{"text": "", "prompt_token_ids": [0] * len(words)}]})
        for i in range(n):
            await asyncio.sleep(self.stall_s if (i == n - 1 and words[0] == "w7") else self.gap_s)
            last = i == n - 1
            await send({"choices": [{"text": " w1", "completion_token_ids": [32],
                                     **({"finish_reason": "length"} if last else {})}]})
        await send({"choices": [], "usage": {"prompt_tokens": len(words), "completion_tokens": n}})
        await response.write(b"data: [DONE]\n\n")
        self.finished += 1
        return response


@pytest.fixture
def servers():
    loop = asyncio.new_event_loop()
    fakes, runners = [FakeServer("base"), FakeServer("rec")], []
    urls = []

    async def start():
        for fake in fakes:
            app = web.Application()
            app.router.add_get("/v1/models", fake.models)
            app.router.add_get("/metrics", fake.metrics)
            app.router.add_post("/v1/completions", fake.completions)
            runner = web.AppRunner(app)
            await runner.setup()
            port = _free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{port}")

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    yield fakes, urls
    for runner in runners:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_a_whole_run_against_two_arms(servers, tmp_path, capsys):
    pytest.importorskip("prometheus_client")
    fakes, urls = servers
    lines = [{"id": f"r{i}", "arrival_s": i * 0.01, "prompt": [7 if i % 4 == 0 else 8, 9, 10], "max_tokens": 3 + i % 3,
              "output_len": 3 + i % 3} for i in range(12)]
    lines.append({"id": "u", "arrival_s": 0.05, "prompt_len": 6, "max_tokens": None, "output_len": 9})
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    trace = load_trace(path)
    targets = [Target("base", urls[0]), Target("rec", urls[1])]
    load = run_trace_load(trace, targets, time_scale=1.0, seed=1, progress=False)
    results = {r.id: r for r in load["results"]}
    assignment = assign_targets(trace, targets, seed=1)
    assert all(results[rid].arm == t.arm for rid, t in assignment.items())
    assert sum(len(f.bodies) for f in fakes) == 13
    sent = {b["prompt"]: b for f in fakes for b in f.bodies}
    assert "max_tokens" not in sent[request_prompt(trace.requests[-1])[0]]  # None -> omitted
    assert all(r.ok and r.output_tokens == (r.max_tokens or 4) for r in results.values())
    stalled = request_metrics(results["r0"])["stall_ms"]
    assert 250 <= stalled < 2000 and request_metrics(results["r1"])["stall_ms"] < stalled

    report = build_served_report(trace, load, targets)
    assert [p["profile"] for p in report["profiles"]] == ["base", "rec"]
    for p in report["profiles"]:
        f = p["figures"]
        for key in USER_KEYS:
            assert key in f
        mine = sum(1 for t in assignment.values() if t.arm == p["profile"])
        assert f["requests"] == f["requests_finished"] == mine
        assert f["server_requests_finished"] == mine  # the window between the two scrapes
        assert f["prompt_tokens_mismatch"] == 0
    table = format_served_table(report)
    assert table.startswith("traffic: NOT identical: the requests were split over the arms")  # before any figure
    header = next(line for line in table.splitlines() if line.startswith("figure"))
    assert header.split()[-3:] == ["base", "rec", "rec/base"]

    # the same through the command, with outputs
    out = tmp_path / "out"
    assert main(["load", "--url", urls[0], "--arm", "only", "--trace", str(path), "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "E2E p99 (ms)" in printed and "stall max (ms)" in printed
    saved = json.loads((out / "report.json").read_text())
    assert saved["profiles"][0]["figures"]["requests_finished"] == 13
    assert len((out / "requests.jsonl").read_text().splitlines()) == 13
    if (out / "report.png").exists():
        assert (out / "report.png").stat().st_size > 1000


def test_a_prompt_too_long_for_the_server_sends_nothing(servers, tmp_path, capsys):
    fakes, urls = servers
    fakes[0].max_model_len = 64
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"id": "x", "arrival_s": 0, "prompt_len": 100, "max_tokens": None, "output_len": 2}) + "\n")
    assert main(["load", "--url", urls[0], "--trace", str(path), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "prompt_len=100 does not fit" in err and "max_model_len=64" in err
    assert fakes[0].bodies == []
