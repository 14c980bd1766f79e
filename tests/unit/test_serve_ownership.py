"""What a served stack owns, without a host: port leases, the /dev/shm creation ledger and what stop removes, the
flag and settings checks before start-up, how a dead process is named, the drain gate, and the served report's
traffic lines and gated verdicts."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket

import pytest

from fdsched.serve import seams
from fdsched.serve.seams import drain, ledger
from fdsched.serve.config import EngineConfig, ServeError, check_config
from fdsched.serve.launcher import ServedEngine
from fdsched.serve.ports import PortLease
from fdsched.serve.teardown import created_entries, remove_created
from fdsched.serve.watch import Death


# ------------------------------------------------------------------------------------------------ ports
def test_a_port_leased_by_one_stack_cannot_be_taken_by_another(tmp_path):
    lock_dir = str(tmp_path / "ports")
    first, second = PortLease(lock_dir), PortLease(lock_dir)
    assert first.take(18001) is None
    assert second.take(18001) == f"pid {os.getpid()}"  # flock is per open file: a second lease in one process too
    assert second.take(18002) is None
    first.release()
    assert not os.path.exists(os.path.join(lock_dir, "18001.lock"))  # removed while still locked
    assert second.take(18001) is None
    second.release()
    assert not os.path.exists(lock_dir)  # the shared directory goes when the last lease is released


def test_a_lease_survives_in_a_child_that_inherits_it(tmp_path):
    lock_dir = str(tmp_path / "ports")
    lease = PortLease(lock_dir)
    assert lease.take(18003) is None
    pid = os.fork()
    if pid == 0:  # the stack's top process holds the lease too (pass_fds): the launcher's death does not free it
        os._exit(0 if PortLease(lock_dir).take(18003) is not None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    lease.release()


@pytest.mark.parametrize("stack", ["one-instance", "pd"])
def test_a_port_in_use_or_leased_is_one_line_naming_it(tmp_path, monkeypatch, stack):
    from fdsched.serve import ports
    from fdsched.serve.pd import PdConfig, PdServedEngine

    monkeypatch.setattr(ports, "PORT_LOCK_DIR", str(tmp_path / "ports"))
    holder = PortLease(str(tmp_path / "ports"))
    assert holder.take(18104) is None
    eng = ServedEngine(EngineConfig(port=18100)) if stack == "one-instance" else PdServedEngine(PdConfig(port=18100))
    try:
        eng._lease = PortLease(str(tmp_path / "ports"))
        with pytest.raises(ServeError) as info:
            eng._allocate_ports()
        assert str(info.value).startswith(f"--port 18100: port 18104 is held by pid {os.getpid()}")
        assert "\n" not in str(info.value) and eng._lease.held == {} and eng.ports == []
        with pytest.raises(ServeError):  # the same through the context manager: nothing ran, nothing is kept
            eng.__enter__()
        assert not os.path.exists(eng.run_dir)
    finally:
        holder.release()
        eng.cleanup()


# ------------------------------------------------------------------------------------------------ /dev/shm
def test_stop_removes_only_what_the_stack_recorded_creating(tmp_path, monkeypatch):
    state = tmp_path / "state"
    shm = tmp_path / "shm"
    state.mkdir()
    shm.mkdir()
    monkeypatch.setenv(seams.STATE_ENV, str(state))
    ours, replaced, theirs = shm / "signal.18000", shm / "queue_18000.sock", shm / "signal.18001"
    for f in (ours, replaced, theirs):
        f.write_text("x")
    seams.record_created(str(ours), os.stat(ours).st_ino)
    seams.record_created(str(replaced), os.stat(replaced).st_ino)
    # gone, then the same name made by someone else: a different inode (kept open here so that this file system
    # cannot hand the number out again at once; /dev/shm's tmpfs numbers inodes from a counter)
    old = open(replaced)
    replaced.unlink()
    replaced.write_text("someone else's")
    assert sorted(p for p, _ in created_entries(str(state), still_there=True)) == [str(ours)]
    assert remove_created(str(state)) == [str(ours)]
    assert sorted(os.listdir(shm)) == ["queue_18000.sock", "signal.18001"]  # not ours: untouched, port or not
    old.close()


def test_the_ledger_records_creations_through_os_open_and_unix_binds(tmp_path, monkeypatch):
    import subprocess
    import sys

    state = tmp_path / "state"
    state.mkdir()
    name = f"fdsched-unit-{os.getpid()}"
    code = (f"import os, socket, sys; sys.path.insert(0, {os.path.dirname(os.path.dirname(seams.__file__))!r}); import seams; "
            "seams.record_creations(); "
            f"fd = os.open('/dev/shm/{name}.lock', os.O_CREAT | os.O_RDWR, 0o600); os.close(fd); "
            f"s = socket.socket(socket.AF_UNIX); s.bind('/dev/shm/{name}.sock'); s.close(); "
            f"fd = os.open('/dev/shm/{name}.lock', os.O_RDWR); os.close(fd)")  # opening again: not a creation
    env = dict(os.environ, **{seams.STATE_ENV: str(state)})
    try:
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
        recorded = sorted(p for p, _ in created_entries(str(state)))
        assert recorded == [f"/dev/shm/{name}.lock", f"/dev/shm/{name}.sock"]
        assert sorted(remove_created(str(state))) == recorded
    finally:
        for suffix in (".lock", ".sock"):
            if os.path.exists(f"/dev/shm/{name}{suffix}"):
                os.unlink(f"/dev/shm/{name}{suffix}")


def test_an_entry_whose_creator_died_before_recording_it_is_still_known_as_ours(tmp_path):
    """A process killed after the bind made the socket and before its record (here: SIGKILL inside the bind) leaves
    only the intent; the socket it made is still the stack's, and stop removes it."""
    import subprocess
    import sys

    state = tmp_path / "state"
    state.mkdir()
    path = f"/dev/shm/fdsched-unit-{os.getpid()}-dying.sock"
    code = (f"import os, signal, socket, sys; sys.path.insert(0, {os.path.dirname(os.path.dirname(seams.__file__))!r}); import seams; "
            "real = socket.socket.bind\n"
            "def dying_bind(self, address):\n"
            "    real(self, address); os.kill(os.getpid(), signal.SIGKILL)\n"
            "socket.socket.bind = dying_bind; seams.record_creations(); "
            f"socket.socket(socket.AF_UNIX).bind({path!r})")
    env = dict(os.environ, **{seams.STATE_ENV: str(state)})
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, timeout=60)
        assert done.returncode == -signal.SIGKILL and os.path.exists(path)
        ledger = [json.loads(line) for line in open(state / seams.SHM_LEDGER)]
        assert [set(rec) for rec in ledger] == [{"pid", "intent", "kind", "before"}]  # no record after the bind
        assert created_entries(str(state), still_there=True) == [(path, os.stat(path).st_ino)]
        assert remove_created(str(state)) == [path] and not os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_an_open_intent_claims_only_a_new_entry_of_its_kind(tmp_path, monkeypatch):
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv(seams.STATE_ENV, str(state))
    base = f"/dev/shm/fdsched-unit-{os.getpid()}"
    made = []

    def unix_socket(path):
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        s.close()
        made.append(path)
        return os.stat(path).st_ino

    try:
        before = unix_socket(base + "-there.sock")  # there before the call, and still the same: not the call's
        ledger._ledger_write({"intent": base + "-there.sock", "kind": "socket", "before": before})
        ledger._ledger_write({"intent": base + "-file.sock", "kind": "socket", "before": None})
        with open(base + "-file.sock", "w"):  # a regular file where a socket was to be made: not the call's
            made.append(base + "-file.sock")
        ledger._ledger_write({"intent": base + "-failed.sock", "kind": "socket", "before": None})
        ledger._ledger_write({"failed": base + "-failed.sock"})
        unix_socket(base + "-failed.sock")  # the call failed: what is there now was made by someone else
        ledger._ledger_write({"intent": base + "-new.sock", "kind": "socket", "before": before})
        new = unix_socket(base + "-new.sock")
        assert created_entries(str(state), still_there=True) == [(base + "-new.sock", new)]
        assert remove_created(str(state)) == [base + "-new.sock"]
        assert all(os.path.exists(p) for p in made if not p.endswith("-new.sock"))
    finally:
        for p in made:
            if os.path.exists(p):
                os.unlink(p)


