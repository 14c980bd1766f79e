"""PD disaggregation served on CPU: FastDeploy's Router in splitwise mode, one prefill and one decode api_server
(each with its engine, SplitwiseConnector and cache manager), the plugin in both engines, the simulated worker and
cache messager (seams S2, S12, S13).

One stack serves every check (a PD start costs two api_servers' start-up, ~35 s on a loaded 2-core machine); the
failure paths run last, on the same stack: the first takes the decode instance's KV receiver away, the second the
whole decode instance. A failed start and a drain (which closes the gates for good) start stacks of their own."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from fdsched.serve.model import prompt_of_length

from .helpers import _conn, assert_blocks_whole, assert_left_nothing, complete, metric, run_concurrently, settle

SHAPE = dict(num_gpu_blocks=48, block_size=16, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256)
ROLE_PROFILES = "prefill=pd_prefill_cache,decode=baseline"


def _post(url: str, prompt: str, max_tokens: int, timeout: float = 120) -> tuple:
    """A non-stream completion: (HTTP status, the answer's JSON)."""
    conn = _conn(url, timeout)
    body = json.dumps({"model": "default", "prompt": prompt, "max_tokens": max_tokens, "stream": False})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read().decode(errors="replace")
    conn.close()
    try:
        return resp.status, json.loads(data)
    except ValueError:
        return resp.status, {"raw": data}


def _prefix_hits(text: str) -> float:
    """The engine's own count of prompt tokens found in its prefix cache (a counter: with or without _total)."""
    return metric(text, "fastdeploy:prefix_cache_token_num_total") or metric(text, "fastdeploy:prefix_cache_token_num")


@pytest.fixture(scope="module")
def pd():
    from fdsched.serve.pd import PdConfig, PdServedEngine

    eng = PdServedEngine(PdConfig(prefill=1, decode=1, role_profiles=ROLE_PROFILES, **SHAPE))
    eng.__enter__()
    try:
        yield eng
    finally:
        assert_left_nothing(eng)


def test_both_roles_run_their_own_profile_in_every_engine(pd):
    logs = {inst["role"]: open(os.path.join(inst["log_dir"], "fastdeploy.log"), errors="replace").read()
            for inst in pd.instances}
    assert "[fdsched] fdsched installed (profile pd_prefill_cache)" in logs["prefill"]
    assert "[fdsched] fdsched installed (profile baseline)" in logs["decode"]
    assert "profile baseline" not in logs["prefill"] and "profile pd_prefill_cache" not in logs["decode"]


def test_requests_through_the_router_prefill_transfer_decode(pd):
    status, doc = _post(pd.router_url, prompt_of_length(40, seed=1), 12)
    assert status == 200, doc
    assert doc["choices"][0]["finish_reason"] == "length"
    assert doc["usage"]["completion_tokens"] == 12 and doc["usage"]["prompt_tokens"] == 40
    streamed = complete(pd.router_url, prompt_of_length(40, seed=2), 9, stream=True, timeout=120)
    assert streamed["error"] is None and streamed["finish_reason"] == "length", streamed
    # the prefill instance's messager moved both requests' blocks and reported each transfer finished
    log = pd.messager_log(0)
    assert log.count(": finished (") >= 2, log[-2000:]


def test_shared_prefix_hits_on_the_prefill_node_and_pools_are_whole(pd):
    hits_before = _prefix_hits(pd.metrics_text(0))
    prefix = prompt_of_length(64, seed=11)
    prompts = [prompt_of_length(96, seed=100 + i, prefix=prefix) for i in range(8)]
    first = _post(pd.router_url, prompts[0], 4)
    assert first[0] == 200, first
    results = run_concurrently(lambda p: _post(pd.router_url, p, 8), [(p,) for p in prompts[1:]], spacing_s=0.05)
    assert all(status == 200 for status, _doc in results), results
    # the 64-token prefix is 4 whole blocks of 16: each later request finds them in the prefill node's tree (the
    # prefill engine's own count, 7 x 64 tokens); the decode node matches nothing, it is handed the KV
    assert _prefix_hits(pd.metrics_text(0)) - hits_before == 7 * 64
    assert metric(pd.metrics_text(0), "fastdeploy:hit_token_rate") > 0.3
    assert metric(pd.metrics_text(1), "fastdeploy:hit_token_rate") == 0.0
    for rank in range(2):
        state = settle(pd, rank)
        assert_blocks_whole(state, pd.instances[rank]["log_dir"])
    assert settle(pd, 0)["tree_blocks"], "the prefill node's tree is empty after shared-prefix traffic"


def test_a_burst_the_decode_node_preempts_is_answered_whole(pd):
    """Eight non-streamed completions at once (40-token prompts, ``max_tokens`` 150: more answers than the decode
    node's 48 blocks hold) through the Router: the decode node preempts. Each request is answered: completed (on the
    new host also after the Router sent it again), ``pd_reschedule`` (the Router's retries used up) or, on the old
    host, whose Router does not retry, HTTP 500 for a preempted one. None waits: a decode node whose prefilled
    requests are all held for the reservation (the defect ``decode_node_reserve`` fixes, and which the decode node's
    ``baseline`` showed on the new host before its running pass took a prefilled request's chunk) would leave them
    unanswered. Both pools are whole afterwards."""
    prompts = [(prompt_of_length(40, seed=1000 + i),) for i in range(8)]
    results = run_concurrently(lambda prompt: _post(pd.router_url, prompt, 150, timeout=90), prompts)
    unanswered = [r for r in results if not isinstance(r, tuple)]
    assert not unanswered, f"requests the stack never answered (a stalled decode node?): {unanswered}"
    completed = [doc for status, doc in results if status == 200 and doc["choices"][0]["finish_reason"] == "length"]
    rescheduled = [doc for status, doc in results if status == 200 and doc["choices"][0]["finish_reason"] == "pd_reschedule"]
    failed = [(status, doc) for status, doc in results if status == 500]
    assert len(completed) + len(rescheduled) + len(failed) == 8, results
    assert completed and all(doc["usage"]["completion_tokens"] == 150 for doc in completed), completed
    preemptions = open(os.path.join(pd.instances[1]["log_dir"], "fastdeploy.log"), errors="replace").read().count(
        "Preempted request id:")
    assert preemptions >= 1, "the decode node never preempted: the burst did not press its pool"
    for rank in range(2):
        state = settle(pd, rank)
        assert state["running"] == 0, state
        assert_blocks_whole(state, pd.instances[rank]["log_dir"])
    print(f"\nburst of 8: {len(completed)} completed, {len(rescheduled)} pd_reschedule, {len(failed)} answered 500; "
          f"{preemptions} preemption(s) on the decode node")


def test_a_decode_that_stops_receiving_fails_the_request_and_prefill_frees_its_blocks(pd):
    """The decode instance's KV receiver (its cache messager) is killed: the prefill messager's write finds nobody
    (``connection error``), the prefill engine ends the request with the host's ``PD Error`` (501) and frees its
    blocks, the decode engine recycles what it preallocated, and the client gets an error, not a hang."""
    import psutil

    decode = pd.instances[1]
    receiver = [p for p in psutil.Process(pd.procs[decode["name"]].pid).children(recursive=True)
                if "pdxfer.py" in " ".join(p.cmdline()) and p.name() != "sh"]
    assert len(receiver) == 1, receiver
    os.kill(receiver[0].pid, signal.SIGKILL)
    t0 = time.monotonic()
    status, doc = _post(pd.router_url, prompt_of_length(40, seed=3), 6, timeout=90)
    took = time.monotonic() - t0
    from fastdeploy.router.router import RouterArgs

    failed = pd.messager_log(0).count(": connection error (")
    if "preempt_retry_count" in RouterArgs.__dataclass_fields__:
        # the Router reads the host's "PD Error" as a decode to avoid and tries again, preempt_retry_count (3) times,
        # then answers with what the last attempt got: finish_reason pd_reschedule
        assert status == 200 and doc["choices"][0]["finish_reason"] == "pd_reschedule", doc
        assert doc["id"].endswith(f"-retry{RouterArgs.preempt_retry_count}"), doc["id"]
        assert failed == RouterArgs.preempt_retry_count + 1, pd.messager_log(0)[-3000:]
    else:  # no retry in this host's Router: one attempt, its answer is not a completion
        assert failed == 1, pd.messager_log(0)[-3000:]
        assert status != 200 or doc.get("error") or doc["choices"][0]["finish_reason"] not in ("length", "stop"), doc
    assert took < 80, took
    for rank in range(2):
        state = settle(pd, rank)
        assert_blocks_whole(state, pd.instances[rank]["log_dir"])
    # the stack notices the dead receiver and names it (its exit status is its shell's: named as gone)
    from fdsched.serve.launcher import ServeError

    deadline, message = time.monotonic() + 10, ""
    while not message and time.monotonic() < deadline:
        try:
            pd.check_alive()
            time.sleep(0.3)
        except ServeError as exc:
            message = str(exc)
    assert message.startswith("decode 0 cache messager (pid "), message


def test_a_decode_instance_killed_mid_transfer_fails_the_request_and_nothing_is_left(pd):
    """The decode instance's api_server process group is killed while a transfer to it is in flight (the prefill is
    done, the decode has allocated its blocks, the prefill messager's write is held): the write finds nobody
    (``connection error``), the prefill engine frees the request's blocks, the Router answers 500 at once and does
    not retry (both hosts: its request to the decode raises and nothing catches that; new host router.py 219-292
    with 308-316, whose retry loop reads only answers; old host 192-257, no retry at all), the instance's processes
    outside its group (cache messager, worker launcher, worker) end by themselves, a drain counts the lost request
    without waiting for it, and the module's teardown leaves no process, port or /dev/shm entry."""
    import threading

    from fdsched.serve.teardown import still_running

    decode = pd.instances[1]
    api_pid = pd.procs[decode["name"]].pid
    others = [key for key, (_rank, role) in pd.watched().items()
              if role.startswith(decode["name"] + " ") and key[0] != api_pid]
    assert others, "no decode process outside the api_server's group was seen at start-up"
    retries_before = _router_text(pd).count("Preemption detected")
    answer = {}
    pd.hold_transfers(True)
    try:
        sender = threading.Thread(target=lambda: answer.update(
            r=_post(pd.router_url, prompt_of_length(40, seed=4), 6, timeout=60)))
        sender.start()
        deadline = time.monotonic() + 30
        while ": write of " not in pd.messager_log(0) and time.monotonic() < deadline:
            time.sleep(0.05)
        held = [ln for ln in pd.messager_log(0).splitlines() if ": write of " in ln]
        assert len(held) == 1, pd.messager_log(0)[-2000:]
        rid = held[0].split("task ", 1)[1].split(":", 1)[0]
        assert pd.engine_state(1)["request_blocks"], "the decode holds no blocks for the request in flight"
        os.killpg(api_pid, signal.SIGKILL)
        sender.join(30)
        gone_by = time.monotonic() + 5
        while still_running(others) and time.monotonic() < gone_by:
            time.sleep(0.1)
    finally:
        pd.hold_transfers(False)
    assert not still_running(others), f"decode processes outside its group outlived it: {still_running(others)}"
    status, doc = answer["r"]
    assert status == 500 and doc == {"raw": "Internal Server Error"}, (status, doc)
    router = _router_text(pd)
    assert "ServerDisconnectedError" in router or "ClientOSError" in router, router[-2000:]
    assert router.count("Preemption detected") == retries_before, "the Router retried a request whose decode died"
    state = settle(pd, 0)
    assert_blocks_whole(state, pd.instances[0]["log_dir"])
    assert f"task {rid}: connection error (" in pd.messager_log(0), pd.messager_log(0)[-2000:]
    killed = [d.text() for d in pd.deaths() if d.pid == api_pid]
    assert killed == [f"decode 0 api_server (pid {api_pid}) was killed by SIGKILL"], pd.deaths()
    counts = pd.drain(timeout=10)
    assert (counts["in_flight"], counts["lost"]) == (0, 1) and counts["seconds"] < 3, counts


def _router_text(pd) -> str:
    """The Router's output and logs."""
    paths = [os.path.join(pd.log_dir, "router.out")]
    folder = os.path.join(pd.log_dir, "router")
    paths += [os.path.join(folder, f) for f in sorted(os.listdir(folder))] if os.path.isdir(folder) else []
    return "".join(open(p, errors="replace").read() for p in paths if os.path.isfile(p))


def test_an_instance_that_never_comes_up_is_named_and_nothing_is_left():
    """With a health timeout (12 s) longer than the Router's start-up (4 s on an idle 2-core machine) and shorter than
    an api_server's (23 s), the start fails in one line naming each instance still starting, with its stage, in the
    stack's order; an instance not named had come up (the launcher said so: which ones make it depends on the
    machine's load). Stopping leaves no process, port or /dev/shm entry."""
    import re

    from fdsched.serve.launcher import ServeError
    from fdsched.serve.pd import PdConfig, PdServedEngine

    said = []
    eng = PdServedEngine(PdConfig(prefill=1, decode=1, health_timeout=12, **SHAPE), progress=said.append)
    t0 = time.monotonic()
    with pytest.raises(ServeError) as failed:
        eng.__enter__()
    message = str(failed.value)
    names = [inst["name"] for inst in eng.instances]
    assert names == ["prefill 0", "decode 0"], names
    assert time.monotonic() - t0 < 90, message
    head, tail = message.split(": not healthy within 12s; ", 1)
    assert tail.startswith("allowed: a longer --health-timeout"), message
    assert head.startswith("stage "), message
    named = [stage.split(" ", 2) for stage in head[len("stage "):].split("; ")]
    named_instances = [f"{role} {index}" for role, index, _stage in named]
    assert named_instances and named_instances == [n for n in names if n in named_instances], message
    assert all(re.fullmatch(r"api_server \(.+\)|worker ready|engine start \(/health\)", stage)
               for _role, _index, stage in named), message
    came_up = [n for n in names if any(line.startswith(f"{n} up in ") for line in said)]
    assert sorted(came_up + named_instances) == sorted(names), (message, said)
    assert_left_nothing(eng, "after a failed start", stop=False)


def test_a_drain_finishes_what_both_instances_have_in_flight_and_refuses_the_rest():
    """What Ctrl-C runs on a PD stack, on a stack of its own (a drain closes the gates for good): a long completion in
    flight through the Router when the drain starts finishes whole; a request sent after it is refused by the
    instances' gates and the Router passes the 503 on; nothing is cut, nothing is lost, and stopping leaves no
    process, port or /dev/shm entry."""
    import threading

    from fdsched.serve.pd import PdConfig, PdServedEngine

    eng = PdServedEngine(PdConfig(prefill=1, decode=1, role_profiles=ROLE_PROFILES, **SHAPE))
    try:
        eng.__enter__()
        answer = {}
        sender = threading.Thread(target=lambda: answer.update(
            r=_post(eng.router_url, prompt_of_length(40, seed=11), 400, timeout=120)))
        sender.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not eng.engine_state(1).get("request_blocks"):
            time.sleep(0.05)  # until the decode instance holds the request: both gates have it in flight
        counts = eng.drain(timeout=60)
        refused_status, refused_doc = _post(eng.router_url, prompt_of_length(40, seed=12), 8, timeout=60)
        sender.join(60)
    finally:
        assert_left_nothing(eng)
    status, doc = answer["r"]
    assert status == 200 and doc["choices"][0]["finish_reason"] == "length", (status, doc)
    assert doc["usage"]["completion_tokens"] == 400, doc["usage"]
    assert (counts["in_flight"], counts["ended"], counts["lost"]) == (0, 0, 0) and counts["finished"] >= 1, counts
    # the Router passes the instance's refusal on
    assert refused_status == 503 and "shutting down" in json.dumps(refused_doc), (refused_status, refused_doc)
    print(f"\ndrain: {counts}; after it the Router answered {refused_status}: {json.dumps(refused_doc)[:200]}")
