"""The PD stack's pieces that need no host: --role-profiles, the checks before start, the seam-S12 shape check, and
the simulated cache messager's task bookkeeping and transfer against a real ZeroMQ receiver."""

from __future__ import annotations

import threading
import types

import pytest

from fdsched.serve import pdxfer
from fdsched.serve.pd import PdConfig, instance_profiles, parse_role_profiles, pd_config_problems
from fdsched.serve.pd_checks import pd_seam_problems


def test_role_profiles_parse_and_name_what_is_wrong():
    assert parse_role_profiles("prefill=pd_prefill_cache, decode=baseline") == {
        "prefill": "pd_prefill_cache", "decode": "baseline"}
    with pytest.raises(ValueError, match=r"unknown role 'prefil' \(did you mean 'prefill'\?\); allowed: prefill, "
                                         r"decode"):
        parse_role_profiles("prefil=baseline")
    with pytest.raises(ValueError, match="role 'decode' named twice"):
        parse_role_profiles("decode=a,decode=b")
    with pytest.raises(ValueError, match="bad item 'decode'"):
        parse_role_profiles("decode")


def test_each_instance_gets_its_roles_profile_else_the_common_one():
    c = PdConfig(prefill=2, decode=1, profile="recommended", role_profiles="prefill=pd_prefill_cache")
    assert instance_profiles(c) == [("prefill 0", "prefill", "pd_prefill_cache"),
                                    ("prefill 1", "prefill", "pd_prefill_cache"), ("decode 0", "decode", "recommended")]


def test_pd_config_problems_are_one_line_each():
    problems = pd_config_problems(PdConfig(prefill=0, decode=1, dp=2, arms="0=a,1=b", num_cpu_blocks=8,
                                           role_profiles="decode=recomended"))
    text = "\n".join(problems)
    assert "--prefill 0: allowed: 1-4 instances" in text
    assert "--dp 2 with --prefill/--decode: allowed: --dp 1" in text
    assert "--arms '0=a,1=b' with --prefill/--decode" in text
    assert "--num-cpu-blocks 8 with --prefill/--decode: allowed: 0" in text
    assert "--role-profiles decode: profile: bad value 'recomended'" in text and "did you mean recommended" in text
    assert pd_config_problems(PdConfig(prefill=1, decode=1, role_profiles="prefill=baseline")) == []


def test_a_role_profile_with_a_bad_cost_model_is_refused_before_start(tmp_path):
    profile = tmp_path / "warp.yaml"
    profile.write_text("replay:\n  cost_model: warp-drive\n")
    problems = pd_config_problems(PdConfig(prefill=1, decode=1, role_profiles=f"decode={profile}"))
    assert len(problems) == 1 and problems[0].startswith("--role-profiles decode:"), problems
    assert "replay.cost_model" in problems[0] and "'warp-drive'" in problems[0] and "allowed: linear" in problems[0]


class _Cache:
    def launch_cache_messager(self, cache_config, tensor_parallel_size, device_ids, key_cache_shape,
                              value_cache_shape, pod_ip, engine_worker_queue_port, ipc_suffix):
        pass


class _Queue:
    def get_cache_info(self):
        pass

    def put_finished_req(self, send_cache_result):
        pass

    def get_finished_req(self):
        pass


class _Connector:
    def send_cache_info_to_messager(self, tasks, current_id):
        pass

    def send_cache_info_to_prefill(self, tasks):
        pass


_Router = types.SimpleNamespace(__dataclass_fields__={"splitwise": None})


def test_seam_s12_checks_the_host_calls_it_stands_in_for():
    assert pd_seam_problems(_Cache, _Queue, _Router, _Connector) == []

    class OtherQueue(_Queue):
        def put_finished_req(self, request_id, status):  # another arity
            pass

    class NoCacheInfo:
        put_finished_req = _Queue.put_finished_req
        get_finished_req = _Queue.get_finished_req

    problems = pd_seam_problems(_Cache, OtherQueue, types.SimpleNamespace(__dataclass_fields__={}), _Connector)
    assert "the host's EngineWorkerQueue.put_finished_req takes (request_id, status), the simulation expects " \
           "(send_cache_result) (seam S12)" in problems
    assert "the host's Router has no splitwise mode (RouterArgs.splitwise)" in problems
    assert any("has no EngineWorkerQueue.get_cache_info" in p for p in pd_seam_problems(_Cache, NoCacheInfo, _Router,
                                                                                         _Connector))


