"""Load over HTTP from a trace: replay a trace's requests against running FastDeploy servers.

Imports nothing from FastDeploy. Each request of the trace is sent to an OpenAI ``/v1/completions``
endpoint, streaming, at its arrival time (``arrival_s`` x ``time_scale``; a step-based trace: arrival step
x ``step_ms`` x ``time_scale``), and timed the way an operator times it, client-side:

==============  ===========================================================================================
TTFT            first streamed token - request sent
E2E             last streamed token - request sent
TPOT            (last token - first token) / (tokens - 1), requests with >= 2 tokens
stall           the longest gap between two consecutive streamed tokens of the request (a preemption's
                recompute shows here); requests with >= 2 tokens
output tokens   the server's ``usage.completion_tokens`` (else the tokens counted in the stream)
errors          HTTP status and error body, or the transport error
==============  ===========================================================================================

A chunk carrying k tokens (``completion_token_ids`` of length k) stamps k tokens at the same time.

Prompts: the trace's prompt token ids mapped onto the words ``w0`` .. ``w959`` (``w{id % 960}``), joined by
spaces. The served engine's tiny model (a word-level tokenizer over exactly these words) turns that text into
exactly ``prompt_len`` tokens, and requests of one prefix group share their first ``prefix_len`` tokens, so
prefix caching sees the trace's sharing. Any other tokenizer gives a different count: every request records
the server's ``usage.prompt_tokens`` and the report counts mismatches. By default the last 2-4 words of each
prompt are its length mark (:mod:`fdsched.serve.lengthmark`): the request's true output length, where the served
engine's simulated worker ends the answer with EOS, so ``max_tokens`` is sent as the trace has it (omitted where
it is null) and the engine applies its own default to the rest.

Arms: one ``Target`` (arm name, URL, metrics URL) per arm. With one target every request goes to it. With
several, each request goes to the target drawn by :func:`fdsched.replay.trace.split_across_ranks` (uniform,
``random.Random(seed)``, as FastDeploy's Router picks a mixed instance, and the same draw as the replay's
``--dp-arms``). The client sends to the ranks' own api_servers rather than through the Router because a
client behind the Router cannot know which rank served it: the Router relays the rank's stream unchanged (no
header, the completion id is the client's or a uuid), its ``select_mixed`` logs no choice, and the per-rank
``/metrics`` hold totals, not requests (fastdeploy/router/router.py, ``select_mixed`` / ``_generate_stream``,
both hosts).

After the last request, every target's ``/metrics`` is scraped (also once before the first request: the
report holds the window between the two) and the plugin's series (``fastdeploy:fdsched_*``) are read with
:mod:`fdsched.cmdline.scrape`.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

from fdsched.replay.trace import Trace, split_across_ranks

__all__ = [
    "WORDS",
    "LoadError",
    "Target",
    "RequestResult",
    "prompt_text",
    "request_prompt",
    "request_metrics",
    "assign_targets",
    "check_servable",
    "server_info",
    "scrape",
    "run_trace_load",
    "send_times",
]

WORDS = 960  # the served engine's tiny model: word-level tokens "w0" .. "w959"
DEFAULT_STEP_MS = 5.0  # a step-based trace's step, in ms (the replay's default fixed step cost)


class LoadError(RuntimeError):
    """One clear error (the CLI prints it without a traceback)."""


@dataclass(frozen=True)
class Target:
    arm: str
    url: str  # the api_server, e.g. http://127.0.0.1:8000
    metrics_url: Optional[str] = None  # default: url + /metrics
    send_url: Optional[str] = None  # where the completions go, when not ``url`` (the Router in front of a PD pair)

    @property
    def metrics(self) -> str:
        return self.metrics_url or self.url.rstrip("/") + "/metrics"


@dataclass
class RequestResult:
    id: str
    arm: str
    prompt_len: int
    max_tokens: Optional[int]
    scheduled_s: float  # when it was due, from the start of the run
    sent_s: Optional[float] = None
    token_s: list = field(default_factory=list)  # each streamed token's arrival, from the start of the run
    end_s: Optional[float] = None  # the stream ended
    output_tokens: int = 0
    prompt_tokens: Optional[int] = None  # the server's usage.prompt_tokens
    length_mark: Optional[int] = None  # the output length the prompt's length mark carries; None: unmarked
    status: Optional[int] = None
    error: str = ""
    finish_reason: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and self.finish_reason is not None

    def to_json(self) -> dict:
        out = asdict(self)
        out.update(request_metrics(self))
        return out


def prompt_text(tokens: Sequence[int]) -> str:
    """The prompt whose word-level tokens are ``w{t % 960}`` for every trace token ``t``."""
    return " ".join(f"w{int(t) % WORDS}" for t in tokens)


def request_prompt(request, length_mark: bool = True):
    """``(text, mark)``: the request's prompt text and the output length its tail's length mark carries (None:
    unmarked, because ``length_mark`` is off or the prompt is shorter than the mark). The served engine's
    simulated worker ends the answer there (:mod:`fdsched.serve.lengthmark`)."""
    from fdsched.serve.lengthmark import MAX_LENGTH, mark_words

    words = prompt_text(request.prompt_tokens()).split()
    if not length_mark or request.effective_output_len > MAX_LENGTH:
        return " ".join(words), None
    marked = mark_words(words, request.effective_output_len)
    return (" ".join(words), None) if marked is None else (" ".join(marked), request.effective_output_len)


def request_metrics(result: RequestResult) -> dict:
    """Client-side figures of one request, in ms; None where undefined."""
    stamps, sent = result.token_s, result.sent_s
    figures = {"ttft_ms": None, "e2e_ms": None, "tpot_ms": None, "stall_ms": None}
    if sent is None or not stamps:
        return figures
    figures["ttft_ms"] = (stamps[0] - sent) * 1000.0
    figures["e2e_ms"] = (stamps[-1] - sent) * 1000.0
    if len(stamps) >= 2:
        figures["tpot_ms"] = (stamps[-1] - stamps[0]) * 1000.0 / (len(stamps) - 1)
        figures["stall_ms"] = max(b - a for a, b in zip(stamps, stamps[1:])) * 1000.0
    return figures


def send_times(trace: Trace, time_scale: float = 1.0, step_ms: float = DEFAULT_STEP_MS) -> dict:
    """request id -> seconds after the start at which it is sent."""
    if not (time_scale > 0):
        raise LoadError(f"--time-scale {time_scale!r}; allowed: a number > 0 (0.5 sends twice as fast)")
    if not (step_ms > 0):
        raise LoadError(f"--step-ms {step_ms!r}; allowed: a number > 0")
    if trace.time_based:
        return {r.id: r.arrival_s * time_scale for r in trace.requests}
    return {r.id: r.arrival * step_ms / 1000.0 * time_scale for r in trace.requests}


def assign_targets(trace: Trace, targets: Sequence[Target], seed: int = 0) -> dict:
    """request id -> Target: all to the one target, or the Router's uniform draw over several."""
    if not targets:
        raise LoadError("no --url given; allowed: one or more api_server URLs")
    arms = [t.arm for t in targets]
    if len(set(arms)) != len(arms):
        raise LoadError(f"--arm names {arms}: each arm needs its own name")
    if len(targets) == 1:
        return {r.id: targets[0] for r in trace.requests}
    shares = split_across_ranks(trace, range(len(targets)), seed)
    return {r.id: targets[rank] for rank, share in shares.items() for r in share.requests}