# ------------------------------------------------------------------------------------------------ checks
@pytest.mark.parametrize("config,expected", [
    (EngineConfig(dp=0), "--dp 0: allowed: an integer >= 1"),
    (EngineConfig(arms="0=baseline,1=recommended"), "needs --dp >= 2"),
    (EngineConfig(dp=2, arms="0=baseline,5=recommended"), "rank 5 does not exist with --dp 2; allowed: ranks 0-1"),
    (EngineConfig(profile="nosuch"), "--profile: profile: bad value 'nosuch' (unknown profile)"),
    (EngineConfig(port=80), "--port 80: allowed: 1024-"),
    (EngineConfig(num_gpu_blocks=0), "--num-gpu-blocks 0: allowed: an integer >= 1"),
    (EngineConfig(health_timeout=0), "--health-timeout 0: allowed: seconds > 0"),
])
def test_each_bad_setting_is_one_line_before_anything_starts(config, expected):
    problems = check_config(config)
    assert any(expected in p for p in problems), problems
    assert all("\n" not in p for p in problems)


def test_a_bad_fdsched_variable_is_one_line_for_every_arm(monkeypatch):
    monkeypatch.setenv("FDSCHED_ADAPTIVE_WINDOW", "abc")
    problems = check_config(EngineConfig(dp=2, arms="0=baseline,1=recommended"))
    assert problems == ["environment variable FDSCHED_ADAPTIVE_WINDOW: bad value 'abc'; allowed: an integer >= 1 (at most 2147483647)"]


