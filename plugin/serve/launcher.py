"""``fdsched serve``: FastDeploy's real OpenAI serving stack on CPU, the plugin loaded by ``FD_PLUGINS=fdsched``.

One rank: ``python -m fastdeploy.entrypoints.openai.api_server``. ``--dp N``: the Router
(``python -m fastdeploy.router.launch``) and ``python -m fastdeploy.entrypoints.openai.multi_api_server`` with
``--router``, as in examples/ab_run.md, with ``FDSCHED_PROFILE_BY_DP_RANK`` from ``--arms``. The host's own
commands, unchanged; the seams (:mod:`fdsched.serve.seams`) reach them through a ``sitecustomize`` on the
served stack's ``PYTHONPATH``.

:class:`ServedEngine` is the context manager the tests and the load generator use. Every process it starts
is in its own process group; stopping (also after Ctrl-C, a dead child or a failed start) terminates the
groups and every descendant, then removes ``/dev/shm`` segments whose names carry the stack's ports.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Optional

from fdsched.core.common import remove_files


PORT_RANGE = (18000, 18999)
PORTS_PER_RANK = 6  # api, metrics, engine-worker-queue, cache-queue, pd-comm, rdma
REQUIRED_MODULES = ("fastdeploy", "fastapi", "uvicorn", "gunicorn", "aiozmq", "jinja2", "ml_dtypes",
                    "partial_json_parser", "zmq", "tokenizers", "prometheus_client")


class ServeError(RuntimeError):
    """One clear error (the CLI prints it without a traceback)."""


class HostMissing(ServeError):
    """The host, or the serving stack's modules, are not there (exit code 2, as every command without a host)."""


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


def free_ports(count: int, start: Optional[int] = None, port_range=PORT_RANGE) -> list:
    """``count`` consecutive free ports in ``port_range`` (from ``start`` if given, else a random offset)."""
    import random

    lo, hi = port_range
    first = start if start is not None else lo + random.randrange(0, max(1, hi - lo - count))
    candidates = list(range(first, hi + 1 - count + 1)) + list(range(lo, first))
    for base in candidates[::count]:
        block = list(range(base, base + count))
        if block[-1] <= hi and not any(port_in_use(p) for p in block):
            return block
    raise ServeError(f"no {count} free consecutive ports in {lo}-{hi}")


@dataclass
class EngineConfig:
    profile: Optional[str] = None
    dp: int = 1
    arms: Optional[str] = None  # "0=baseline,1=recommended"
    port: Optional[int] = None  # first port of the stack; default: free ports picked in PORT_RANGE
    num_gpu_blocks: int = 200
    block_size: int = 64
    max_num_seqs: int = 32
    max_model_len: int = 4096
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    num_cpu_blocks: int = 0  # the CPU swap tier (FastDeploy's --swap-space, in blocks); > 0 starts seam S10's process
    count_rpcs: bool = False  # harness seam H2: count the engine process's manager RPCs per thread
    time_schedule: bool = False  # harness seam H3: time every schedule() call in each rank's engine
    health_timeout: float = 240.0
    log_dir: Optional[str] = None
    env: dict = field(default_factory=dict)  # extra environment for the served stack


def _overlap_schedule_off() -> list:
    """The api_server flag that keeps the overlap schedule off: ``--no-enable-overlap-schedule`` where the host's
    default is on (2.6 and later); nothing where the flag is a plain switch that is off unless given (2.5)."""
    try:
        from fastdeploy.engine.args_utils import EngineArgs
    except Exception:  # noqa: BLE001 - the launch itself will say what is wrong with the host
        return ["--no-enable-overlap-schedule"]
    return ["--no-enable-overlap-schedule"] if getattr(EngineArgs, "enable_overlap_schedule", True) else []