# --------------------------------------------------------------------------------------------
# Before sending
# --------------------------------------------------------------------------------------------
def _get(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode("utf-8")


def server_info(target: Target, timeout: float = 10.0) -> dict:
    """The server's model id and max_model_len (``/v1/models``); LoadError in one line when unreachable."""
    url = target.url.rstrip("/") + "/v1/models"
    try:
        body = json.loads(_get(url, timeout))
    except urllib.error.HTTPError as exc:
        raise LoadError(f"--url {target.url} (arm {target.arm}): {url} answered HTTP {exc.code}; is it an OpenAI "
                        "api_server?") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise LoadError(f"--url {target.url} (arm {target.arm}): cannot reach the server ({reason}); allowed: the "
                        "URL of a running api_server, e.g. http://127.0.0.1:8000") from None
    models = body.get("data") or [{}]
    return {"model": models[0].get("id"), "max_model_len": models[0].get("max_model_len")}


def check_servable(trace: Trace, max_model_len: Optional[int], where: str) -> None:
    """Every request must fit the server's context; else one error naming the first request that does not."""
    from fdsched.replay.tracehelp import fitting_max_model_len, shown_source

    if not max_model_len:
        return
    for r in trace.in_feed_order():
        if r.prompt_len >= max_model_len:
            raise LoadError(
                f"trace {shown_source(trace.source)} line {r.line} (request {r.id}): prompt_len={r.prompt_len} does "
                f"not fit {where}'s max_model_len={max_model_len}; raise --max-model-len to "
                f"{fitting_max_model_len(trace.requests)} (every request fits), or drop such requests from the trace"
            )
        if r.max_tokens is not None and r.max_tokens >= max_model_len:
            raise LoadError(
                f"trace {shown_source(trace.source)} line {r.line} (request {r.id}): max_tokens={r.max_tokens} is refused by "
                f"{where} (max_model_len={max_model_len}); allowed: 1 .. {max_model_len - 1}"
            )


def scrape(target: Target, timeout: float = 10.0):
    """(text, None) or (None, reason)."""
    try:
        return _get(target.metrics, timeout), None
    except Exception as exc:  # a missing /metrics must not lose the client-side figures
        return None, f"{target.metrics}: {getattr(exc, 'reason', exc)}"


# --------------------------------------------------------------------------------------------
# Sending
# --------------------------------------------------------------------------------------------
def _stamp(result: RequestResult, obj: dict, now: float) -> None:
    if obj.get("object") == "error" or ("error" in obj and "choices" not in obj):
        result.error = json.dumps(obj.get("error", obj))[:500]
        return
    for choice in obj.get("choices") or []:
        ids = choice.get("completion_token_ids")
        count = len(ids) if ids is not None else (1 if choice.get("text") else 0)
        result.token_s.extend([now] * count)
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
    usage = obj.get("usage")
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens")
        if usage.get("completion_tokens") is not None:
            result.output_tokens = usage["completion_tokens"]


async def _send(session, target: Target, model: str, prompt: str, result: RequestResult, start: float) -> None:
    import aiohttp

    body = {"model": model, "prompt": prompt, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    if result.max_tokens is not None:
        body["max_tokens"] = result.max_tokens
    loop = asyncio.get_running_loop()
    result.sent_s = loop.time() - start
    try:
        async with session.post((target.send_url or target.url).rstrip("/") + "/v1/completions", json=body) as response:
            result.status = response.status
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:500]}"
                return
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                try:
                    obj = json.loads(payload)
                except ValueError:
                    result.error = f"not JSON in the stream: {payload[:200]!r}"
                    return
                _stamp(result, obj, loop.time() - start)
                if result.error:
                    return
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        result.end_s = loop.time() - start
        if not result.output_tokens:
            result.output_tokens = len(result.token_s)
        if not result.error and result.status == 200 and result.finish_reason is None:
            result.error = "the stream ended without a finish_reason"


