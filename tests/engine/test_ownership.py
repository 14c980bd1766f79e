"""A stack owns what it started: its ports (a second launcher on the same --port fails at once, naming the port,
and cannot harm the first), its /dev/shm entries (removed by the ledger of what its processes created), and its
shutdown (a drain: new requests refused, requests in flight ended with an error event a client can read).

One stack serves every check here (a single-rank start costs ~30-40 s on a loaded 2-core machine)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from fdsched.serve.model import prompt_of_length

from .helpers import _conn, complete, leftovers

SHAPE = dict(profile="recommended", num_gpu_blocks=48, block_size=16, max_model_len=512, max_num_seqs=16,
             max_num_batched_tokens=256)


def _stream_raw(url: str, max_tokens: int, out: dict, key: str) -> None:
    conn = _conn(url, timeout=120)
    body = json.dumps({"model": "default", "prompt": prompt_of_length(40, seed=7), "max_tokens": max_tokens,
                       "stream": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    events = [line[5:].strip() for line in resp.read().decode(errors="replace").splitlines() if line.startswith("data:")]
    out[key] = (resp.status, events)
    conn.close()


def test_two_stacks_on_one_port_then_a_drain():
    from fdsched.serve.config import EngineConfig, ServeError
    from fdsched.serve.launcher import ServedEngine
    from fdsched.serve.ports import PortLease, free_ports

    lease = PortLease()  # no other fdsched stack takes them until both stacks are made
    try:
        port = free_ports(7, lease=lease)[0]  # a stack of one rank needs 6 ports; one spare
        stacks = [ServedEngine(EngineConfig(port=port, **SHAPE)) for _ in range(2)]
    finally:
        lease.release()
    outcome = {}

    def start(i):
        try:
            stacks[i].__enter__()
            outcome[i] = "up"
        except ServeError as exc:
            outcome[i] = exc
        except BaseException as exc:  # noqa: BLE001 (reported by the assertion below)
            outcome[i] = exc

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join(timeout=400)
        assert sorted(str(type(o).__name__) if o != "up" else "up" for o in outcome.values()) == ["ServeError", "up"], outcome
        winner = next(stacks[i] for i, o in outcome.items() if o == "up")
        loser_index = next(i for i, o in outcome.items() if o != "up")
        message = str(outcome[loser_index])
        assert "\n" not in message and f"port {port} is held by" in message and f"--port {port}" in message, message
        assert winner.ports[0] == port and stacks[loser_index].ports == []

        # the first stack is unharmed: it still serves
        assert complete(winner.urls[0], prompt_of_length(50, seed=1), 8)["finish_reason"] == "length"

        # a drain: a long stream in flight, then new requests are refused and the stream ends with an error event
        got = {}
        streaming = threading.Thread(target=_stream_raw, args=(winner.urls[0], 400, got, "long"))
        streaming.start()
        time.sleep(1.0)
        counts = winner.drain(0.5)
        refused = complete(winner.urls[0], prompt_of_length(50, seed=2), 8, stream=False)
        streaming.join(timeout=60)
        status, events = got["long"]
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        assert last["error"]["type"] == "server_shutdown", last
        assert refused["status"] == 503 and "shutting down" in refused["error"], refused
        assert counts["ended"] == 1 and counts["in_flight"] == 0, counts
        print(f"\nloser after {time.monotonic() - t0:.1f} s: {message}\ndrain: {counts}")
    finally:
        for eng in stacks:
            eng.stop()
        left = [leftovers(eng) for eng in stacks]
        for eng in stacks:
            eng.cleanup()
    assert left == [[], []], left
