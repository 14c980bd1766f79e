"""HTTP clients (stdlib only) and the engine-state checks the engine tier uses."""

from __future__ import annotations

import http.client
import json
import os
import re
import threading
import time
from urllib.parse import urlparse


def _conn(url, timeout=300):
    u = urlparse(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)


def complete(url: str, prompt: str, max_tokens: int, stream: bool = True, timeout: float = 300) -> dict:
    """One /v1/completions request; returns {"status", "finish_reason", "chunks", "error"}."""
    conn = _conn(url, timeout)
    body = json.dumps({"model": "default", "prompt": prompt, "max_tokens": max_tokens, "stream": stream})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = {"status": resp.status, "finish_reason": None, "chunks": 0, "error": None}
    if not stream or resp.status != 200:
        data = resp.read().decode(errors="replace")
        try:
            doc = json.loads(data)
        except ValueError:
            doc = {}
        if resp.status != 200 or "error" in doc and doc.get("error"):
            out["error"] = data
        else:
            out["finish_reason"] = doc["choices"][0]["finish_reason"]
        conn.close()
        return out
    for raw in resp:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        doc = json.loads(payload)
        if doc.get("error"):
            out["error"] = payload
            continue
        out["chunks"] += 1
        reason = doc["choices"][0].get("finish_reason")
        if reason:
            out["finish_reason"] = reason
    conn.close()
    return out