async def _run(trace, assignment, model, times, request_timeout, progress, prompts):
    import aiohttp

    ordered = trace.in_feed_order()
    results = {r.id: RequestResult(r.id, assignment[r.id].arm, r.prompt_len, r.max_tokens, times[r.id],
                                   length_mark=prompts[r.id][1]) for r in ordered}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=request_timeout)
    # A fresh connection per request: a pooled keep-alive connection that the server (uvicorn, keep-alive 5 s) has
    # closed while it sat idle in aiohttp's pool (keep-alive 15 s) fails the next request with "Can not write
    # request body" / "Server disconnected" before the server sees it: client errors that were no server's.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        loop = asyncio.get_running_loop()
        start = loop.time()
        tasks = []
        for r in ordered:
            delay = times[r.id] - (loop.time() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(
                _send(session, assignment[r.id], model, prompts[r.id][0], results[r.id], start)
            )
            if progress is not None:
                task.add_done_callback(lambda _t: progress(1))
            tasks.append(task)
        await asyncio.gather(*tasks)
    return [results[r.id] for r in trace.requests]


def run_trace_load(
    trace: Trace,
    targets: Sequence[Target],
    time_scale: float = 1.0,
    step_ms: float = DEFAULT_STEP_MS,
    seed: int = 0,
    model: Optional[str] = None,
    request_timeout: float = 600.0,
    progress: bool = True,
    max_tokens_override: Optional[Callable] = None,
    length_mark: bool = True,
) -> dict:
    """Send ``trace`` to ``targets``; return ``{"results": [RequestResult], "servers": {arm: {...}},
    "wall_seconds": float}``. ``servers[arm]`` has ``model``, ``max_model_len``, ``scrape_before``,
    ``scrape_after`` (exposition text or None) and ``scrape_error``.

    ``max_tokens_override(request) -> int | None`` replaces the trace's max_tokens (the offline-vs-engine
    comparison sends each request's true output length). ``length_mark``: each prompt's tail carries the
    request's true output length (:func:`request_prompt`), where the served engine's simulated worker ends the
    answer, so a request can be sent without ``max_tokens``; a request whose prompt is too short for the mark
    and whose ``max_tokens`` is unset is sent with its true output length as ``max_tokens`` instead (counted in
    ``"unmarked_bounded"``). Raises LoadError before sending anything when a server is unreachable or a
    request cannot be served.
    """
    times = send_times(trace, time_scale, step_ms)
    assignment = assign_targets(trace, targets, seed)
    if max_tokens_override is not None:
        trace = Trace(
            requests=tuple(_with_max_tokens(r, max_tokens_override(r)) for r in trace.requests),
            engine=trace.engine, description=trace.description, generator=trace.generator, source=trace.source,
            name=trace.name,
        )
    trace, prompts, unmarked_bounded = _prompts(trace, length_mark)
    servers = _check_servers(trace, targets, assignment)
    model = model or next(iter(servers.values()))["model"] or "default"
    bar = _progress_bar(trace) if progress else None
    started = time.perf_counter()
    try:
        results = asyncio.run(_run(trace, assignment, model, times, request_timeout, bar.update if bar else None,
                                   prompts))
    finally:
        if bar is not None:
            bar.close()
    wall = time.perf_counter() - started
    for target in targets:
        text, error = scrape(target)
        entry = servers[target.arm]
        entry.update(scrape_after=text)
        entry["scrape_error"] = entry["scrape_error"] or error
    return {"results": results, "servers": servers, "wall_seconds": wall, "assignment_seed": seed,
            "time_scale": time_scale, "step_ms": None if trace.time_based else step_ms,
            "length_mark": length_mark, "unmarked_bounded": unmarked_bounded}


def _check_servers(trace, targets, assignment) -> dict:
    """arm -> the server's facts and its /metrics before the first request; LoadError when a request of the
    trace cannot be served there."""
    servers = {}
    for target in targets:
        info = server_info(target)
        check_servable(
            Trace(tuple(r for r in trace.requests if assignment[r.id] is target), source=trace.source),
            info["max_model_len"], f"the server at {target.url}",
        )
        servers[target.arm] = dict(info, url=target.url, metrics_url=target.metrics)
    for target in targets:
        text, error = scrape(target)
        servers[target.arm].update(scrape_before=text, scrape_error=error)
    return servers


def _progress_bar(trace):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=len(trace.requests), desc=f"load {trace.name}", unit="req", leave=False)


def _prompts(trace, length_mark):
    """``(trace, {id: (text, mark)}, [ids])``: the prompts, and the trace with an unmarked request that leaves
    max_tokens unset bounded to its true output length (else it would run to the end of the context)."""
    prompts = {r.id: request_prompt(r, length_mark) for r in trace.requests}
    if not length_mark:
        return trace, prompts, []
    bounded = [r.id for r in trace.requests if prompts[r.id][1] is None and r.max_tokens is None]
    if bounded:
        chosen = set(bounded)
        trace = Trace(
            requests=tuple(_with_max_tokens(r, r.effective_output_len) if r.id in chosen else r
                           for r in trace.requests),
            engine=trace.engine, description=trace.description, generator=trace.generator, source=trace.source,
            name=trace.name,
        )
    return trace, prompts, bounded


def _with_max_tokens(request, max_tokens):
    from dataclasses import replace

    return replace(request, max_tokens=max_tokens)
