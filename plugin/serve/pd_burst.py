"""Decode-side preemption through the Router, served: a burst of non-streamed completions (the only kind the Router
sends again when a decode instance preempts one) through FastDeploy's Router to one prefill and one decode instance
whose KV pool is too small for all the answers at once, one stack per decode-node profile and run.

Per run: how the burst ended on the client (completed at ``max_tokens``; answered ``pd_reschedule`` after the
Router's last attempt; cut when a stalled run was stopped; preempted by the decode engine and answered an error, as
on 2.6 commit e7c8dc2, whose Router does not retry and whose decode api_server fails the preempted completion with HTTP
500; other errors), how many answers needed a retry, the decode engine's preemptions, E2E on the client's clock and TTFT as a streamed answer would have seen it (client send -> the prefill engine's first token of
the attempt that completed, read from its log), and whether the run stalled.

A stall is named, not waited out: when no answer arrives and the decode engine's state (running requests, free
blocks) stays the same for ``stall_seconds``, the run ends with one line saying what the decode engine holds. The
case seen on 2.6 commit d38eeb8: every running request is a prefilled request the decode engine has not stepped once
(its blocks allocated, its worker never handed it), because the host admits that first step as a prefill chunk,
only with free blocks above its reservation for every running request, and with nothing else running nothing
frees (docs/engine.md, "Decode-side preemption through the Router").
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request

from fdsched.core.common import percentile

__all__ = ["BURST_SHAPE", "run_burst_arm", "stall_line", "format_burst_table"]

BURST_SHAPE = dict(num_gpu_blocks=48, block_size=16, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256)
COMPLETED = ("length", "stop")
_LOG_TIME = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})")


def run_burst_arm(config, decode_profile: str, run: int, requests: int, prompt_tokens: int, max_tokens: int,
                  stall_seconds: float, progress=None) -> dict:
    """One stack (``config``, a 1P+1D :class:`fdsched.serve.pd.PdConfig`), one burst; the run's figures. The stack's
    run folder goes afterwards."""
    from fdsched.serve.pd import PdServedEngine

    eng = PdServedEngine(config, progress=progress)
    try:
        with eng:
            return _burst(eng, decode_profile, run, requests, prompt_tokens, max_tokens, stall_seconds)
    finally:
        eng.cleanup()


def _post(url: str, body: dict, out: dict) -> None:
    out["sent"] = time.time()
    try:
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as resp:
            out["status"], text = resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        out["status"], text = exc.code, exc.read().decode(errors="replace")
    except Exception as exc:  # noqa: BLE001 - a dropped connection (the stack stopped on a stall) is a result
        out["status"], text = None, f"{type(exc).__name__}: {exc}"
    out["end"] = time.time()
    try:
        out["doc"] = json.loads(text)
    except ValueError:
        out["doc"] = {"raw": text[:300]}


def _burst(eng, decode_profile, run, requests, prompt_tokens, max_tokens, stall_seconds) -> dict:
    from fdsched.serve.model import prompt_of_length

    results = [{"rid": f"pdb{run}-{i}"} for i in range(requests)]
    threads = []
    for i in range(requests):
        body = {"model": "default", "prompt": prompt_of_length(prompt_tokens, seed=1000 + i),
                "max_tokens": max_tokens, "stream": False, "request_id": results[i]["rid"]}
        threads.append(threading.Thread(target=_post, args=(eng.router_url, body, results[i]), daemon=True))
    t0 = time.monotonic()
    for t in threads:
        t.start()
    stall, stopped_at, last, since = "", None, None, time.monotonic()
    while any(t.is_alive() for t in threads):
        time.sleep(0.5)
        eng.check_alive()
        try:
            state = eng.engine_state(1, timeout=10)
        except Exception:  # noqa: BLE001 - a missed sample is not a stall
            continue
        done = sum(1 for r in results if "end" in r)
        key = (done, state["running"], state["requests"], len(state["free"]))
        if key != last:
            last, since = key, time.monotonic()
        elif time.monotonic() - since >= stall_seconds:
            stall = stall_line(eng.instances[1]["name"], state, _decode_logs(eng), stall_seconds)
            stopped_at = time.time()
            eng.stop()  # the clients' connections drop: every thread ends
            break
    wall = time.monotonic() - t0
    for t in threads:
        t.join(30)
    return _figures(eng, decode_profile, run, results, stall, wall, stopped_at)


def _decode_logs(eng) -> dict:
    import os

    inst = eng.instances[1]
    out = {}
    for key, name in (("engine", "fastdeploy.log"), ("worker", "simworker_rank0.log")):
        try:
            with open(os.path.join(inst["log_dir"], name), errors="replace") as fh:
                out[key] = fh.read()
        except OSError:
            out[key] = ""
    return out


def stall_line(name: str, state: dict, logs: dict, seconds: float) -> str:
    """One line: what a decode engine that moved nothing for ``seconds`` holds, and why when the logs show it."""
    added = set(re.findall(r"D has successfully added prefilled request, (\S+)", logs.get("engine", "")))
    preempted = set(re.findall(r"Preempted request id: (\S+)", logs.get("engine", "")))
    stepped = set(re.findall(r"request (\S+): prompt \d+ tokens", logs.get("worker", "")))
    never = sorted(added - preempted - stepped)
    held = len(state.get("request_blocks", []))
    free = len(state.get("free", []))
    running = int(state.get("running", 0))
    if running and len(never) == running:
        return (f"{name} stalled for {seconds:g} s: its {running} running request(s) are prefilled ones it never "
                f"stepped (its worker was not handed them), holding {held} blocks with {free} free: FastDeploy's "
                "schedule() admits that first step (a one-token prefill chunk in its running queue) only with free "
                "blocks above its reservation for every running request, and with nothing running nothing frees")
    return (f"{name} stalled for {seconds:g} s: {running} running request(s), {held} blocks held, {free} free, "
            "no answer and no change")


def _log_times(text: str, marker: str) -> dict:
    """request id -> epoch seconds of the first log line of ``text`` containing ``marker`` and ``Request=<id>,``
    (the host logs its local time)."""
    out = {}
    for line in text.splitlines():
        if marker not in line:
            continue
        m = re.search(r"Request=([^,\s]+),", line)
        t = _LOG_TIME.search(line)
        if m and t and m.group(1) not in out:
            out[m.group(1)] = time.mktime(time.strptime(t.group(1), "%Y-%m-%d %H:%M:%S")) + int(t.group(2)) / 1e3
    return out


def _figures(eng, decode_profile, run, results, stall, wall, stopped_at=None) -> dict:
    """The run's row. A request still waiting when a stalled run was stopped (``stopped_at``, epoch seconds) is
    ``cut``, whether its connection dropped or the Router answered it with an error as the instances went."""
    import os

    prefill_log = ""
    try:
        with open(os.path.join(eng.instances[0]["log_dir"], "fastdeploy.log"), errors="replace") as fh:
            prefill_log = fh.read()
    except OSError:
        pass
    first_token = _log_times(prefill_log, "IsPrefill=True")
    logs = _decode_logs(eng)
    counts = dict.fromkeys(("completed", "pd_reschedule", "cut", "preempted_error", "errors", "retried"), 0)
    preempted = set(re.findall(r"Preempted request id: (\S+)", logs["engine"]))
    e2e, ttft, sample = [], [], ""
    for r in results:
        doc = r.get("doc") or {}
        choices = doc.get("choices") or [{}]
        reason = choices[0].get("finish_reason")
        rid = str(doc.get("id", ""))
        counts["retried"] += "-retry" in rid
        if r.get("status") == 200 and reason in COMPLETED:
            counts["completed"] += 1
            e2e.append(1000 * (r["end"] - r["sent"]))
            if rid + "_0" in first_token:
                ttft.append(1000 * (first_token[rid + "_0"] - r["sent"]))
        elif reason == "pd_reschedule":
            counts["pd_reschedule"] += 1
        elif stall and (r.get("status") is None or (stopped_at is not None and r.get("end", 0) >= stopped_at)):
            counts["cut"] += 1
        elif "PD Error" in json.dumps(doc) or _was_preempted(r.get("rid"), preempted):
            counts["preempted_error"] += 1
        else:
            counts["errors"] += 1
            sample = sample or f"HTTP {r.get('status')}: {json.dumps(doc)[:200]}"
    return {
        "decode_profile": decode_profile, "run": run, "requests": len(results), **counts, "error_sample": sample,
        "preemptions": len(re.findall(r"Preemption is triggered", logs["engine"])),
        "stalled": bool(stall), "stall": stall,
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
        "e2e_ms_p50": percentile(e2e, 50), "e2e_ms_p99": percentile(e2e, 99), "wall_seconds": round(wall, 1),
    }


def _was_preempted(rid, preempted: set) -> bool:
    """Whether the decode engine preempted the client's request ``rid`` (any attempt: the host's id is
    ``cmpl-<rid>[-retryN]_0``)."""
    if not rid:
        return False
    attempt = re.compile(rf"cmpl-{re.escape(rid)}(-retry\d+)?_0")
    return any(attempt.fullmatch(x) for x in preempted)


COLUMNS = (("completed", "completed", "{}"), ("pd_reschedule", "pd_reschedule", "{}"),
           ("cut", "cut at the stall", "{}"), ("preempted_error", "preempted, answered an error", "{}"),
           ("errors", "other errors", "{}"),
           ("retried", "retried", "{}"), ("preemptions", "D preemptions", "{}"),
           ("ttft_ms_p50", "TTFT p50 ms", "{:.0f}"), ("ttft_ms_p99", "TTFT p99 ms", "{:.0f}"),
           ("e2e_ms_p50", "E2E p50 ms", "{:.0f}"), ("e2e_ms_p99", "E2E p99 ms", "{:.0f}"),
           ("wall_seconds", "wall s", "{}"))


def format_burst_table(rows: list) -> str:
    head = "| decode profile | run | stalled | " + " | ".join(title for _k, title, _f in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 3)]
    for row in rows:
        cells = ["n/a" if row.get(k) is None else fmt.format(row[k]) for k, _t, fmt in COLUMNS]
        stalled = f"after {row['wall_seconds']:g} s" if row["stalled"] else "no"
        lines.append(f"| {row['decode_profile']} | {row['run']} | {stalled} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