def check_host_modules() -> str:
    """The host source directory; ServeError naming what is missing."""
    import importlib.util

    from fdsched.install.probe import HostNotFound, find_host

    try:
        source = find_host()
    except HostNotFound as exc:
        raise HostMissing(f"needs FastDeploy engine: {exc}") from None
    missing = [m for m in REQUIRED_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        from fdsched.tools.hostsetup import REQUIREMENTS

        raise HostMissing(f"needs FastDeploy engine: the serving stack's modules are missing: {', '.join(missing)}; "
                          f"`fdsched host setup` installs them, or: pip install -r {REQUIREMENTS}")
    return source


class ServedEngine:
    """Start the served stack; ``with ServedEngine(EngineConfig(...)) as eng: eng.urls ...``."""

    def __init__(self, config: EngineConfig = None, **kw):
        self.config = config or EngineConfig(**kw)
        c = self.config
        if c.dp < 1:
            raise ServeError(f"--dp {c.dp}: allowed: an integer >= 1")
        if c.num_cpu_blocks < 0:
            raise ServeError(f"--num-cpu-blocks {c.num_cpu_blocks}: allowed: an integer >= 0")
        if c.arms and c.dp < 2:
            raise ServeError(f"--arms {c.arms!r} needs --dp >= 2 (one arm per data-parallel rank)")
        self.procs: dict = {}
        self._tmp = tempfile.mkdtemp(prefix="fdsched-serve-")
        self.log_dir = c.log_dir or os.path.join(self._tmp, "log")
        os.makedirs(self.log_dir, exist_ok=True)
        self.state_dir = os.path.join(self._tmp, "state")
        os.makedirs(self.state_dir)
        self.ports: list = []
        self.urls: list = []
        self.metrics_urls: list = []
        self.router_url: Optional[str] = None
        self._descendants: set = set()

    # ----------------------------------------------------------------------------------- start / stop
    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    def _allocate_ports(self):
        c = self.config
        need = PORTS_PER_RANK * c.dp + (1 if c.dp > 1 else 0)
        if c.port is not None:
            block = list(range(c.port, c.port + need))
            busy = [p for p in block if port_in_use(p)]
            if busy:
                raise ServeError(f"--port {c.port}: port {busy[0]} is in use (the stack needs ports "
                                 f"{block[0]}-{block[-1]}); allowed: a first port whose {need} ports are free")
        else:
            block = free_ports(need)
        self.ports = block
        per = [block[i * PORTS_PER_RANK:(i + 1) * PORTS_PER_RANK] for i in range(c.dp)]
        self._rank_ports = per
        self.urls = [f"http://127.0.0.1:{p[0]}" for p in per]
        self.metrics_urls = [f"http://127.0.0.1:{p[1]}/metrics" for p in per]
        self.router_url = f"http://127.0.0.1:{block[-1]}" if c.dp > 1 else None

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
        if c.dp > 1:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(c.dp))  # seam S7
        env.update({k: str(v) for k, v in c.env.items()})
        return env

    def _server_args(self, model: str) -> list:
        c = self.config
        per = self._rank_ports
        joined = lambda i: ",".join(str(p[i]) for p in per)  # noqa: E731
        args = [
            "--model", model, "--max-model-len", str(c.max_model_len), "--max-num-seqs", str(c.max_num_seqs),
            "--block-size", str(c.block_size), "--num-gpu-blocks-override", str(c.num_gpu_blocks),
            "--max-num-batched-tokens", str(c.max_num_batched_tokens),
            "--engine-worker-queue-port", joined(2), "--cache-queue-port", joined(3),
            "--pd-comm-port", joined(4), "--rdma-comm-ports", joined(5),
            *_overlap_schedule_off(),
            "--enable-prefix-caching" if c.enable_prefix_caching else "--no-enable-prefix-caching",
        ]
        if c.num_cpu_blocks:
            args += ["--swap-space", repr(swap_space_gb(model, c.block_size, c.num_cpu_blocks))]
        if c.dp > 1:
            args += ["--data-parallel-size", str(c.dp), "--router", self.router_url]
        return args

    def _spawn(self, name: str, cmd: list, env: dict):
        out = open(os.path.join(self.log_dir, f"{name}.out"), "ab")
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        self.procs[name] = proc
        return proc

    def start(self):
        from fdsched.serve.model import make_model

        source = check_host_modules()
        self._allocate_ports()
        model = make_model()
        env = self._env(source)
        c = self.config
        py = sys.executable
        if c.dp == 1:
            p = self._rank_ports[0]
            self._spawn("api_server", [py, "-m", "fastdeploy.entrypoints.openai.api_server", "--port", str(p[0]),
                                       "--metrics-port", str(p[1])] + self._server_args(model), env)
        else:
            router_port = self.ports[-1]
            self._spawn("router", [py, "-m", "fastdeploy.router.launch", "--host", "127.0.0.1", "--port",
                                   str(router_port)], env)
            self._wait_http(self.router_url + "/health", "router", self.procs["router"])
            per = self._rank_ports
            self._spawn("multi_api_server", [
                py, "-m", "fastdeploy.entrypoints.openai.multi_api_server", "--num-servers", str(c.dp),
                "--ports", ",".join(str(q[0]) for q in per), "--metrics-ports", ",".join(str(q[1]) for q in per),
                "--args"] + self._server_args(model), env)
        self._wait_healthy()

    def rank_log_dir(self, rank: int) -> str:
        return self.log_dir if self.config.dp == 1 else os.path.join(self.log_dir, f"log_{rank}")

    def _alive_check(self):
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise ServeError(f"stage {name}: the process exited with code {proc.returncode} during start; "
                                 f"its output: {self._tail(name)}")

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

    def _wait_healthy(self):
        deadline = time.monotonic() + self.config.health_timeout
        pending = set(range(self.config.dp))
        while pending and time.monotonic() < deadline:
            self._alive_check()
            for rank in sorted(pending):
                if _http_ok(self.urls[rank] + "/health"):
                    pending.discard(rank)
            time.sleep(0.5)
        if pending:
            stages = "; ".join(self._stage_of(r) for r in sorted(pending))
            raise ServeError(f"stage {stages}: not healthy within {self.config.health_timeout:.0f}s; "
                             f"logs in {self.log_dir}")
        if self.router_url:
            while time.monotonic() < deadline:
                try:
                    with urllib.request.urlopen(self.router_url + "/registered_number", timeout=2) as r:
                        body = r.read().decode()
                    if str(self.config.dp) in re.findall(r"\d+", body):
                        return
                except OSError:
                    pass
                time.sleep(0.5)
            raise ServeError(f"stage router: the {self.config.dp} api_servers did not register with the Router "
                             f"within {self.config.health_timeout:.0f}s")

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
        """Terminate everything this stack started; sweep its /dev/shm segments. Idempotent."""
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
        _kill_pids(self._descendants)
        deadline = time.monotonic() + 10  # SIGKILL is not instantaneous: wait until they are gone
        while (still_running(self._descendants) or any(port_in_use(p) for p in self.ports)) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        self.procs.clear()
        sweep_shm(self.ports)

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
        import json

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