class _FakeEngineQueue:
    """The engine's side of EngineWorkerQueue as the messager sees it: cache infos in, finished results out."""

    def __init__(self, batches):
        self.batches = list(batches)
        self.finished = []
        self.acked = []

    def get_cache_info(self):
        return self.batches.pop(0) if self.batches else []

    def put_finished_req(self, result):
        self.finished.extend(result)

    def put_finished_add_cache_task_req(self, ids):  # the old host waits for this
        self.acked.extend(ids)


def _receiver(zmq, ctx, answers):
    """A decode messager's receiver on a thread that owns its socket; set the returned event to stop it."""
    sock = ctx.socket(zmq.REP)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            if sock.poll(50):
                answers.append(sock.recv_pyobj())
                sock.send_pyobj("ok")
        sock.close(linger=0)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return (stop, thread), port


def _messager(queue):
    a = types.SimpleNamespace(rank=0, pod_ip="127.0.0.1")
    lines = []
    return pdxfer.Messager(a, queue, block_size=16, num_blocks=64, log=lines.append), lines


def test_messager_merges_both_halves_then_sends_what_each_step_completed():
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    writes = []
    sock, port = _receiver(zmq, ctx, writes)
    decode_half = [{"request_id": "r1", "dest_block_ids": [7, 8, 9, 10]}]
    prefill_half = [{"request_id": "r1", "src_block_ids": [1, 2, 3, 4], "current_id": 3, "need_prefill_tokens": 50,
                     "decode_ip": "127.0.0.1", "decode_rdma_ports": [str(port)]}]
    queue = _FakeEngineQueue([decode_half, prefill_half])
    m, _lines = _messager(queue)
    m.ms_per_block = 0.0
    assert m.take_cache_infos() and queue.acked == []  # one half: not a task yet
    assert m.take_cache_infos() and queue.acked == ["r1"]
    sockets = {}
    m.on_progress(3, 32, zmq, ctx, sockets)  # a chunk of 32 tokens: two whole blocks
    assert [w["dest_block_ids"] for w in writes] == [[7, 8]] and queue.finished == []
    m.on_progress(3, 50, zmq, ctx, sockets)  # the whole prompt: the rest, then the host's finished result
    assert [w["dest_block_ids"] for w in writes] == [[7, 8], [9, 10]]
    assert queue.finished == [["r1", "finished"]] and m.sent_blocks == 4
    _close(sock, sockets, ctx)


def test_messager_reports_connection_error_when_the_decode_does_not_answer(monkeypatch):
    zmq = pytest.importorskip("zmq")
    monkeypatch.setattr(pdxfer, "SEND_TIMEOUT_MS", 200)
    ctx = zmq.Context()
    free = ctx.socket(zmq.REP)
    port = free.bind_to_random_port("tcp://127.0.0.1")
    free.close()  # nobody listens there now
    queue = _FakeEngineQueue([[{"request_id": "r2", "dest_block_ids": [5], "src_block_ids": [1], "current_id": 0,
                                "need_prefill_tokens": 10, "decode_ip": "127.0.0.1",
                                "decode_rdma_ports": [str(port)]}]])
    m, lines = _messager(queue)
    m.take_cache_infos()
    sockets = {}
    m.on_progress(0, 10, zmq, ctx, sockets)
    assert queue.finished == [["r2", "connection error"]]
    assert m.failures == 1 and any("write to tcp://127.0.0.1:" in line for line in lines)
    for s in sockets.values():
        s.close(linger=0)
    ctx.term()


def test_a_held_write_waits_for_the_hold_file_then_goes(tmp_path, monkeypatch):
    zmq = pytest.importorskip("zmq")
    monkeypatch.setenv(pdxfer.STATE_ENV, str(tmp_path))
    ctx = zmq.Context()
    writes = []
    sock, port = _receiver(zmq, ctx, writes)
    queue = _FakeEngineQueue([[{"request_id": "r3", "dest_block_ids": [4, 5], "src_block_ids": [1, 2],
                                "current_id": 1, "need_prefill_tokens": 20, "decode_ip": "127.0.0.1",
                                "decode_rdma_ports": [str(port)]}]])
    m, lines = _messager(queue)
    m.ms_per_block = 0.0
    m.take_cache_infos()
    hold = pdxfer.hold_path(str(tmp_path))
    open(hold, "w").close()
    sockets = {}
    writer = threading.Thread(target=m.on_progress, args=(1, 20, zmq, ctx, sockets))
    writer.start()
    writer.join(0.3)
    assert writer.is_alive() and writes == [] and queue.finished == []
    assert lines[-1] == "task r3: write of 2 blocks held (kv-hold)"
    import os

    os.remove(hold)
    writer.join(5)
    assert [w["dest_block_ids"] for w in writes] == [[4, 5]] and queue.finished == [["r3", "finished"]]
    _close(sock, sockets, ctx)