def _serve_args(*argv):
    from fdsched.tools.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_serve_flags_are_all_checked_before_start_up():
    from fdsched.serve.cli import check_serve_args

    problems, _trace, _configs = check_serve_args(_serve_args(
        "--time-scale", "-1", "--drain-timeout", "-2", "--dp", "2", "--arms", "0=baseline,5=recommended",
        "--time-schedule"))
    text = "\n".join(problems)
    for expected in ("--time-scale -1.0: allowed: a number > 0", "--drain-timeout -2.0: allowed: seconds >= 0",
                     "rank 5 does not exist with --dp 2", "--time-schedule: allowed only with --trace"):
        assert expected in text, text


def test_arms_without_ranks_run_in_turn_on_a_trace():
    from fdsched.serve.cli import check_serve_args
    from fdsched.serve.preflight import sequential_arms

    args = _serve_args("--arms", "baseline,recommended", "--trace", "azure-conv")
    problems, trace, configs = check_serve_args(args)
    assert problems == [] and sequential_arms(args) == ["baseline", "recommended"]
    assert [c.profile for c in configs] == ["baseline", "recommended"] and all(c.dp == 1 for c in configs)
    assert configs[0].num_gpu_blocks == trace.engine["num_gpu_blocks"]  # the trace header's shape
    problems, _t, _c = check_serve_args(_serve_args("--arms", "baseline,recommended"))
    assert any("add --trace" in p for p in problems), problems
    problems, _t, _c = check_serve_args(_serve_args("--arms", "baseline,recommended", "--trace", "azure-conv",
                                                    "--dp", "2"))
    assert any("--dp 2" in p for p in problems), problems


def test_a_port_in_use_is_found_before_start_up():
    from fdsched.serve.cli import check_serve_args
    from fdsched.serve.ports import PortLease, free_ports

    lease = PortLease()  # ports no other fdsched stack takes meanwhile (the engine tier's run beside this one)
    port = free_ports(7, lease=lease)[0]
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port + 3))
            s.listen()
        finally:
            lease.release()
        problems, _t, _c = check_serve_args(_serve_args("--port", str(port)))
    assert problems == [f"--port {port}: port {port + 3} is in use (the stack needs ports {port}-{port + 5}); "
                        "allowed: a first port whose 6 ports are free"]


# ------------------------------------------------------------------------------------------------ deaths
def test_a_dead_process_is_named_by_rank_role_and_signal():
    assert Death(1, "worker", 42, -signal.SIGKILL).text() == "rank 1 worker (pid 42) was killed by SIGKILL"
    assert Death(0, "api_server", 7, 1).text() == "rank 0 api_server (pid 7) exited with code 1"
    assert Death(None, "router", 9, -15).text() == "router (pid 9) was killed by SIGTERM"
    assert "is gone" in Death(0, "engine process", 5, None).text()


def test_check_alive_names_the_first_death_and_the_hosts_message():
    eng = ServedEngine(EngineConfig(dp=2, arms="0=baseline,1=recommended"))
    try:
        eng.check_alive()
        for pid, role, rank, code, when in ((11, "api_server", 1, 1, 2.0), (10, "worker", 1, -9, 1.0)):
            with open(os.path.join(eng.state_dir, "exits", f"{role}-{pid}.json"), "w") as fh:
                json.dump({"pid": pid, "role": role, "rank": rank, "code": code, "time": when}, fh)
        with open(os.path.join(eng.log_dir, "multi_api_server.out"), "w") as fh:
            fh.write("Traceback (most recent call last):\n  File x\nAssertionError: prefill_kvcache_block_num: 64 "
                     "should be larger than or equal to 66\n")
        with pytest.raises(ServeError) as info:
            eng.check_alive()
        assert str(info.value) == ("rank 1 worker (pid 10) was killed by SIGKILL; then rank 1 api_server (pid 11) "
                                   "exited with code 1; the host said: AssertionError: prefill_kvcache_block_num: 64 "
                                   "should be larger than or equal to 66")
    finally:
        eng.cleanup()