def swap_space_gb(model_dir: str, block_size: int, num_cpu_blocks: int) -> float:
    """FastDeploy's --swap-space (GiB) that gives exactly ``num_cpu_blocks`` CPU blocks for the model directory:
    the host computes int(swap_space * 2**30 / bytes_per_block) with bytes_per_block = kv heads * head_dim *
    2 bytes (bfloat16 cache) * 2 (K and V) * block_size * layers (CacheConfig, config.py ~1636-1652 new host).
    Every factor is a power of two times a small integer here, so the float round trip is exact."""
    import json

    with open(os.path.join(model_dir, "config.json")) as fh:
        cfg = json.load(fh)
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = heads * head_dim * 2 * 2 * block_size * cfg["num_hidden_layers"]
    return num_cpu_blocks * per_block / 2 ** 30


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


def _kill_pids(pids):
    for pid in still_running(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def still_running(descendants) -> list:
    """The (pid, create_time) pairs that are still the same live, non-zombie process."""
    import psutil

    alive = []
    for pid, created in descendants:
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.Error:
            pass
    return alive


def sweep_shm(ports, shm_dir: str = "/dev/shm") -> list:
    """Remove /dev/shm entries whose names carry one of ``ports`` as a whole number; returns what was removed."""
    if not ports or not os.path.isdir(shm_dir):
        return []
    pattern = re.compile(r"(?<!\d)(" + "|".join(str(p) for p in ports) + r")(?!\d)")
    return remove_files([name for name in os.listdir(shm_dir) if pattern.search(name)], shm_dir)


# ----------------------------------------------------------------------------------------------- CLI


