"""``fdsched serve``: FastDeploy's real OpenAI serving stack on CPU, the plugin loaded by ``FD_PLUGINS=fdsched``.

One rank: ``python -m fastdeploy.entrypoints.openai.api_server``. ``--dp N``: the Router
(``python -m fastdeploy.router.launch``) and ``python -m fastdeploy.entrypoints.openai.multi_api_server`` with
``--router``, as in examples/ab_run.md, with ``FDSCHED_PROFILE_BY_DP_RANK`` from ``--arms``. The host's own
commands, unchanged; the seams (:mod:`fdsched.serve.seams`) reach them through a ``sitecustomize`` on the
served stack's ``PYTHONPATH``.

:class:`ServedEngine` is the context manager the tests and the load generator use. Every process it starts
is in its own process group; stopping (also after Ctrl-C, a dead child or a failed start) terminates the
groups and every descendant, then removes the ``/dev/shm`` entries the stack's own processes created (recorded at
creation by the seams' ledger, :func:`fdsched.serve.seams.record_created`), nothing else (:mod:`fdsched.serve.teardown`).
Which process is gone, and why, is :class:`fdsched.serve.watch.StackWatch`'s part.

Ownership, not port numbers: a stack holds a lease on each of its ports (:class:`fdsched.serve.ports.PortLease`: one
lock file per port, held with ``fcntl.flock`` by the launcher and the stack's top process) from before anything is
spawned until everything is stopped, so a second launcher cannot take them. The configuration and its pre-flight
checks: :mod:`fdsched.serve.config`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Optional

from fdsched.serve.config import (
    LOOPBACK, PORTS_PER_RANK, EngineConfig, ServeError, check_config, check_host_modules, overlap_schedule_off,
    swap_space_gb,
)
from fdsched.serve.ports import PortLease, free_ports, port_in_use
from fdsched.serve.teardown import created_entries, group_members, kill_pids, remove_created, still_running
from fdsched.serve.watch import StackWatch


class ServedEngine(StackWatch):
    """Start the served stack; ``with ServedEngine(EngineConfig(...)) as eng: eng.urls ...``.

    ``progress(line)`` (optional) receives one line per start-up stage (``starting api_server rank 0 ...``,
    ``api_server rank 0 up in 41 s``)."""

    def __init__(self, config: EngineConfig = None, progress=None, **kw):
        self.config = config or EngineConfig(**kw)
        c = self.config
        problems = check_config(c)
        if problems:
            raise ServeError(problems[0])
        self.progress = progress or (lambda _line: None)
        self.procs: dict = {}
        self._tmp = tempfile.mkdtemp(prefix="fdsched-serve-")
        self.run_dir = self._tmp
        self.log_dir = c.log_dir or os.path.join(self._tmp, "log")
        os.makedirs(self.log_dir, exist_ok=True)
        self.state_dir = os.path.join(self._tmp, "state")
        os.makedirs(os.path.join(self.state_dir, "exits"))
        os.makedirs(os.path.join(self.state_dir, "drain"))
        self.ports: list = []
        self.urls: list = []
        self.metrics_urls: list = []
        self.router_url: Optional[str] = None
        self._descendants: set = set()
        self._groups: set = set()  # the process groups the stack's top processes lead (start_new_session)
        self._gone_since: dict = {}  # pid -> when deaths() first saw that watched process gone without a record
        self._lease = PortLease()
        self._watched: dict = {}  # (pid, create_time) -> (rank, role): the engine's processes, once it is up
        self.stopping = False
        self._spawned = False
        self.removed_shm: list = []

    # ----------------------------------------------------------------------------------- start / stop
    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            if not self._spawned:  # refused before anything ran (a port taken, no host): no logs worth keeping
                self.cleanup()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    def _port_block(self, need: int) -> list:
        """``need`` ports for the stack, leased: from ``--port`` on when it is given (one clear error naming a port
        that is taken), else free ones. They become :attr:`ports`."""
        first = self.config.port
        if first is not None:
            block = list(range(first, first + need))
            for p in block:
                holder = self._lease.take(p)
                if holder is not None or port_in_use(p):
                    self._lease.release()
                    why = f"held by {holder}" if holder is not None else "in use"
                    raise ServeError(f"--port {first}: port {p} is {why} (the stack needs ports "
                                     f"{block[0]}-{block[-1]}); allowed: a first port whose {need} ports are free")
        else:
            block = free_ports(need, lease=self._lease)
        self.ports = block
        return block

    def _allocate_ports(self):
        c = self.config
        block = self._port_block(PORTS_PER_RANK * c.dp + (1 if c.dp > 1 else 0))
        per = [block[i * PORTS_PER_RANK:(i + 1) * PORTS_PER_RANK] for i in range(c.dp)]
        self._rank_ports = per
        client = LOOPBACK if c.host in ("0.0.0.0", "::", "") else c.host
        self.urls = [f"http://{client}:{p[0]}" for p in per]
        self.metrics_urls = [f"http://{client}:{p[1]}/metrics" for p in per]
        self.router_url = f"http://{client}:{block[-1]}" if c.dp > 1 else None

    def _env(self, source: str) -> dict:
        from fdsched.serve import seams

        c = self.config
        site = os.path.join(self._tmp, "site")
        os.makedirs(site, exist_ok=True)
        seams.write_sitecustomize(site)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FDSCHED_PROFILE")}
        env.update({
            "PYTHONPATH": os.pathsep.join(p for p in (site, source, os.environ.get("PYTHONPATH", "")) if p),
            seams.ENABLE_ENV: "1",
            seams.WORKER_ENV: os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py"),
            seams.STATE_ENV: self.state_dir,
            seams.XFER_ENV: os.path.join(os.path.dirname(os.path.abspath(__file__)), "cachexfer.py"),
            seams.HOST_ENV: c.host,
            "FD_PLUGINS": "fdsched",
            "FD_LOG_DIR": self.log_dir,
            "PROMETHEUS_MULTIPROC_DIR": os.path.join(self._tmp, "prom"),
            "FD_USE_GET_SAVE_OUTPUT_V1": "1",
            "ENABLE_V1_KVCACHE_SCHEDULER": "1",
            "PYTHONUNBUFFERED": "1",
        })
        os.makedirs(env["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)
        if c.profile:
            env["FDSCHED_PROFILE"] = c.profile
        if c.arms:
            env["FDSCHED_PROFILE_BY_DP_RANK"] = c.arms
        if c.count_rpcs:
            env[seams.RPC_COUNT_ENV] = "1"
        if c.time_schedule:
            env[seams.TIME_SCHEDULE_ENV] = "1"
        if c.finish_delay_ms > 0:
            env[seams.FINISH_DELAY_ENV] = str(c.finish_delay_ms)
        if c.dp > 1:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(c.dp))  # seam S7
        env.update({k: str(v) for k, v in c.env.items()})
        return env

    def _server_args(self, model: str) -> list:
        c = self.config
        per = self._rank_ports
        joined = lambda i: ",".join(str(p[i]) for p in per)  # noqa: E731
        args = [
            "--model", model, "--host", c.host, "--max-model-len", str(c.max_model_len),
            "--max-num-seqs", str(c.max_num_seqs),
            "--block-size", str(c.block_size), "--num-gpu-blocks-override", str(c.num_gpu_blocks),
            "--max-num-batched-tokens", str(c.max_num_batched_tokens),
            "--engine-worker-queue-port", joined(2), "--cache-queue-port", joined(3),
            "--pd-comm-port", joined(4), "--rdma-comm-ports", joined(5),
            *overlap_schedule_off(),
            "--enable-prefix-caching" if c.enable_prefix_caching else "--no-enable-prefix-caching",
        ]
        if c.num_cpu_blocks:
            args += ["--swap-space", repr(swap_space_gb(model, c.block_size, c.num_cpu_blocks))]
        if c.dp > 1:
            args += ["--data-parallel-size", str(c.dp), "--router", self.router_url]
        return args

    def _spawn(self, name: str, cmd: list, env: dict):
        out = open(os.path.join(self.log_dir, f"{name}.out"), "ab")
        # the stack's top processes hold the port leases too: the ports stay taken while any of them lives
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, pass_fds=self._lease.fds())
        out.close()
        self._spawned = True
        self.procs[name] = proc
        self._groups.add(proc.pid)
        return proc

    def start(self):
        from fdsched.serve.model import make_model

        source = check_host_modules()
        self._allocate_ports()
        model = make_model()
        env = self._env(source)
        c = self.config
        py = sys.executable
        t0 = time.monotonic()
        if c.dp == 1:
            p = self._rank_ports[0]
            self.progress(f"starting api_server rank 0 on {c.host}:{p[0]} (metrics {p[1]}) ...")
            self._spawn("api_server", [py, "-m", "fastdeploy.entrypoints.openai.api_server", "--port", str(p[0]),
                                       "--metrics-port", str(p[1])] + self._server_args(model), env)
        else:
            router_port = self.ports[-1]
            self.progress(f"starting router on {c.host}:{router_port} ...")
            self._spawn("router", [py, "-m", "fastdeploy.router.launch", "--host", c.host, "--port",
                                   str(router_port)], env)
            self._wait_http(self.router_url + "/health", "router", self.procs["router"])
            self.progress(f"router up in {time.monotonic() - t0:.0f} s")
            per = self._rank_ports
            self.progress(f"starting multi_api_server: api_server ranks 0-{c.dp - 1} on {c.host}, ports "
                          f"{', '.join(str(q[0]) for q in per)} ...")
            self._spawn("multi_api_server", [
                py, "-m", "fastdeploy.entrypoints.openai.multi_api_server", "--num-servers", str(c.dp),
                "--ports", ",".join(str(q[0]) for q in per), "--metrics-ports", ",".join(str(q[1]) for q in per),
                "--args"] + self._server_args(model), env)
        self._wait_healthy(t0)
        self._watch_engine_processes()

    def rank_log_dir(self, rank: int) -> str:
        return self.log_dir if self.config.dp == 1 else os.path.join(self.log_dir, f"log_{rank}")

    def _tail(self, name: str, lines: int = 15) -> str:
        try:
            with open(os.path.join(self.log_dir, f"{name}.out"), errors="replace") as fh:
                return "\n" + "".join(fh.readlines()[-lines:])
        except OSError:
            return "(no output)"

    def _wait_http(self, url: str, stage: str, proc=None, deadline: Optional[float] = None):
        deadline = deadline or time.monotonic() + self.config.health_timeout
        while time.monotonic() < deadline:
            self._alive_check()
            if _http_ok(url):
                return
            time.sleep(0.5)
        raise ServeError(f"stage {stage}: not healthy within {self.config.health_timeout:.0f}s ({url}); "
                         f"logs in {self.log_dir}")

    def _stage_of(self, rank: int) -> str:
        found = [os.path.join(root, f"simworker_rank{rank}.log") for root, _d, files in os.walk(self.log_dir)
                 if f"simworker_rank{rank}.log" in files]
        worker_log = found[0] if found else None
        if worker_log is None:
            return f"api_server rank {rank} (the engine did not launch its worker)"
        with open(worker_log, errors="replace") as fh:
            if "ready:" not in fh.read():
                return f"worker ready rank {rank}"
        return f"engine start rank {rank} (/health)"

    def _wait_healthy(self, t0: Optional[float] = None):
        t0 = t0 or time.monotonic()
        deadline = time.monotonic() + self.config.health_timeout
        pending = set(range(self.config.dp))
        while pending and time.monotonic() < deadline:
            self._alive_check()
            for rank in sorted(pending):
                if _http_ok(self.urls[rank] + "/health"):
                    pending.discard(rank)
                    self.progress(f"api_server rank {rank} up in {time.monotonic() - t0:.0f} s")
            time.sleep(0.5)
        if pending:
            stages = "; ".join(self._stage_of(r) for r in sorted(pending))
            raise ServeError(f"stage {stages}: not healthy within {self.config.health_timeout:.0f}s; "
                             f"logs in {self.log_dir}")
        if self.router_url:
            while time.monotonic() < deadline:
                self._alive_check()
                try:
                    with urllib.request.urlopen(self.router_url + "/registered_number", timeout=2) as r:
                        body = r.read().decode()
                    if str(self.config.dp) in re.findall(r"\d+", body):
                        self.progress(f"{self.config.dp} api_servers registered with the router in "
                                      f"{time.monotonic() - t0:.0f} s")
                        return
                except OSError:
                    pass
                time.sleep(0.5)
            raise ServeError(f"stage router: the {self.config.dp} api_servers did not register with the Router "
                             f"within {self.config.health_timeout:.0f}s")

    # ----------------------------------------------------------------------------------- drain
    def drain(self, timeout: float, poll: float = 0.1) -> dict:
        """Stop admitting (new completions are answered 503 by every api_server: seam H4), let the requests in
        flight finish for up to ``timeout`` seconds, then end the rest with an error event the client can read.
        Returns ``{"finished", "ended", "refused", "seconds"}`` over every api_server process."""
        from fdsched.serve import seams

        t0 = time.monotonic()
        seams.request_drain(self.state_dir)
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if seams.drain_counts(self.state_dir)["in_flight"] == 0:
                break
            if self.deaths():
                break
            time.sleep(poll)
        counts = seams.drain_counts(self.state_dir)
        if counts["in_flight"]:
            seams.request_abort(self.state_dir)
            end = time.monotonic() + 5
            while time.monotonic() < end and seams.drain_counts(self.state_dir)["in_flight"]:
                time.sleep(poll)
            counts = seams.drain_counts(self.state_dir)
        counts["seconds"] = time.monotonic() - t0
        return counts

    # ----------------------------------------------------------------------------------- stop
    def descendants(self) -> set:
        """Every process of the stack's seen so far, (pid, create time), a copy: what stopping ends and waits for."""
        return set(self._descendants)

    def _collect_descendants(self):
        try:
            import psutil
        except ImportError:
            return
        for proc in self.procs.values():
            try:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    self._descendants.add((child.pid, child.create_time()))
            except psutil.Error:
                pass

    def stop(self):
        """Terminate everything this stack started; remove the /dev/shm entries its processes created; give its
        ports back. Idempotent."""
        self.stopping = True
        self._collect_descendants()
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._collect_descendants()
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait(timeout=10)
        # a process of one of the stack's own groups that was never seen as a descendant (started after the last
        # look, or re-parented) is the stack's too: it must be gone before the ledger is read
        self._descendants.update(group_members(self._groups))
        kill_pids(self._descendants)
        deadline = time.monotonic() + 10  # SIGKILL is not instantaneous: wait until they are gone
        while (still_running(self._descendants) or any(port_in_use(p) for p in self.ports)) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        self.procs.clear()
        self.removed_shm += remove_created(self.state_dir)
        self._lease.release()

    def created_shm_left(self) -> list:
        """The /dev/shm entries this stack's processes created that are still there (same name and inode)."""
        return [path for path, _ino in created_entries(self.state_dir, still_there=True)]

    def cleanup(self):
        shutil.rmtree(self._tmp, ignore_errors=True)

    # ----------------------------------------------------------------------------------- reading
    def engine_log_text(self) -> str:
        parts = []
        for root, _dirs, files in os.walk(self.log_dir):
            for name in sorted(files):
                try:
                    with open(os.path.join(root, name), errors="replace") as fh:
                        parts.append(f"==> {os.path.join(root, name)} <==\n{fh.read()}")
                except OSError:
                    pass
        return "\n".join(parts)

    def metrics_text(self, rank: int = 0) -> str:
        with urllib.request.urlopen(self.metrics_urls[rank], timeout=10) as r:
            return r.read().decode()

    def engine_state(self, rank: int = 0, timeout: float = 20.0) -> dict:
        """The rank's cache-manager block accounting and pending plugin signals (harness seam H1)."""
        answer = os.path.join(self.state_dir, f"state-rank{rank}.json")
        if os.path.exists(answer):
            os.remove(answer)
        open(os.path.join(self.state_dir, f"ask-rank{rank}"), "w").close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(answer):
                with open(answer) as fh:
                    return json.load(fh)
            time.sleep(0.05)
        raise ServeError(f"rank {rank}: the engine's state probe did not answer within {timeout:.0f}s")


