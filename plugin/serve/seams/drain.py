"""H6: the api_server's drain gate. When the launcher stops a stack it first asks every api_server to stop
admitting (503) and waits for what is in flight; what is still running at the deadline is ended with an error
event. The gate wraps the app's middleware stack; the launcher talks to it through files in the state dir."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

from .env import MAIN_API_SERVER, STATE_ENV, main_module


# H6 --------------------------------------------------------------------------------------------

DRAIN_DIR = "drain"  # in the state dir: "requested", "abort" (the launcher's), "<pid>.json" (each gate's counts)
SHUTDOWN_ERROR = {"message": "the server is shutting down: it finished what it could and ended this request",
                  "type": "server_shutdown", "code": 503}
REFUSED_ERROR = {"message": "the server is shutting down: not admitting new requests", "type": "server_shutdown",
                 "code": 503}


class _GateState:
    """One per api_server process: requests in flight and what the drain did, shared with the launcher."""

    def __init__(self, state_dir: str):
        self.dir = os.path.join(state_dir, DRAIN_DIR)
        self.in_flight = self.finished = self.ended = self.refused = 0
        self.draining = self.aborting = self.closed = False
        self._written = None
        self._abort_events = {}  # event loop -> asyncio.Event set when the launcher asks for the abort
        self._read_launcher()  # a gate made after the drain (or the abort) starts in it
        self._write()
        threading.Thread(target=self._poll, name="fdsched-serve-drain-gate", daemon=True).start()

    def _write(self):
        data = {"pid": os.getpid(), "draining": self.draining, "in_flight": self.in_flight,
                "finished": self.finished, "ended": self.ended, "refused": self.refused}
        if data == self._written:
            return
        path = os.path.join(self.dir, f"{os.getpid()}.json")
        try:
            with open(path + ".tmp", "w") as fh:
                json.dump(data, fh)
            os.replace(path + ".tmp", path)
            self._written = data
        except OSError:
            pass

    def see_drain(self) -> bool:
        """Whether the launcher asked for the drain, read now (a stat). The api_server runs several worker
        processes (FastDeploy's ``--workers``: 4 by default on later 2.6 commits), each with its own gate made on its
        first request: one made after the drain, or a request arriving between two polls, must not be admitted (on a
        PD decode instance such a request waits for KV that the refusing prefill instance never sends)."""
        if not self.draining and os.path.exists(os.path.join(self.dir, "requested")):
            self.draining = True
        return self.draining

    def abort_event(self) -> "asyncio.Event":
        """The running loop's event for the abort (one per loop; set at once if the abort came already)."""
        loop = asyncio.get_running_loop()
        event = self._abort_events.get(loop)
        if event is None:
            event = self._abort_events[loop] = asyncio.Event()
            if self.aborting:
                event.set()
        return event

    def _read_launcher(self):
        """Take up what the launcher asked for so far: the drain, then the abort (waking every loop's event)."""
        if self.see_drain() and not self.aborting and os.path.exists(os.path.join(self.dir, "abort")):
            self.aborting = True
            for loop, event in list(self._abort_events.items()):
                try:
                    loop.call_soon_threadsafe(event.set)
                except RuntimeError:  # that loop is closed
                    pass

    def _poll(self):
        while not self.closed:
            self._read_launcher()
            self._write()
            time.sleep(0.05)


_GATE = {}


async def _send_json(send, status: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


class _DrainGate:
    """ASGI wrapper of the api_server's app (H6); only POST /v1/* passes through it."""

    def __init__(self, app, state_dir: str):
        self.app, self.state_dir = app, state_dir

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") != "POST" or not scope.get("path", "").startswith("/v1/"):
            return await self.app(scope, receive, send)
        if "gate" not in _GATE:
            _GATE["gate"] = _GateState(self.state_dir)
        st = _GATE["gate"]
        if st.see_drain():
            st.refused += 1
            return await _send_json(send, 503, {"error": REFUSED_ERROR})
        st.in_flight += 1
        sent = {"start": False, "done": False, "stream": False, "cut": False}

        async def tracking_send(message):
            if sent["cut"]:  # ended by the drain: what the app sends while it unwinds (e.g. its [DONE]) is dropped
                return
            if message["type"] == "http.response.start":
                sent["start"] = True
                headers = dict((bytes(k).lower(), bytes(v)) for k, v in message.get("headers", []))
                sent["stream"] = b"text/event-stream" in headers.get(b"content-type", b"")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                sent["done"] = True
            await send(message)

        task = asyncio.ensure_future(self.app(scope, receive, tracking_send))
        abort = asyncio.ensure_future(st.abort_event().wait())
        outcome = "finished"
        try:  # no polling: woken by the request's end or by the abort
            done, _ = await asyncio.wait({task, abort}, return_when=asyncio.FIRST_COMPLETED)
            if task in done or sent["done"]:  # finished (perhaps its last byte went out just as the abort came)
                return await task
            outcome = "ended"
            sent["cut"] = True
            task.cancel()
            await asyncio.wait({task}, timeout=2)
            if sent["start"]:
                event = b"data: " + json.dumps({"error": SHUTDOWN_ERROR}).encode() + b"\n\n"
                if sent["stream"]:
                    event += b"data: [DONE]\n\n"
                await send({"type": "http.response.body", "body": event, "more_body": False})
            else:
                await _send_json(send, 503, {"error": SHUTDOWN_ERROR})
            return None
        finally:
            abort.cancel()
            st.in_flight -= 1
            if outcome == "ended":
                st.ended += 1
            elif st.draining:
                st.finished += 1


def _h6_drain_gate(module):
    """Wrap the middleware stack of every ASGI app class the module defines (Starlette, and FastAPI, which
    overrides ``build_middleware_stack``) in the api_server process."""
    state_dir = os.environ.get(STATE_ENV)
    if not state_dir or main_module() != MAIN_API_SERVER:
        return
    for cls in (getattr(module, "Starlette", None), getattr(module, "FastAPI", None)):
        real = None if cls is None else cls.__dict__.get("build_middleware_stack")
        if real is None or getattr(real, "_fdsched", False):
            continue

        def build_middleware_stack(self, _real=real):
            stack = _real(self)
            return stack if isinstance(stack, _DrainGate) else _DrainGate(stack, state_dir)

        build_middleware_stack._fdsched = True
        cls.build_middleware_stack = build_middleware_stack


def request_drain(state_dir: str) -> None:
    """The launcher: every api_server's gate stops admitting (answers 503) from now on."""
    open(os.path.join(state_dir, DRAIN_DIR, "requested"), "w").close()


def request_abort(state_dir: str) -> None:
    """The launcher: every api_server's gate ends what is still in flight with an error event."""
    open(os.path.join(state_dir, DRAIN_DIR, "abort"), "w").close()


def drain_counts(state_dir: str, wait_ack: float = 1.0) -> dict:
    """Sum of every gate's counts; after a drain request, waits up to ``wait_ack`` s for each gate to see it."""
    directory = os.path.join(state_dir, DRAIN_DIR)
    deadline = time.monotonic() + wait_ack
    requested = os.path.exists(os.path.join(directory, "requested"))
    while True:
        gates = []
        for name in os.listdir(directory):
            if name.endswith(".json"):
                try:
                    with open(os.path.join(directory, name)) as fh:
                        gates.append(json.load(fh))
                except (OSError, ValueError):
                    pass
        if not requested or all(g["draining"] for g in gates) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return {key: sum(g[key] for g in gates) for key in ("in_flight", "finished", "ended", "refused")}


AFTER_LOAD = {"starlette.applications": [_h6_drain_gate], "fastapi.applications": [_h6_drain_gate]}
