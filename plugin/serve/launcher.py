"""``fdsched serve``: FastDeploy's real OpenAI serving stack on CPU, the plugin loaded by ``FD_PLUGINS=fdsched``.

One rank: ``python -m fastdeploy.entrypoints.openai.api_server``. ``--dp N``: the Router
(``python -m fastdeploy.router.launch``) and ``python -m fastdeploy.entrypoints.openai.multi_api_server`` with
``--router``, as in examples/ab_run.md, with ``FDSCHED_PROFILE_BY_DP_RANK`` from ``--arms``. The host's own
commands, unchanged; the seams (:mod:`fdsched.serve.seams`) reach them through a ``sitecustomize`` on the
served stack's ``PYTHONPATH``.

:class:`ServedEngine` is the context manager the tests and the load generator use. Every process it starts
is in its own process group; stopping (also after Ctrl-C, a dead child or a failed start) terminates the
groups and every descendant, then removes the ``/dev/shm`` entries the stack's own processes created (recorded at
creation by the seams' ledger, :func:`fdsched.serve.seams.record_created`), nothing else.

Ownership, not port numbers: a stack holds a lease on each of its ports (:class:`PortLease`: one lock file per port
under :data:`PORT_LOCK_DIR`, held with ``fcntl.flock`` by the launcher and the stack's top process) from before
anything is spawned until everything is stopped, so a second launcher cannot take them.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Optional



PORT_RANGE = (18000, 18999)
PORTS_PER_RANK = 6  # api, metrics, engine-worker-queue, cache-queue, pd-comm, rdma
REQUIRED_MODULES = ("fastdeploy", "fastapi", "uvicorn", "gunicorn", "aiozmq", "jinja2", "ml_dtypes",
                    "partial_json_parser", "zmq", "tokenizers", "prometheus_client")



_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Exit)): (.+)$")


def last_exception(files) -> str:
    """The last exception line (``SomeError: ...``) written to any of ``files``, from the most recently written
    one; "" when none has one (a missing file is skipped)."""
    best = (0.0, "")
    for path in files:
        try:
            with open(path, errors="replace") as fh:
                lines = fh.read().splitlines()
            mtime = os.path.getmtime(path)
        except OSError:
            continue
        for line in reversed(lines):
            m = _EXCEPTION_LINE.match(line.strip())
            if m and "KeyboardInterrupt" not in line:
                if mtime >= best[0]:
                    best = (mtime, f"{m.group(1)}: {m.group(2)}"[:400])
                break
    return best[1]

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


# One lock file per port, shared by every user's fdsched stacks on this machine (sticky, world-writable like /tmp).
PORT_LOCK_DIR = os.path.join(tempfile.gettempdir(), "fdsched-ports")


class PortLease:
    """Exclusive use of ports among fdsched stacks: ``flock`` on ``PORT_LOCK_DIR/<port>.lock`` per port.

    The lock lives as long as one of its holders (the launcher, and the stack's top process, which inherits the
    descriptors), so a second ``fdsched serve`` on the same ports fails at once instead of racing the first one's
    start-up. Released files are removed while still locked; a taker re-checks after locking that its file is still
    the one on disk (the classic unlink-while-locked protocol), so no two holders can ever share a port."""

    def __init__(self, lock_dir: Optional[str] = None):
        self.lock_dir = lock_dir or PORT_LOCK_DIR
        self.held: dict = {}  # port -> fd

    def _open(self, path: str) -> int:
        os.makedirs(self.lock_dir, exist_ok=True)
        try:
            if os.stat(self.lock_dir).st_uid == os.getuid():
                os.chmod(self.lock_dir, 0o1777)  # other users' stacks lock here too
        except OSError:
            pass
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError:  # another user's file: flock works on a read-only descriptor
            fd = os.open(path, os.O_RDONLY)
        return fd

    def take(self, port: int) -> Optional[str]:
        """None when the port is now ours; else who holds it (``"pid 1234"`` or ``"another fdsched stack"``)."""
        if port in self.held:
            return None
        path = os.path.join(self.lock_dir, f"{port}.lock")
        for _attempt in range(20):
            try:
                fd = self._open(path)
            except FileNotFoundError:  # the directory was removed by a releasing stack just now
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
                os.close(fd)
                return f"pid {holder}" if holder.isdigit() else "another fdsched stack"
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # its holder released (and removed) it between our open and our lock: take the new one
                os.close(fd)
                continue
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError:
                pass  # read-only (another user's file): the lock is what counts
            self.held[port] = fd
            return None
        return "another fdsched stack (its lock file kept changing)"

    def fds(self) -> tuple:
        return tuple(self.held.values())

    def release(self) -> None:
        for port, fd in sorted(self.held.items()):
            try:
                os.unlink(os.path.join(self.lock_dir, f"{port}.lock"))  # still locked: nobody holds it after us
            except OSError:
                pass
            os.close(fd)
        self.held.clear()
        try:
            os.rmdir(self.lock_dir)  # only when empty: another stack's locks keep it
        except OSError:
            pass


def free_ports(count: int, start: Optional[int] = None, port_range=PORT_RANGE, lease: Optional[PortLease] = None) -> list:
    """``count`` consecutive free ports in ``port_range`` (from ``start`` if given, else a random offset); with
    ``lease``, ports some other fdsched stack holds are skipped and the block returned is held in ``lease``."""
    import random

    lo, hi = port_range
    first = start if start is not None else lo + random.randrange(0, max(1, hi - lo - count))
    candidates = list(range(first, hi + 1 - count + 1)) + list(range(lo, first))
    for base in candidates[::count]:
        block = list(range(base, base + count))
        if block[-1] > hi or any(port_in_use(p) for p in block):
            continue
        if lease is None:
            return block
        taken = [p for p in block if lease.take(p) is None]
        if len(taken) == len(block) and not any(port_in_use(p) for p in block):
            return block
        for p in taken:  # a partial block: give it back
            fd = lease.held.pop(p)
            try:
                os.unlink(os.path.join(lease.lock_dir, f"{p}.lock"))
            except OSError:
                pass
            os.close(fd)
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
    finish_delay_ms: float = 0.0  # harness seam H7: each finish on the host's finish pool runs this much later
    health_timeout: float = 240.0
    host: str = "127.0.0.1"  # the address the api_server, metrics and router ports listen on
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


def check_config(c: EngineConfig) -> list:
    """Every problem of the configuration, one line each (empty when it can start); nothing is spawned."""
    from fdsched.core.settings import SettingsError, load_settings, parse_dp_arms
    from fdsched.replay.costmodel import check_replay_settings

    problems = []
    for key in ("num_gpu_blocks", "block_size", "max_num_seqs", "max_model_len", "max_num_batched_tokens"):
        value = getattr(c, key)
        if not isinstance(value, int) or value < 1:
            problems.append(f"--{key.replace('_', '-')} {value}: allowed: an integer >= 1")
    if not isinstance(c.dp, int) or c.dp < 1:
        problems.append(f"--dp {c.dp}: allowed: an integer >= 1")
    if c.num_cpu_blocks < 0:
        problems.append(f"--num-cpu-blocks {c.num_cpu_blocks}: allowed: an integer >= 0")
    if not (c.health_timeout > 0):
        problems.append(f"--health-timeout {c.health_timeout}: allowed: seconds > 0")
    if c.port is not None:
        need = PORTS_PER_RANK * max(1, c.dp if isinstance(c.dp, int) else 1) + (1 if c.dp > 1 else 0)
        if not (1024 <= c.port <= 65535 - need + 1):
            problems.append(f"--port {c.port}: allowed: 1024-{65535 - need + 1} (the stack needs {need} ports "
                            "from there)")
    try:
        socket.getaddrinfo(c.host, None)
    except (OSError, UnicodeError):
        problems.append(f"--host {c.host!r}: not an address of this machine; allowed: an IP address or host name, "
                        f"e.g. {LOOPBACK} (the default) or 0.0.0.0 (every interface)")
    # the stack's environment: FDSCHED_PROFILE* come from the flags only
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FDSCHED_PROFILE")}
    profiles = []
    if c.arms:
        try:
            arms = parse_dp_arms(c.arms, origin="--arms")
        except SettingsError as exc:
            problems.append(str(exc))
            arms = {}
        if c.dp < 2:
            problems.append(f"--arms {c.arms!r} needs --dp >= 2 (one arm per data-parallel rank); for arms that "
                            "each get the whole trace, name them without ranks: --arms baseline,recommended")
        beyond = sorted(r for r in arms if r >= c.dp)
        if beyond and c.dp >= 2:
            problems.append(f"--arms {c.arms!r}: rank {beyond[0]} does not exist with --dp {c.dp}; allowed: ranks "
                            f"0-{c.dp - 1}")
        profiles += [(f"--arms rank {r}", p) for r, p in sorted(arms.items())]
    if c.profile:
        profiles.append(("--profile", c.profile))
    try:  # every FDSCHED_* variable, once, on the built-in defaults
        load_settings(environ, profile=None)
    except SettingsError as exc:
        problems.append(str(exc))
        environ = {}  # then each profile on its own, so that one bad variable is one line
    for origin, profile in profiles:
        try:  # the stack's simulated worker steps by the replay's cost model: its key is checked too
            check_replay_settings(load_settings(environ, profile=profile))
        except SettingsError as exc:
            problems.append(f"{origin}: {exc}")
    return list(dict.fromkeys(problems))


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
        raise HostMissing(f"needs FastDeploy engine: the serving stack's modules are missing: {', '.join(missing)}; "
                          "`fdsched host setup` installs them")
    return source


LOOPBACK = "127.0.0.1"
GONE_GRACE_S = 1.0  # how long a watched process may be gone before it is named without its exit status


@dataclass(frozen=True)
class Death:
    """A process of the stack that is gone: which rank, which role, how it ended."""

    rank: Optional[int]
    role: str
    pid: int
    code: Optional[int] = None  # exit status; negative: killed by that signal (Popen's convention)
    when: float = 0.0

    def text(self) -> str:
        where = f"rank {self.rank} {self.role}" if self.rank is not None else self.role
        if self.code is None:
            how = "is gone (not our child: its exit status is its parent's)"
        elif self.code < 0:
            try:
                how = f"was killed by {signal.Signals(-self.code).name}"
            except ValueError:
                how = f"was killed by signal {-self.code}"
        else:
            how = f"exited with code {self.code}"
        return f"{where} (pid {self.pid}) {how}"


class ServedEngine:
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

    def _allocate_ports(self):
        c = self.config
        need = PORTS_PER_RANK * c.dp + (1 if c.dp > 1 else 0)
        if c.port is not None:
            block = list(range(c.port, c.port + need))
            for p in block:
                holder = self._lease.take(p)
                if holder is not None or port_in_use(p):
                    self._lease.release()
                    why = f"held by {holder}" if holder is not None else "in use"
                    raise ServeError(f"--port {c.port}: port {p} is {why} (the stack needs ports "
                                     f"{block[0]}-{block[-1]}); allowed: a first port whose {need} ports are free")
        else:
            block = free_ports(need, lease=self._lease)
        self.ports = block
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

    # ----------------------------------------------------------------------------------- watching
    def deaths(self) -> list:
        """Every process of the stack known to be gone, earliest first (empty while all live)."""
        found = {}
        for f in sorted(os.listdir(os.path.join(self.state_dir, "exits"))):  # recorded by the seams' watchers
            try:
                with open(os.path.join(self.state_dir, "exits", f)) as fh:
                    d = json.load(fh)
            except (OSError, ValueError):
                continue
            found[d["pid"]] = Death(d.get("rank"), d["role"], d["pid"], d.get("code"), d.get("time", 0.0))
        now = time.time()
        for name, proc in self.procs.items():
            if proc.poll() is not None and proc.pid not in found:
                rank = 0 if name == "api_server" else None
                found[proc.pid] = Death(rank, name, proc.pid, proc.returncode, now)
        if self._watched:
            import psutil

            for (pid, created), (rank, role) in self._watched.items():
                if pid in found:
                    continue
                try:
                    p = psutil.Process(pid)
                    alive = p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE
                except psutil.Error:
                    alive = False
                if alive:
                    continue
                # Its parent's watcher records how it ended (an exits record) a moment after it goes: wait that
                # long before naming it without its status.
                first_seen = self._gone_since.setdefault(pid, now)
                if now - first_seen >= GONE_GRACE_S:
                    found[pid] = Death(rank, role, pid, None, first_seen)
        # earliest first; at one detection time, a death whose status is known (the cause) before the ones it took
        return sorted(found.values(), key=lambda d: (d.when, d.code is None, d.pid))

    def check_alive(self) -> None:
        """ServeError in one line naming the first process that is gone (rank, role, signal or exit code), the
        others after it, and the host's own error message where its output has one."""
        dead = self.deaths()
        if not dead:
            return
        first = dead[0]
        message = first.text()
        rest = [d.text() for d in dead[1:]]
        if rest:
            message += "; then " + ", ".join(rest[:3]) + (f" and {len(rest) - 3} more" if len(rest) > 3 else "")
        host_error = self.host_error(first.rank)
        if host_error:
            message += f"; the host said: {host_error}"
        raise ServeError(message)

    def host_error(self, rank: Optional[int]) -> str:
        """The last exception line (``SomeError: ...``) the host wrote for ``rank``: the api_server's own output
        (``api_server.out``, ``multi_api_server.out`` under data parallelism) and the rank's log files."""
        files = [os.path.join(self.log_dir, "api_server.out"), os.path.join(self.log_dir, "multi_api_server.out")]
        if rank is not None:
            d = self.rank_log_dir(rank)
            if os.path.isdir(d):
                files += [os.path.join(d, f) for f in sorted(os.listdir(d)) if f.endswith(".log")]
        return last_exception(files)

    def _watch_engine_processes(self):
        """Record, once the stack is up, each rank's api_server and its descendants (the engine's queue managers
        and cache processes; the simulated workers): a later disappearance of any of them stops the stack."""
        try:
            import psutil
        except ImportError:
            return
        roots = []
        if self.config.dp == 1 and "api_server" in self.procs:
            roots.append((0, self.procs["api_server"].pid))
        elif "multi_api_server" in self.procs:
            try:
                for child in psutil.Process(self.procs["multi_api_server"].pid).children():
                    m = re.search(r"--local-data-parallel-id\s+(\d+)", " ".join(child.cmdline()))
                    if m:
                        roots.append((int(m.group(1)), child.pid))
            except psutil.Error:
                pass
        for rank, pid in roots:
            try:
                root = psutil.Process(pid)
                self._watched[(pid, root.create_time())] = (rank, "api_server")
                children = root.children(recursive=True)
                workers = {c.pid for c in children if "worker.py" in " ".join(c.cmdline())}
                for child in children:
                    if child.ppid() in workers:  # a worker's own helpers (its resource tracker) go with it
                        continue
                    line = " ".join(child.cmdline())
                    m = re.search(r"--dp-rank\s+(\d+)", line)
                    if "worker.py" in line and m:
                        who = (int(m.group(1)), "worker")
                    elif "worklaunch.py" in line:
                        who = (rank, "worker launcher")
                    elif "cachexfer.py" in line:
                        who = (rank, "cache transfer manager")
                    else:
                        who = (rank, "engine process")
                    self._watched[(child.pid, child.create_time())] = who
            except psutil.Error:
                pass

    def _alive_check(self):
        try:
            self.check_alive()
        except ServeError as exc:
            raise ServeError(f"during start-up: {exc}; logs in {self.log_dir}") from None

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
        self._descendants.update(_group_members(self._groups))
        _kill_pids(self._descendants)
        deadline = time.monotonic() + 10  # SIGKILL is not instantaneous: wait until they are gone
        while (still_running(self._descendants) or any(port_in_use(p) for p in self.ports)) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        self.procs.clear()
        self.removed_shm += remove_created(self.state_dir)
        self._lease.release()

    def created_shm_left(self) -> list:
        """The /dev/shm entries this stack's processes created that are still there (same name and inode)."""
        return [path for path, _ino in _created_entries(self.state_dir, still_there=True)]

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