def test_the_messager_sees_its_engine_gone_through_the_hosts_shell():
    """The host starts the messager as ``sh -c "python cache_messager.py ..."`` in a session of its own: when the
    engine is killed the shell stays the messager's parent, and the engine stays a zombie until it is reaped. The
    messager's watch reads the engine behind the shell and takes a zombie for gone."""
    import os
    import subprocess
    import sys
    import time

    child = os.path.join(os.path.dirname(pdxfer.__file__), "pdxfer.py")
    probe = (f"import importlib.util, sys, time; s = importlib.util.spec_from_file_location('x', {child!r}); "
             "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); alive = m._engine_watch(); "
             "print('up', alive(), flush=True)\nwhile alive(): time.sleep(0.02)\nprint('gone', flush=True)")
    engine_code = ("import subprocess, sys, time; p = subprocess.Popen(['sh', '-c', sys.argv[1] + ' ; true']); "
                   "time.sleep(60)")
    cmd = f"{sys.executable} -c \"{probe}\""
    import select

    def line(timeout=10.0):
        ready, _w, _x = select.select([engine.stdout], [], [], timeout)
        return engine.stdout.readline().strip() if ready else "(nothing within 10 s)"

    out = open(os.devnull, "w")
    engine = subprocess.Popen([sys.executable, "-c", engine_code, cmd], stdout=subprocess.PIPE, text=True,
                              stderr=out, start_new_session=True)
    try:
        assert line() == "up True"
        os.kill(engine.pid, 9)
        time.sleep(0.3)  # not reaped yet: a zombie
        assert line() == "gone"
    finally:
        os.killpg(engine.pid, 9)  # the shell and the probe too, whatever happened
        engine.wait()
        out.close()
    assert pdxfer._start_time(os.getpid()) is not None and pdxfer._start_time(engine.pid) is None


def test_a_stalled_decode_is_named_in_one_line_with_what_it_holds():
    from fdsched.serve.pd_burst import stall_line

    logs = {"engine": "D has successfully added prefilled request, r1_0\nD has successfully added prefilled request, "
                      "r2_0\nD has successfully added prefilled request, r3_0\nPreemption is triggered! Preempted "
                      "request id: r3_0\n",
            "worker": "request r1_0: prompt 40 tokens, max_tokens 150\n"}
    state = {"running": 1, "free": list(range(43)), "request_blocks": [1, 2, 3, 4, 5]}
    line = stall_line("decode 0", state, logs, 10)
    assert line.startswith("decode 0 stalled for 10 s: its 1 running request(s) are prefilled ones it never stepped")
    assert "holding 5 blocks with 43 free" in line and "\n" not in line
    # a request the worker was handed is not one of them: the plain line
    state["running"] = 2
    assert stall_line("decode 0", state, logs, 10) == ("decode 0 stalled for 10 s: 2 running request(s), 5 blocks "
                                                        "held, 43 free, no answer and no change")