# ------------------------------------------------------------------------------------------------ drain gate
def _run_gate(tmp_path, monkeypatch, scenario):
    state = tmp_path / "state"
    (state / seams.DRAIN_DIR).mkdir(parents=True)
    monkeypatch.setattr(drain, "_GATE", {})
    release = asyncio.Event()

    async def app(scope, receive, send):  # a streaming completion that waits until released
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: {\"n\": 1}\n\n", "more_body": True})
        await release.wait()
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    gate = drain._DrainGate(app, str(state))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions"}

    async def main():
        sent = []

        async def send(message):
            sent.append(message)

        task = asyncio.ensure_future(gate(scope, None, send))
        await asyncio.sleep(0.1)
        await scenario(state, release)
        await asyncio.wait_for(task, 10)
        refused = []

        async def send2(message):
            refused.append(message)

        await gate(scope, None, send2)
        st = drain._GATE["gate"]
        st.closed = True
        return sent, refused, {k: getattr(st, k) for k in ("in_flight", "finished", "ended", "refused")}

    return asyncio.run(main())


def test_the_drain_gate_ends_a_stream_in_flight_with_a_readable_error(tmp_path, monkeypatch):
    async def scenario(state, release):
        seams.request_drain(str(state))
        await asyncio.sleep(0.3)
        assert seams.drain_counts(str(state))["in_flight"] == 1
        seams.request_abort(str(state))

    sent, refused, counts = _run_gate(tmp_path, monkeypatch, scenario)
    body = b"".join(m.get("body", b"") for m in sent)
    assert body.endswith(b"data: [DONE]\n\n") and b"server_shutdown" in body and not sent[-1]["more_body"]
    assert refused[0]["status"] == 503 and b"not admitting" in refused[1]["body"]
    assert counts == {"in_flight": 0, "finished": 0, "ended": 1, "refused": 1}


def test_the_drain_gate_lets_a_request_in_flight_finish(tmp_path, monkeypatch):
    async def scenario(state, release):
        seams.request_drain(str(state))
        await asyncio.sleep(0.3)
        release.set()

    sent, _refused, counts = _run_gate(tmp_path, monkeypatch, scenario)
    assert sent[-1]["body"] == b"data: [DONE]\n\n" and b"server_shutdown" not in b"".join(m.get("body", b"") for m in sent)
    assert counts["finished"] == 1 and counts["ended"] == 0


def test_a_gate_first_used_after_the_drain_refuses_at_once(tmp_path, monkeypatch):
    # an api_server runs several worker processes, each with a gate made on its own first request: a worker that had
    # served nothing before the drain must refuse too (a PD decode instance that admits it waits for KV for ever)
    state = tmp_path / "state"
    (state / seams.DRAIN_DIR).mkdir(parents=True)
    seams.request_drain(str(state))
    monkeypatch.setattr(drain, "_GATE", {})
    called = []

    async def app(scope, receive, send):
        called.append(scope)

    async def main():
        sent = []

        async def send(message):
            sent.append(message)

        await drain._DrainGate(app, str(state))({"type": "http", "method": "POST", "path": "/v1/completions"}, None,
                                                 send)
        drain._GATE["gate"].closed = True
        return sent

    sent = asyncio.run(main())
    assert not called and sent[0]["status"] == 503 and b"not admitting" in sent[1]["body"]
    assert drain._GATE["gate"].refused == 1


# ------------------------------------------------------------------------------------------------ signals
def test_the_first_signal_while_serving_asks_for_a_drain_the_second_stops():
    from fdsched.serve.cli import _Signals

    s = _Signals()
    s.serving = True
    s(signal.SIGTERM, None)
    assert s.received == signal.SIGTERM
    with pytest.raises(KeyboardInterrupt):
        s(signal.SIGINT, None)
    starting = _Signals()
    with pytest.raises(KeyboardInterrupt):
        starting(signal.SIGINT, None)