def stream_then_drop(url: str, prompt: str, max_tokens: int, after_chunks: int) -> int:
    """Stream and close the connection after ``after_chunks`` data chunks (0: right after sending)."""
    conn = _conn(url)
    body = json.dumps({"model": "default", "prompt": prompt, "max_tokens": max_tokens, "stream": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    seen = 0
    if after_chunks > 0:
        resp = conn.getresponse()
        for raw in resp:
            if raw.startswith(b"data:"):
                seen += 1
                if seen >= after_chunks:
                    break
    conn.sock.shutdown(2) if conn.sock else None
    conn.close()
    return seen


def run_concurrently(fn, args_list, spacing_s: float = 0.0):
    """``fn(*args)`` for every args of ``args_list``, each in its own thread, started ``spacing_s`` apart; the
    results in order (an exception is a result: ``{"error": ..., "finish_reason": None}``)."""
    results = [None] * len(args_list)

    def one(i, args):
        try:
            results[i] = fn(*args)
        except Exception as exc:  # a failed request is a result too
            results[i] = {"error": repr(exc), "finish_reason": None}

    threads = [threading.Thread(target=one, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
        if spacing_s:
            time.sleep(spacing_s)
    for t in threads:
        t.join()
    return results


def metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        m = re.match(r"([^{\s]+)(\{(.*)\})?\s+([0-9.eE+-]+|NaN)", line)
        if not m or m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
        if all(found.get(k) == str(v) for k, v in labels.items()):
            total += float(m.group(4))
    return total


_POOLS = ("free", "tree_blocks", "cpu_free", "cpu_tree_blocks", "in_transit")


def _busy(state: dict) -> bool:
    return bool(state["requests"] or state["running"] or state["waiting"] or state["request_blocks"]
                or state.get("in_transit") or state.get("evicting"))


def settle(eng, rank: int = 0, timeout: float = 60.0) -> dict:
    """Wait until the rank is quiet, then return its engine state: no request left, no swap in flight (the host's
    eviction thread lands a swap-out after the last request is gone), and two reads half a second apart agree on
    every pool. Each read is one picture under the host's locks (seam H1); on timeout the last read is returned
    and the caller's assertions say what was still moving."""
    deadline = time.monotonic() + timeout
    state = eng.engine_state(rank)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        before, state = state, eng.engine_state(rank)
        if not _busy(state) and all(sorted(map(str, before.get(k, []))) == sorted(map(str, state.get(k, [])))
                                    for k in _POOLS):
            break
    return state


_BLOCK_EVENTS = ("allocate_gpu_blocks", "recycle_gpu_blocks", "SWAP2CPU", "SWAP2GPU", "free node", "issue transfer task")
_BLOCK_ID = re.compile(r"[\[ ,(](\d+)(?=[,\])])")  # a block id inside one of the host's logged lists


def _lines(path: str) -> list:
    if not os.path.isfile(path):
        return []
    with open(path, errors="replace") as fh:
        return fh.read().splitlines()


def block_history(log_dir: str, blocks, last: int = 60) -> str:
    """The host's own cache-manager log lines (allocations, recycles, swaps, evictions) that name any of ``blocks``,
    the last ``last`` of them, and the tails of the engine's error logs: what a failed pool check needs to be read
    once the served engine's log directory is gone."""
    ids = {int(b) for b in blocks}
    named = [ln for ln in _lines(os.path.join(log_dir, "cache_manager.log"))
             if any(e in ln for e in _BLOCK_EVENTS) and ids & {int(m) for m in _BLOCK_ID.findall(ln)}]
    errors = [f"{name}: {ln}" for name in ("cache_manager_error.log", "fastdeploy_error.log")
              for ln in _lines(os.path.join(log_dir, name))[-20:]]
    return "\n".join([f"--- cache_manager.log lines naming blocks {sorted(ids)} (last {last}) ---", *named[-last:],
                      "--- error logs (tails) ---", *errors])


def assert_blocks_whole(state: dict, log_dir: str = "") -> None:
    """free + used = total: every block free or cached in the prefix tree, none twice, none lost. A block free twice
    or both free and cached is reported with the tree nodes that hold it and, given the rank's ``log_dir``, its
    history in the host's own log (:func:`block_history`)."""
    free, tree, held = state["free"], state["tree_blocks"], state["request_blocks"]
    assert not held, f"blocks still held by finished requests: {held}"
    twice = {b for b in free if free.count(b) > 1}
    both = set(free) & set(tree)
    if twice or both:
        doubled = twice | both
        nodes = [n for n in state.get("tree_nodes", []) if n["status"] == "GPU" and n["block"] in doubled]
        what = f"a block is free twice: {sorted(free)}" if twice else f"blocks both free and cached: {sorted(both)}"
        raise AssertionError(f"{what}; tree nodes holding them: {nodes}"
                             + (f"\n{block_history(log_dir, doubled)}" if log_dir else ""))
    assert set(free) | set(tree) == set(range(state["total"])), (
        f"blocks lost: {sorted(set(range(state['total'])) - set(free) - set(tree))}")
    assert state["pending_signals"] == [], f"what an open schedule() pass still expects of a block check: {state['pending_signals']}"


def assert_left_nothing(eng, when: str = "after stop", stop: bool = True) -> None:
    """Stop ``eng`` (``stop``; a stack whose start failed has stopped itself), read what is left of it
    (:func:`leftovers`), remove its run folder, and fail naming what was left ``when``."""
    if stop:
        eng.stop()
    left = leftovers(eng)
    eng.cleanup()
    assert not left, f"left behind {when}: {left}"


def leftovers(eng) -> list:
    """Processes, ports and /dev/shm entries of a stopped stack that are still there: what its processes recorded
    creating, and (to catch what the ledger missed) entries whose names carry one of its ports. Read only."""
    from fdsched.serve.ports import port_in_use
    from fdsched.serve.teardown import still_running

    left = [f"port {p}" for p in eng.ports if port_in_use(p)]
    left += eng.created_shm_left()
    if eng.ports:
        pattern = re.compile(r"(?<!\d)(" + "|".join(str(p) for p in eng.ports) + r")(?!\d)")
        left += [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if pattern.search(n)
                 and f"/dev/shm/{n}" not in left]
    left += [f"pid {pid}" for pid in still_running(eng.descendants())]
    return left