def test_a_burst_run_reads_ttft_from_the_prefill_log_of_the_attempt_that_completed(tmp_path):
    import time as _time

    from fdsched.serve.pd_burst import _figures, format_burst_table

    sent = _time.mktime(_time.strptime("2026-11-28 09:00:00", "%Y-%m-%d %H:%M:%S"))
    pdir, ddir = tmp_path / "p", tmp_path / "d"
    pdir.mkdir()
    ddir.mkdir()
    (pdir / "fastdeploy.log").write_text(
        "INFO     2026-11-28 09:00:00,100 1 token_processor.py[line:1] Request=cmpl-a_0, TTFT=0.1, IsPrefill=True\n"
        "INFO     2026-11-28 09:00:01,250 1 token_processor.py[line:1] Request=cmpl-a-retry1_0, IsPrefill=True\n")
    (ddir / "fastdeploy.log").write_text("Preemption is triggered! Preempted request id: cmpl-a_0\n")
    eng = types.SimpleNamespace(instances=[{"log_dir": str(pdir)}, {"log_dir": str(ddir), "name": "decode 0"}])
    results = [{"sent": sent, "end": sent + 2.0, "status": 200,
                "doc": {"id": "cmpl-a-retry1", "choices": [{"finish_reason": "length"}]}},
               {"sent": sent, "end": sent + 1.0, "status": 200,
                "doc": {"id": "cmpl-b", "choices": [{"finish_reason": "pd_reschedule"}]}},
               {"sent": sent, "end": sent + 1.0, "status": None, "doc": {"raw": "ConnectionResetError"}},
               {"sent": sent, "end": sent + 1.0, "status": 200, "doc": {"error": {"message": "PD Error: decode does "
                                                                                "not have enough blocks"}}},
               {"sent": sent, "end": sent + 1.0, "status": 500, "doc": {"raw": "Internal Server Error"}},
               {"rid": "a", "sent": sent, "end": sent + 1.0, "status": 500, "doc": {"raw": "Internal Server Error"}}]
    row = _figures(eng, "baseline", 1, results, "decode 0 stalled", 3.0)
    assert [row[k] for k in ("completed", "pd_reschedule", "cut", "preempted_error", "errors", "retried",
                             "preemptions")] == [1, 1, 1, 2, 1, 1, 1]
    assert row["error_sample"] == 'HTTP 500: {"raw": "Internal Server Error"}'
    assert row["ttft_ms_p50"] == pytest.approx(1250) and row["e2e_ms_p50"] == pytest.approx(2000)
    table = format_burst_table([row])
    assert "| baseline | 1 | after 3 s | 1 | 1 | 1 | 2 | 1 | 1 | 1 | 1250 | 1250 | 2000 | 2000 | 3.0 |" in table
    # not stalled: a dropped connection is an error like any other
    assert _figures(eng, "baseline", 1, results[2:3], "", 1.0)["errors"] == 1
    # stopped at the stall before the error answers arrived: every one of them is cut (a preempted request that was
    # retried and is stuck is answered 500 as the stack goes), completed and pd_reschedule answers stand
    row = _figures(eng, "baseline", 1, results, "decode 0 stalled", 3.0, stopped_at=sent + 0.5)
    assert [row[k] for k in ("completed", "pd_reschedule", "cut", "preempted_error", "errors")] == [1, 1, 4, 0, 0]
    assert row["error_sample"] == ""
    assert _figures(eng, "baseline", 1, results[4:], "decode 0 stalled", 3.0, stopped_at=sent + 1.5)["errors"] == 1


def test_the_bench_refuses_a_profile_with_a_bad_cost_model_before_any_stack(tmp_path):
    import argparse

    from fdsched.serve.pd_bench import add_arguments, check_args

    profile = tmp_path / "warp.yaml"
    profile.write_text("replay:\n  cost_model: warp-drive\n")
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    problems, plan = check_args(ap.parse_args(["--burst", "2", "--decode-profiles", f"baseline,{profile}"]))
    assert len(problems) == 1 and problems[0].startswith("--decode-profiles: "), problems
    assert "replay.cost_model" in problems[0] and "'warp-drive'" in problems[0] and "allowed: linear" in problems[0]
    assert plan["roles"] == {"prefill": ["baseline"], "decode": ["baseline", str(profile)]}
    assert plan["shape"]["num_gpu_blocks"] == 48 and (plan["prompt_tokens"], plan["max_tokens"]) == (40, 150)


def test_a_request_counts_as_preempted_by_its_own_id_or_a_retry_of_it():
    from fdsched.serve.pd_burst import _was_preempted

    assert _was_preempted("pdb1-1", {"cmpl-pdb1-1_0"}) and _was_preempted("pdb1-1", {"cmpl-pdb1-1-retry2_0"})
    assert not _was_preempted("pdb1-1", {"cmpl-pdb1-10_0", "cmpl-pdb1-1x_0"}) and not _was_preempted(None, set())


def _close(sock, sockets, ctx) -> None:
    """Stop the fake decode receiver's thread, then close the messager's sockets and the ZMQ context."""
    stop, thread = sock
    stop.set()
    thread.join()
    for s in sockets.values():
        s.close(linger=0)
    ctx.term()