# ------------------------------------------------------------------------------------------------ report
def _report(traffic_mode, traffics, ttfts):
    from fdsched.serve.served_report import BETTER

    base = {"ttft_ms_p50": 1000.0, "e2e_ms_p99": 5000.0, "stall_ms_p99": 100.0, "throughput_tokens_per_s": 100.0,
            "preemptions_prefill_victims": 1, "requests_finished": 150}
    profiles = [{"profile": name, "url": "http://x", "errors": [], "traffic": traffic,
                 "server": {"plugin_arms_on_metrics": [], "scrape_error": None},
                 "figures": dict(base, ttft_ms_p50=ttft)}
                for name, traffic, ttft in zip(("baseline", "recommended"), traffics, ttfts)]
    return {"profiles": profiles, "better": BETTER, "trace": {"name": "t", "requests": 191},
            "load": {"time_scale": 1.0, "step_ms": None, "split_seed": 0, "traffic": traffic_mode}}


def test_split_traffic_is_said_first_and_a_verdict_smaller_than_it_is_withheld():
    from fdsched.serve.served_report import format_served_table

    a = {"requests": 101, "input_tokens": 50_000, "output_tokens": 25_376}
    b = {"requests": 90, "input_tokens": 45_000, "output_tokens": 18_853}
    text = format_served_table(_report("split", [a, b], [1000.0, 900.0]))  # effect 10%, traffic 26% apart
    assert text.startswith("traffic: NOT identical")
    assert "recommended vs baseline: no verdict: the traffic differs by more than the largest effect\n" \
           "      its traffic differs from baseline's by 26% (output tokens), more than the largest effect (10%)\n" \
           "      figures: throughput same, TTFT p50 -10%" in text
    assert max(len(line) for line in text.split("verdict (")[1].splitlines()) <= 100
    text = format_served_table(_report("split", [a, b], [1000.0, 400.0]))  # effect 60%
    assert "recommended vs baseline, better: " in text
    assert " ".join(text.split()).endswith("traffic differs by 26% (output tokens): the verdict reads only TTFT p50, "
                                           "not E2E p99, stall p99 (within the difference)")
    assert max(len(line) for line in text.split("verdict (")[1].splitlines()) <= 100


def test_identical_traffic_gets_the_verdict():
    from fdsched.serve.served_report import format_served_table

    a = {"requests": 191, "input_tokens": 95_000, "output_tokens": 44_229}
    text = format_served_table(_report("identical", [a, dict(a)], [1000.0, 990.0]))
    assert text.startswith("traffic: identical: every arm got the same requests at the same arrival times")
    assert "recommended vs baseline, same" in text and "no verdict" not in text


def test_a_change_within_the_references_run_to_run_noise_is_not_read_as_an_effect():
    """The reference ran twice: its stall p99 moved 90% between its runs, its TTFT p50 5%. recommended's stall p99
    +60% is within that noise and left out of the word; its TTFT p50 -50% is beyond it: better, not mixed."""
    from fdsched.serve.served_report import format_served_table, noise_band

    a = {"requests": 191, "input_tokens": 95_000, "output_tokens": 44_229}
    report = _report("identical", [a, dict(a)], [1000.0, 500.0])
    report["profiles"][1]["figures"]["stall_ms_p99"] = 160.0
    report["reference_repeat"] = {"profile": "baseline", "traffic": dict(a),
                                  "figures": dict(report["profiles"][0]["figures"], ttft_ms_p50=1050.0,
                                                  stall_ms_p99=190.0)}
    band = noise_band(report)
    assert round(band["stall_ms_p99"], 2) == 0.9 and round(band["ttft_ms_p50"], 2) == 0.05
    text = format_served_table(report)
    assert "run-to-run noise: baseline ran again after the other arms:\n  TTFT p50 1000.0 then 1050.0 (+5%)" in text
    assert "recommended vs baseline, better: " in text
    assert " ".join(text.split()).endswith("within run-to-run noise, not read: E2E p99 (noise 0%), stall p99 (noise "
                                           "90%)")
    assert max(len(line) for line in text.split("verdict (")[1].splitlines()) <= 100
    # without the repeat, the same figures are mixed
    del report["reference_repeat"]
    assert "recommended vs baseline, mixed: " in format_served_table(report)
    # every change within the noise: no verdict
    report["reference_repeat"] = {"profile": "baseline", "traffic": dict(a),
                                  "figures": dict(report["profiles"][0]["figures"], ttft_ms_p50=400.0,
                                                  stall_ms_p99=190.0)}
    text = format_served_table(report)
    assert "recommended vs baseline: no verdict: every change is within baseline's run-to-run noise\n" \
           "      noise: TTFT p50 (noise 60%)" in text
    assert max(len(line) for line in text.split("verdict (")[1].splitlines()) <= 100


