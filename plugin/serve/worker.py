"""The simulated GPU worker: a CPU process that speaks the worker side of FastDeploy's IPC.

Started by seam S2 (:mod:`fdsched.serve.seams`) in place of ``paddle.distributed.launch worker_process.py``,
one per engine (data-parallel rank). What it does, as the GPU worker would (host: ``worker/worker_process.py``
init_health_status / event loop, ``gpu_model_runner.py`` task handling):

- readiness: prints the checkpoint-loading line ``check_worker_initialize_status`` parses, sets
  ``get_profile_block_num`` when the engine profiles, ``cache_ready_signal``, its own slot of
  ``worker_ready_signal``, ``loaded_model_signal`` (rank 0), and keeps ``worker_healthy_live_signal`` fresh;
- takes ``(tasks, bsz)`` from the engine's real ``EngineWorkerQueue`` as a client;
- per task: a PREFILL chunk that does not finish the prompt emits no token (a ``-1`` placeholder, as the
  runner does), a finished prefill emits the first token, a decoding slot one token per step, and the answer
  ends with EOS at the length the prompt's length mark carries (:mod:`fdsched.serve.lengthmark`; the load
  generator writes it, so the client need not send ``max_tokens``), or at ``max_tokens`` when that comes
  first or the prompt has no mark; a PREEMPTED or ABORT task frees the slot and emits the preempted-token id
  (``PREEMPTED_TOKEN_ID``, -9) the engine waits for; DECODE tasks only extend block tables (no output);
- outputs: ``list[StreamTransferData]`` pushed to ``get_save_output_rank{dp}_{port}``, the
  ``FD_USE_GET_SAVE_OUTPUT_V1=1`` ZMQ path. **Production GPUs use the compiled ``get_output`` path by
  default**, not this one; the engine-side code after the receive is the same.
- step time: the replay's cost model (``fdsched.replay.costmodel.cost_from_settings`` on the settings of
  this process's environment, i.e. the profile's ``replay.*`` keys); the worker sleeps the modelled time and
  logs the steps per second it sustains.

Not modelled: the overlap schedule (the launcher turns it off), speculative decoding, logprobs, stop
sequences (the engine's own stop checks still run on the tokens it receives). The CPU swap tier is the
simulated cache transfer manager's (:mod:`fdsched.serve.cachexfer`, seam S10), not the worker's.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time


def _parse(argv):
    ap = argparse.ArgumentParser(prog="fdsched-simworker")
    ap.add_argument("--engine-pid", type=int, required=True)
    ap.add_argument("--queue-port", type=int, required=True)
    ap.add_argument("--dp-rank", type=int, default=0)
    ap.add_argument("--dp-size", type=int, default=1)
    ap.add_argument("--ready-slots", type=int, default=1)
    ap.add_argument("--eos", default="2")
    ap.add_argument("--do-profile", type=int, default=0)
    ap.add_argument("--profile-blocks", type=int, default=0)
    ap.add_argument("--multi-api-server", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=900)
    ap.add_argument("--pod-ip", default="0.0.0.0")
    ap.add_argument("--splitwise-role", default="mixed")
    return ap.parse_args(argv)


def _step_cost():
    """The replay's step cost (the profile's ``replay.*`` settings), with its context facts computed as the
    replay computes them (:mod:`fdsched.replay.costmodel`): tokens held by the decoding requests, and tokens
    attended to by the scheduled prefill chunks."""
    from fdsched.replay.costmodel import chunk_context_tokens, cost_from_settings
    from fdsched.core.settings import load_settings

    cost = cost_from_settings(load_settings())

    def step_ms(prefill_chunks, decode_held):
        return cost.step_ms(
            sum(end - start for start, end in prefill_chunks), len(decode_held),
            decode_context_tokens=sum(decode_held),
            prefill_context_tokens=sum(chunk_context_tokens(start, end) for start, end in prefill_chunks),
        )

    return cost, step_ms


def answer_length(request, log=None) -> int:
    """Tokens the request's answer has: the length mark in its prompt (:mod:`fdsched.serve.lengthmark`), cut
    at the ``max_tokens`` the engine holds for it (the client's, or the engine's default when the client sent
    none); without a mark, that ``max_tokens`` (16 when there is none)."""
    from fdsched.serve.lengthmark import read_mark

    limit = request.get("max_tokens", None)
    ids = request.prompt_token_ids
    ids = [] if ids is None else ids
    marked = read_mark(ids)
    if marked is None:
        end = int(limit or 16)
    else:
        end = min(marked, int(limit)) if limit else marked
    if log is not None:
        log(f"request {request.request_id}: prompt {len(ids)} tokens, "
            f"max_tokens {limit} (as the engine holds it), length mark {marked}, ends after {end} tokens")
    return end


def main(argv=None) -> int:
    a = _parse(sys.argv[1:] if argv is None else argv)
    import numpy as np
    import zmq
    from fastdeploy.inter_communicator import IPCSignal, ZmqIpcClient

    def log(msg):
        print(f"[fdsched simworker rank{a.dp_rank}] {msg}", file=sys.stderr, flush=True)

    def signal(name, size, suffix):
        return IPCSignal(name=name, array=np.zeros([size], dtype=np.int32), dtype=np.int32, suffix=suffix,
                         create=False)

    log(f"started (pid {os.getpid()}, engine {os.getppid()})")
    cost, step_ms = _step_cost()
    log("cost model ok")
    started = _start_up(a, log, signal)
    if started is None:
        return 3
    queue, live, exist, _kept = started  # keep every IPCSignal referenced: a collected one unmaps its segment

    out = ZmqIpcClient(name=f"get_save_output_rank{a.dp_rank}_{a.queue_port}", mode=zmq.PUSH)
    out.connect()
    progress = _prefill_progress(a, zmq) if a.splitwise_role == "prefill" else None
    log(f"ready: queue port {a.queue_port}, cost model {cost}")
    slots = _Slots(a, ends_at_first_token=progress is not None, log=log)
    rate = _Rate(log)
    parent = os.getppid()
    while True:
        if os.getppid() != parent:  # the engine is gone: so is its worker
            log("engine process gone; exiting")
            return 0
        live.value[0] = int(time.time())
        acks = []
        if queue.exist_tasks():
            exist.value[0] = 1
            tasks, read_finish = queue.get_tasks()
            if read_finish:
                exist.value[0] = 0
            for reqs, _bsz in tasks:
                for r in reqs:
                    slots.take(r, acks)
        if not slots.active and not acks:
            time.sleep(0.001)
            continue
        outs, prefill_chunks, decode_held, prefilled = slots.step(acks)
        ms = step_ms(prefill_chunks, decode_held) if (prefill_chunks or decode_held) else 0.0
        if ms:
            time.sleep(ms / 1000.0)
        if progress is not None and prefilled:  # what the attention kernels report per layer on a GPU
            progress.send_pyobj(prefilled)
        if outs:
            out.socket.send_pyobj(outs)
        rate.stepped(ms, slots)


def _start_up(a, log, signal):
    """Become ready as the GPU worker does: the checkpoint line, the profiled block count, the engine's task queue
    (waiting up to 5 minutes for this rank's engine) and the ready signals. Returns ``(queue, live, exist,
    kept)`` (``kept``: every other signal, to keep referenced), or None when the engine did not come up."""
    from fastdeploy.inter_communicator import EngineWorkerQueue

    kept = []
    if a.dp_size > 1 and not a.multi_api_server:
        launched = signal("launched_expert_service_signal", a.dp_size, a.engine_pid)
        kept.append(launched)
        while launched.value[a.dp_rank] == 0:
            time.sleep(0.05)
    print("Loading checkpoint shards: 100", flush=True)  # what check_worker_initialize_status parses
    if a.do_profile:
        profiled = signal("get_profile_block_num", 1, a.engine_pid)
        profiled.value[0] = a.profile_blocks
        kept.append(profiled)
    # this rank's engine (an ExpertService under multi_api_server for ranks > 0) may come up after us
    deadline = time.monotonic() + 300
    waited = False
    # the engine's task queue: a unix socket in /dev/shm or TCP, as FD_ENGINE_TASK_QUEUE_WITH_SHM says
    # (default 1 on 2.6 commit d38eeb8, 0 on e7c8dc2)
    from fastdeploy import envs

    address = (f"/dev/shm/fd_task_queue_{a.queue_port}.sock" if int(envs.FD_ENGINE_TASK_QUEUE_WITH_SHM)
               else (a.pod_ip, a.queue_port))
    while True:
        try:
            cache_ready = signal("cache_ready_signal", 1, a.queue_port)
            live = signal("worker_healthy_live_signal", 1, a.queue_port)
            exist = signal("exist_task_signal", 1, a.queue_port)
            queue = EngineWorkerQueue(address=address, is_server=False, num_client=1, client_id=0,
                                      local_data_parallel_id=a.dp_rank)
            break
        except (FileNotFoundError, ConnectionError, OSError) as exc:
            if not waited:
                log(f"waiting for rank {a.dp_rank}'s engine ({exc!r})")
                waited = True
            if time.monotonic() > deadline:
                log(f"rank {a.dp_rank}'s engine did not come up: {exc!r}")
                return None
            time.sleep(0.5)
    cache_ready.value[0] = 1
    ready = signal("worker_ready_signal", max(1, a.ready_slots), a.engine_pid)
    ready.value[a.dp_rank % max(1, a.ready_slots)] = 1
    kept += [cache_ready, ready]
    if a.dp_rank == 0:
        loaded = signal("loaded_model_signal", 1, a.engine_pid)
        loaded.value[0] = 1
        kept.append(loaded)
    return queue, live, exist, kept


class _Slots:
    """The batch slots and what each request in them has produced: :meth:`take` reads one task from the engine,
    :meth:`step` runs one step over every slot and returns the outputs (module docstring: what each task does)."""

    def __init__(self, a, ends_at_first_token: bool, log) -> None:
        import numpy as np
        from fastdeploy.config import PREEMPTED_TOKEN_ID
        from fastdeploy.engine.request import RequestType
        from fastdeploy.output.stream_transfer_data import DecoderState, StreamTransferData

        self._np, self._preempted_token, self._types = np, PREEMPTED_TOKEN_ID, RequestType
        self._text, self._data = DecoderState.TEXT, StreamTransferData
        self._eos = [int(x) for x in a.eos.split(",") if x]
        self._vocab = a.vocab
        self._ends_at_first_token = ends_at_first_token  # a prefill instance ends each request at its first token
        self._log = log
        self.active: dict = {}  # batch slot -> state of the request in it
        self._first_max: dict = {}  # request id -> max_tokens when first scheduled
        self._rng = random.Random(1234 + a.dp_rank)
        self.tokens_out = 0

    def _token(self, batch_id, value):
        return self._data(decoder_state=self._text, batch_id=batch_id, tokens=self._np.array([value], dtype=self._np.int64))

    def take(self, r, acks: list) -> None:
        """One task: a PREFILL chunk (re)fills its slot, a PREEMPTED or ABORT frees it and is acknowledged in
        ``acks``; DECODE / EXTEND only extend block tables (no output)."""
        kind = getattr(getattr(r, "task_type", None), "value", None)
        slots = self.active
        if kind == self._types.PREFILL.value:
            outputs_so_far = len(r.output_token_ids or [])
            slot = slots.get(r.idx)
            if slot is None or slot["rid"] != r.request_id or r.prefill_start_index == 0:
                # where it ends, as first seen: a rescheduled (preempted) request keeps it
                max_tokens = (self._first_max.get(r.request_id)
                              or self._first_max.setdefault(r.request_id, answer_length(r, self._log)))
                slot = slots[r.idx] = {"rid": r.request_id, "generated": outputs_so_far,
                                       "prompt": len(r.prompt_token_ids),
                                       "max": int(max_tokens), "decoding": False}
            slot["chunk"] = (r.prefill_start_index, r.prefill_end_index,
                             len(r.prompt_token_ids) + outputs_so_far)
        elif kind in (self._types.PREEMPTED.value, self._types.ABORT.value):
            # a decode instance frees a preempted request's slot at once (it does not wait for this
            # ack), so the slot may already hold the next request: free it only for this request
            if slots.get(r.idx, {}).get("rid") == r.request_id:
                del slots[r.idx]
            acks.append(self._token(r.idx, self._preempted_token))

    def step(self, acks: list) -> tuple:
        """One step over every slot, in slot order: ``(outputs, prefill chunks (start, end), tokens each decoding
        request holds, (slot, tokens prefilled) per prefilling slot)``."""
        slots = self.active
        outs, prefill_chunks, decode_held, prefilled = list(acks), [], [], []
        for idx in sorted(slots):
            slot = slots[idx]
            produce = False
            chunk = slot.pop("chunk", None)
            if chunk is not None:
                start, end, need = chunk
                prefill_chunks.append((start, end))
                prefilled.append((idx, end))
                if end >= need:
                    slot["decoding"] = produce = True
                else:
                    outs.append(self._token(idx, -1))
            elif slot["decoding"]:
                decode_held.append(slot["prompt"] + slot["generated"])
                produce = True
            if produce:
                slot["generated"] += 1
                value = self._eos[0] if slot["generated"] >= slot["max"] else self._rng.randrange(8, self._vocab)
                outs.append(self._token(idx, value))
                self.tokens_out += 1
                if value in self._eos or self._ends_at_first_token:
                    self._first_max.pop(slot["rid"], None)
                    del slots[idx]
        return outs, prefill_chunks, decode_held, prefilled


class _Rate:
    """The steps per second the worker sustains, logged every 2 seconds."""

    def __init__(self, log) -> None:
        self._log = log
        self.steps = 0
        self._slept_s = 0.0
        self._window_start, self._window_steps = time.monotonic(), 0

    def stepped(self, ms: float, slots: _Slots) -> None:
        self._slept_s += ms / 1000.0
        self.steps += 1
        self._window_steps += 1
        now = time.monotonic()
        if now - self._window_start >= 2.0:
            self._log(f"steps/s={self._window_steps / (now - self._window_start):.1f} steps={self.steps} "
                      f"tokens_out={slots.tokens_out} active={len(slots.active)} "
                      f"modelled_ms_per_step={1000 * self._slept_s / max(1, self._window_steps):.2f}")
            self._window_start, self._window_steps, self._slept_s = now, 0, 0.0


def _prefill_progress(a, zmq):
    """On a prefill instance: the socket the worker reports each slot's prefill progress on, ``[(slot, tokens
    prefilled so far), ...]`` once per step, to the simulated cache messager (:mod:`fdsched.serve.pdxfer`). On a GPU
    the attention kernels report it per layer (``get_output_kv_signal``) and the messager moves those layers' KV."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_fdsched_serve_pdxfer",
                                                  os.path.join(os.path.dirname(os.path.abspath(__file__)), "pdxfer.py"))
    pdxfer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pdxfer)
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(pdxfer.signal_address(a.engine_pid))
    return sock


if __name__ == "__main__":
    import faulthandler

    faulthandler.enable()
    import signal as _signal

    for _s in (_signal.SIGTERM, _signal.SIGHUP, _signal.SIGINT, _signal.SIGPIPE):
        faulthandler.register(_s, chain=True)
    import atexit

    atexit.register(lambda: print("[fdsched simworker] atexit", file=sys.stderr, flush=True))
    try:
        sys.exit(main())
    except BaseException as exc:
        print(f"[fdsched simworker] exits: {exc!r}", file=sys.stderr, flush=True)
        raise