def _created_entries(state_dir: str, still_there: bool = False) -> list:
    """(path, inode) of every /dev/shm entry the stack's processes recorded creating (seams' ledger).

    A creation is recorded twice: an intent before the call (with the inode at the path then, if any), and the
    entry's inode after it (or that it failed). An intent left open means the process ended inside the call; the
    entry at the path is then the one that call made when it is of the kind the call makes and is not the one that
    was there before it. Such an entry is only known while it is there, whatever ``still_there`` says."""
    from fdsched.serve.seams import SHM_LEDGER

    entries, seen, open_intents = [], set(), {}

    def add(path, ino):
        if (path, ino) in seen:
            return
        seen.add((path, ino))
        if still_there:
            try:
                if os.stat(path).st_ino != ino:
                    return
            except OSError:
                return
        entries.append((path, ino))

    try:
        with open(os.path.join(state_dir, SHM_LEDGER), errors="replace") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                    if "intent" in rec:
                        open_intents[(rec["pid"], rec["intent"])] = rec
                    elif "failed" in rec:
                        open_intents.pop((rec["pid"], rec["failed"]), None)
                    else:
                        open_intents.pop((rec["pid"], rec["path"]), None)
                        add(rec["path"], rec["ino"])
                except (ValueError, KeyError, TypeError):
                    continue
    except OSError:
        pass
    for rec in open_intents.values():
        path = rec["intent"]
        try:
            st = os.stat(path)
        except OSError:
            continue
        kind_ok = stat.S_ISSOCK(st.st_mode) if rec.get("kind") == "socket" else stat.S_ISREG(st.st_mode)
        if kind_ok and st.st_ino != rec.get("before"):
            add(path, st.st_ino)
    return entries


def remove_created(state_dir: str) -> list:
    """Remove the /dev/shm entries the stack's own processes created and that are still the same file (name and
    inode as recorded at creation); nothing found only by its name. Returns the paths removed."""
    removed = []
    for path, ino in _created_entries(state_dir, still_there=True):
        try:
            if os.stat(path).st_ino == ino:
                os.unlink(path)
                removed.append(path)
        except OSError:
            pass
    return removed


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


def _group_members(pgids) -> set:
    """(pid, create_time) of the live, non-zombie processes in the process groups ``pgids``. A group's number is not
    handed out again while any process is in it, and a member found here is one: it belongs to the stack."""
    try:
        import psutil
    except ImportError:
        return set()
    members = set()
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) in pgids and proc.status() != psutil.STATUS_ZOMBIE:
                members.add((proc.pid, proc.create_time()))
        except (psutil.Error, OSError):
            pass
    return members


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


# ----------------------------------------------------------------------------------------------- CLI