def test_load_options_are_all_checked_before_any_server_is_contacted(capsys):
    from fdsched.tools.cli import main

    code = main(["load", "--url", "localhost:1", "--arm", "a", "--arm", "b", "--trace", "azure-conv",
                 "--time-scale", "0", "--request-timeout", "-1"])
    err = capsys.readouterr().err.splitlines()
    assert code == 1 and len(err) == 4, err
    assert all(line.startswith("fdsched load: error: --") for line in err)


def test_two_launchers_write_the_model_directory_at_once(tmp_path):
    import threading

    from fdsched.serve.model import make_model

    target = str(tmp_path / "tinymodel")
    got = []
    threads = [threading.Thread(target=lambda: got.append(make_model(target))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [target] * 4
    assert sorted(os.listdir(target)) == [".complete", "config.json", "generation_config.json",
                                          "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    assert os.listdir(tmp_path) == ["tinymodel"]  # no private copy left beside it
    with open(os.path.join(target, "config.json")) as fh:
        assert json.load(fh)["model_type"] == "qwen2"


def test_an_exit_status_is_learnt_even_when_another_waiter_reaps_the_child_first():
    """A killed child reaped by someone else's waitpid: Popen.wait alone says 0; the watcher's status says the
    signal (it waits without reaping: waitid WNOWAIT), and a plain exit keeps its code."""
    import signal
    import subprocess
    import sys
    import threading

    from fdsched.serve.seams import exit_status

    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    result = {}
    watcher = threading.Thread(target=lambda: result.setdefault("code", exit_status(killed)))
    watcher.start()
    os.kill(killed.pid, signal.SIGKILL)
    watcher.join(10)
    assert result["code"] == -signal.SIGKILL
    plain = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert exit_status(plain) == 3
    # the other way round: reaped first by another waiter, the status is lost -- and said to be (Popen.wait would
    # report a made-up 0)
    other = subprocess.Popen([sys.executable, "-c", "raise SystemExit(5)"])
    os.waitpid(other.pid, 0)
    assert exit_status(other) is None


def test_the_worker_launcher_records_the_signal_that_killed_a_rank_and_ends_the_same_way(tmp_path):
    """worklaunch.py is the one waiter of the workers it starts: SIGKILL of rank 1 is recorded as such in the
    stack's exits records, rank 0 is stopped (and recorded), and the launcher itself ends killed by SIGKILL, as
    the rank did -- whoever else waits for the launcher."""
    import glob
    import json
    import signal
    import subprocess
    import sys
    import time

    import fdsched.serve.worklaunch as worklaunch

    (tmp_path / "exits").mkdir()
    sleeper = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]
    spec = [{"rank": r, "cmd": sleeper, "log": str(tmp_path / f"w{r}.log")} for r in range(2)]
    env = dict(os.environ, FDSCHED_SERVE_WORKERS=json.dumps(spec), FDSCHED_SERVE_STATE_DIR=str(tmp_path))
    launcher = subprocess.Popen([sys.executable, "-u", worklaunch.__file__], env=env, stdout=subprocess.PIPE,
                                stderr=open(tmp_path / "launch.log", "wb"))
    assert launcher.stdout.readline() == b"up\n"  # rank 0's stdout is the launcher's
    import psutil

    deadline = time.monotonic() + 10
    while len(psutil.Process(launcher.pid).children()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    ranks = {}
    for child in psutil.Process(launcher.pid).children():
        ranks[len(ranks)] = child.pid  # started in rank order
    os.kill(ranks[1], signal.SIGKILL)
    assert launcher.wait(20) == -signal.SIGKILL
    records = {}
    for path in glob.glob(str(tmp_path / "exits" / "*.json")):
        with open(path) as fh:
            d = json.load(fh)
        records[d["rank"]] = d
    assert records[1] == dict(records[1], pid=ranks[1], role="worker", code=-signal.SIGKILL)
    assert records[0]["pid"] == ranks[0] and records[0]["code"] == -signal.SIGTERM
    assert records[1]["time"] <= records[0]["time"]
    assert not psutil.pid_exists(ranks[0]) or psutil.Process(ranks[0]).status() == psutil.STATUS_ZOMBIE