RECEIVER_THREAD = "recv_data_transfer_result"  # the host's CPU-cache transfer-done receiver (thread target name)


def receiver_rpc_rate(engine: "ServedEngine", seconds: float, rank: int = 0) -> dict:
    """The transfer-done receiver's manager RPCs per second over ``seconds`` of the engine as it is (idle when
    nothing is sent), counted in the engine process by harness seam H2 (needs ``count_rpcs``)."""
    first = engine.engine_state(rank)
    time.sleep(seconds)
    second = engine.engine_state(rank)

    def receiver(state):
        return sum(n for name, n in state.get("rpc_counts", {}).items() if RECEIVER_THREAD in name)

    if not first.get("rpc_counts") and not second.get("rpc_counts"):
        raise ServeError("no RPC counts: start the engine with count_rpcs=True (harness seam H2)")
    elapsed = second["time"] - first["time"]
    calls = receiver(second) - receiver(first)
    others = (sum(second["rpc_counts"].values()) - sum(first["rpc_counts"].values())) - calls
    return {"seconds": elapsed, "receiver_rpcs": calls, "receiver_rpcs_per_s": calls / elapsed,
            "other_rpcs_per_s": others / elapsed,
            "threads": sorted(name for name in second.get("rpc_counts", {}))}


def format_schedule_times(t: dict) -> str:
    if not t.get("calls"):
        return f"no call scheduled anything ({t.get('idle_calls', 0)} idle calls)"
    return (f"{t['calls']} calls that scheduled: scheduler-thread CPU us mean {t['cpu_us_mean']:.0f}, "
            f"p50 {t['cpu_us_p50']:.0f}, p90 {t['cpu_us_p90']:.0f}, p99 {t['cpu_us_p99']:.0f}; wall us mean "
            f"{t['wall_us_mean']:.0f}, p50 {t['wall_us_p50']:.0f}, p99 {t['wall_us_p99']:.0f}; "
            f"{t['idle_calls']} idle calls, CPU us mean {t['idle_cpu_us_mean']:.0f}")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except Exception:
        return False
