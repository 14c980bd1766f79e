"""``fdsched serve --prefill N --decode M``: FastDeploy's PD-disaggregated stack on CPU, the plugin in every engine.

The host's own processes, started with the host's own commands: the Router in splitwise mode
(``python -m fastdeploy.router.launch --splitwise``), then one ``api_server`` per instance with
``--splitwise-role prefill`` or ``decode`` and ``--router``; each registers itself with the Router, which sends
every request to one prefill and one decode instance. Inside each api_server everything runs as on a GPU machine
(the ``LLMEngine``, the scheduler, the ``SplitwiseConnector`` between the two engines, the cache manager, the
token processor) except what needs a GPU: the worker (:mod:`fdsched.serve.worker`, seam S2) and the cache
messager that moves the KV bytes between instances (:mod:`fdsched.serve.pdxfer`, seam S12).

Each instance gets its own log directory, state directory (exit records, drain gate, /dev/shm ledger, state
probe) and profile: ``--profile`` for every instance, ``--role-profiles prefill=P,decode=D`` per role.
:class:`PdServedEngine` is the context manager; everything else (ports, ownership, stopping) is
:class:`fdsched.serve.launcher.ServedEngine`'s.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import Optional

from fdsched.serve.config import LOOPBACK, PORTS_PER_RANK, EngineConfig, ServeError, check_config
from fdsched.serve.launcher import ServedEngine
from fdsched.serve.watch import Death, last_exception

__all__ = ["ROLES", "PdConfig", "PdServedEngine", "parse_role_profiles", "pd_config_problems", "instance_profiles"]

ROLES = ("prefill", "decode")
TRANSFER_PROTOCOL = "rdma"  # the one route the simulated messager carries (pdxfer's docstring says why)


@dataclass
class PdConfig(EngineConfig):
    prefill: int = 1
    decode: int = 1
    role_profiles: Optional[str] = None  # "prefill=pd_prefill_cache,decode=baseline"
    decode_num_gpu_blocks: Optional[int] = None  # the decode instances' KV pool, when not num_gpu_blocks


def parse_role_profiles(text: Optional[str], origin: str = "--role-profiles") -> dict:
    """``prefill=P,decode=D`` -> {role: profile}; ValueError with one line naming the bad item."""
    out = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        role, sep, profile = (x.strip() for x in item.partition("="))
        if not sep or not profile:
            raise ValueError(f"{origin} {text!r}: bad item {item!r}; allowed: ROLE=PROFILE items, comma-separated, "
                             f"ROLE one of {', '.join(ROLES)}")
        if role not in ROLES:
            close = difflib.get_close_matches(role, ROLES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{origin} {text!r}: unknown role {role!r}{hint}; allowed: {', '.join(ROLES)}")
        if role in out:
            raise ValueError(f"{origin} {text!r}: role {role!r} named twice; allowed: one profile per role")
        out[role] = profile
    return out


def instance_profiles(c: PdConfig) -> list:
    """``[(name, role, profile or None), ...]``: every instance, prefill ones first."""
    try:
        by_role = parse_role_profiles(c.role_profiles)
    except ValueError:
        by_role = {}
    return [(f"{role} {i}", role, by_role.get(role, c.profile))
            for role, count in (("prefill", c.prefill), ("decode", c.decode)) for i in range(count)]


def pd_config_problems(c: PdConfig) -> list:
    """Every problem of a PD configuration, one line each, before anything is spawned (no host needed)."""
    from fdsched.core.settings import SettingsError, load_settings

    problems = []
    for flag, value in (("--prefill", c.prefill), ("--decode", c.decode)):
        if not isinstance(value, int) or not 1 <= value <= 4:
            problems.append(f"{flag} {value}: allowed: 1-4 instances (each is a whole engine on this host's cores)")
    if c.dp != 1:
        problems.append(f"--dp {c.dp} with --prefill/--decode: allowed: --dp 1 (each PD instance is one rank)")
    if c.arms:
        problems.append(f"--arms {c.arms!r} with --prefill/--decode: allowed: --role-profiles ROLE=PROFILE (one "
                        "profile per role) or --profile")
    if c.decode_num_gpu_blocks is not None and (not isinstance(c.decode_num_gpu_blocks, int)
                                                or c.decode_num_gpu_blocks < 1):
        problems.append(f"--decode-num-gpu-blocks {c.decode_num_gpu_blocks}: allowed: an integer >= 1")
    if c.num_cpu_blocks:
        problems.append(f"--num-cpu-blocks {c.num_cpu_blocks} with --prefill/--decode: allowed: 0 (the CPU swap "
                        "tier is served on the mixed stack only)")
    try:
        by_role = parse_role_profiles(c.role_profiles)
    except ValueError as exc:
        return problems + [str(exc)]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FDSCHED_PROFILE")}
    from fdsched.replay.costmodel import check_replay_settings

    for role, profile in sorted(by_role.items()):
        try:  # the role's simulated worker steps by the replay's cost model: its key is checked too
            check_replay_settings(load_settings(environ, profile=profile))
        except SettingsError as exc:
            problems.append(f"--role-profiles {role}: {exc}")
    base = check_config(EngineConfig(**{k: getattr(c, k) for k in EngineConfig.__dataclass_fields__ if k != "dp"}))
    return problems + [p for p in base if not p.startswith("--port")]


class PdServedEngine(ServedEngine):
    """The PD stack: ``with PdServedEngine(PdConfig(prefill=1, decode=1)) as eng: eng.router_url ...``.

    ``urls`` / ``metrics_urls`` / ``engine_state(i)`` are per instance, prefill ones first (``instances[i]``)."""

    def __init__(self, config: PdConfig = None, progress=None, **kw):
        config = config or PdConfig(**kw)
        problems = pd_config_problems(config)
        if problems:
            raise ServeError(problems[0])
        self.instances: list = []
        super().__init__(config, progress)

    # ----------------------------------------------------------------------------------- layout
    def _allocate_ports(self):
        c = self.config
        block = self._port_block(PORTS_PER_RANK * (c.prefill + c.decode) + 1)
        client = LOOPBACK if c.host in ("0.0.0.0", "::", "") else c.host
        self.instances = []
        for i, (name, role, profile) in enumerate(instance_profiles(c)):
            ports = block[i * PORTS_PER_RANK:(i + 1) * PORTS_PER_RANK]
            tag = name.replace(" ", "")
            inst = {"name": name, "role": role, "profile": profile, "ports": ports,
                    "log_dir": os.path.join(self.log_dir, tag), "state_dir": os.path.join(self._tmp, f"state-{tag}"),
                    "url": f"http://{client}:{ports[0]}", "metrics": f"http://{client}:{ports[1]}/metrics"}
            for sub in ("exits", "drain"):
                os.makedirs(os.path.join(inst["state_dir"], sub), exist_ok=True)
            os.makedirs(inst["log_dir"], exist_ok=True)
            self.instances.append(inst)
        self.urls = [inst["url"] for inst in self.instances]
        self.metrics_urls = [inst["metrics"] for inst in self.instances]
        self.router_url = f"http://{client}:{block[-1]}"
        self._rank_ports = [self.instances[0]["ports"]]

    def _instance_env(self, base: dict, inst: dict) -> dict:
        from fdsched.serve import seams

        env = dict(base)
        env.pop("FDSCHED_PROFILE", None)
        env.pop("FDSCHED_PROFILE_BY_DP_RANK", None)
        if inst["profile"]:
            env["FDSCHED_PROFILE"] = inst["profile"]
        env[seams.STATE_ENV] = inst["state_dir"]
        env["FD_LOG_DIR"] = inst["log_dir"]
        env["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(inst["state_dir"], "prom")
        os.makedirs(env["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)
        return env

    def start(self):
        from fdsched.serve.config import check_host_modules
        from fdsched.serve.model import make_model

        source = check_host_modules()
        self._allocate_ports()
        model = make_model()
        base = self._env(source)
        c = self.config
        py = sys.executable
        t0 = time.monotonic()
        router_port = self.ports[-1]
        router_env = dict(base, FD_LOG_DIR=os.path.join(self.log_dir, "router"))
        self.progress(f"starting router (splitwise) on {c.host}:{router_port} ...")
        self._spawn("router", [py, "-m", "fastdeploy.router.launch", "--host", c.host, "--port", str(router_port),
                               "--splitwise"], router_env)
        self._wait_http(self.router_url + "/health", "router", self.procs["router"])
        self.progress(f"router up in {time.monotonic() - t0:.0f} s")
        for inst in self.instances:
            self._rank_ports = [inst["ports"]]
            args = self._server_args(model) + ["--splitwise-role", inst["role"], "--router", self.router_url,
                                               "--cache-transfer-protocol", TRANSFER_PROTOCOL]
            if inst["role"] == "decode" and c.decode_num_gpu_blocks:
                args[args.index("--num-gpu-blocks-override") + 1] = str(c.decode_num_gpu_blocks)
            p = inst["ports"]
            self.progress(f"starting {inst['name']} api_server on {c.host}:{p[0]} (metrics {p[1]}, profile "
                          f"{inst['profile'] or 'default'}) ...")
            self._spawn(inst["name"], [py, "-m", "fastdeploy.entrypoints.openai.api_server", "--port", str(p[0]),
                                       "--metrics-port", str(p[1])] + args, self._instance_env(base, inst))
        self._wait_pd_healthy(t0)
        self._watch_engine_processes()

    def _wait_pd_healthy(self, t0: float):
        deadline = time.monotonic() + self.config.health_timeout
        pending = {inst["name"] for inst in self.instances}
        while pending and time.monotonic() < deadline:
            self._alive_check()
            for inst in self.instances:
                if inst["name"] in pending and _get_json(inst["url"] + "/health") is not None:
                    pending.discard(inst["name"])
                    self.progress(f"{inst['name']} up in {time.monotonic() - t0:.0f} s")
            time.sleep(0.5)
        if pending:
            stages = "; ".join(self._pd_stage_of(i) for i in self.instances if i["name"] in pending)
            raise ServeError(f"stage {stages}: not healthy within {self.config.health_timeout:.0f}s; allowed: a "
                             f"longer --health-timeout, or see the instance's logs in {self.log_dir}")
        want = {"prefill": self.config.prefill, "decode": self.config.decode}
        got = {}
        while time.monotonic() < deadline:
            self._alive_check()
            got = _get_json(self.router_url + "/registered_number") or {}
            if all(int(got.get(role, 0)) >= n for role, n in want.items()):
                self.progress(f"{want['prefill']} prefill and {want['decode']} decode instance(s) registered with "
                              f"the router in {time.monotonic() - t0:.0f} s")
                return
            time.sleep(0.5)
        raise ServeError(f"stage router: registered {got or 'nothing'}, expected {want} within "
                         f"{self.config.health_timeout:.0f}s; see {os.path.join(self.log_dir, 'router')}")

    def _pd_stage_of(self, inst: dict) -> str:
        log = os.path.join(inst["log_dir"], "simworker_rank0.log")
        if not os.path.exists(log):
            messager = os.path.join(inst["log_dir"], "launch_cache_messager_0.log")
            what = "its cache messager" if not os.path.exists(messager) else "its worker"
            return f"{inst['name']} api_server (the engine did not launch {what})"
        with open(log, errors="replace") as fh:
            if "ready:" not in fh.read():
                return f"{inst['name']} worker ready"
        return f"{inst['name']} engine start (/health)"

    def rank_log_dir(self, rank: int) -> str:
        return self.instances[rank]["log_dir"]

    # ----------------------------------------------------------------------------------- watching
    def deaths(self) -> list:
        found = {}
        for inst in self.instances:
            exits = os.path.join(inst["state_dir"], "exits")
            for f in sorted(os.listdir(exits)) if os.path.isdir(exits) else []:
                try:
                    with open(os.path.join(exits, f)) as fh:
                        d = json.load(fh)
                except (OSError, ValueError):
                    continue
                found[d["pid"]] = Death(None, f"{inst['name']} {d['role']}", d["pid"], d.get("code"),
                                        d.get("time", 0.0))
        names = {inst["name"] for inst in self.instances}
        for death in ServedEngine.deaths(self):
            if death.pid not in found:
                role = f"{death.role} api_server" if death.role in names else death.role
                found[death.pid] = Death(None, role, death.pid, death.code, death.when)
        return sorted(found.values(), key=lambda d: (d.when, d.code is None, d.pid))

    def host_error(self, rank) -> str:
        best = ""
        for inst in self.instances:
            best = last_exception([os.path.join(self.log_dir, f"{inst['name']}.out")] +
                                        [os.path.join(inst["log_dir"], f) for f in _files(inst["log_dir"])]) or best
        return best

    def _watch_engine_processes(self):
        try:
            import psutil
        except ImportError:
            return
        for inst in self.instances:
            proc = self.procs.get(inst["name"])
            if proc is None:
                continue
            try:
                root = psutil.Process(proc.pid)
                self._watched[(proc.pid, root.create_time())] = (None, f"{inst['name']} api_server")
                children = root.children(recursive=True)
                workers = {ch.pid for ch in children if "worker.py" in " ".join(ch.cmdline())}
                for child in children:
                    if child.ppid() in workers:
                        continue
                    line = " ".join(child.cmdline())
                    what = ("worker" if "worker.py" in line else "worker launcher" if "worklaunch.py" in line
                            else "cache messager" if "pdxfer.py" in line else "engine process")
                    if line.startswith("/bin/sh") or line.startswith("sh "):
                        continue  # the host's shell around the cache messager's command
                    self._watched[(child.pid, child.create_time())] = (None, f"{inst['name']} {what}")
            except psutil.Error:
                pass

    # ----------------------------------------------------------------------------------- drain / stop / state
    def drain(self, timeout: float, poll: float = 0.1) -> dict:
        """The mixed stack's drain over every instance whose api_server still runs. What was in flight on an instance
        whose api_server is gone cannot be answered by anyone: counted as ``lost``, not waited for."""
        from fdsched.serve import seams

        t0 = time.monotonic()
        live, lost = [], 0
        for inst in self.instances:
            proc = self.procs.get(inst["name"])
            if proc is not None and proc.poll() is None:
                live.append(inst["state_dir"])
            else:
                lost += seams.drain_counts(inst["state_dir"], wait_ack=0)["in_flight"]
        for d in live:
            seams.request_drain(d)

        def counts():
            per = [seams.drain_counts(d) for d in live]
            return {k: sum(p[k] for p in per) for k in ("in_flight", "finished", "ended", "refused")}

        dead_before = len(self.deaths())
        deadline = t0 + timeout
        while time.monotonic() < deadline and counts()["in_flight"] and len(self.deaths()) == dead_before:
            time.sleep(poll)
        total = counts()
        if total["in_flight"]:
            for d in live:
                seams.request_abort(d)
            end = time.monotonic() + 5
            while time.monotonic() < end and counts()["in_flight"]:
                time.sleep(poll)
            total = counts()
        total["lost"] = lost
        total["seconds"] = time.monotonic() - t0
        return total

    def stop(self):
        from fdsched.serve.teardown import remove_created

        # An instance's cache messager runs in a session of its own (the host's launch), its worker launcher in a
        # group of its own: once an instance's api_server is gone they are nobody's descendants any more. Every
        # process seen at start-up is the stack's to stop.
        self._descendants.update(self._watched)
        super().stop()
        for inst in self.instances:
            self.removed_shm += remove_created(inst["state_dir"])

    def created_shm_left(self) -> list:
        from fdsched.serve.teardown import created_entries

        left = super().created_shm_left()
        for inst in self.instances:
            left += [path for path, _ino in created_entries(inst["state_dir"], still_there=True)]
        return left

    def engine_state(self, rank: int = 0, timeout: float = 20.0) -> dict:
        state_dir = self.instances[rank]["state_dir"]
        answer = os.path.join(state_dir, "state-rank0.json")
        if os.path.exists(answer):
            os.remove(answer)
        open(os.path.join(state_dir, "ask-rank0"), "w").close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(answer):
                with open(answer) as fh:
                    return json.load(fh)
            time.sleep(0.05)
        raise ServeError(f"{self.instances[rank]['name']}: the engine's state probe did not answer within "
                         f"{timeout:.0f}s")

    def hold_transfers(self, hold: bool = True) -> None:
        """Hold (or release) every prefill instance's KV writes: a held write has its prefill done and its decode
        blocks allocated, and sends nothing until released (:func:`fdsched.serve.pdxfer.hold_path`)."""
        from fdsched.serve.pdxfer import hold_path

        for inst in self.instances:
            if inst["role"] != "prefill":
                continue
            path = hold_path(inst["state_dir"])
            if hold:
                open(path, "w").close()
            elif os.path.exists(path):
                os.remove(path)

    def messager_log(self, rank: int) -> str:
        try:
            with open(os.path.join(self.instances[rank]["log_dir"], "launch_cache_messager_0.log"),
                      errors="replace") as fh:
                return fh.read()
        except OSError:
            return ""


def _files(d: str) -> list:
    try:
        return sorted(f for f in os.listdir(d) if f.endswith(".log"))
    except OSError:
        return []


def _get_json(url: str):
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            if r.status != 200:
                return None
            body = r.read().decode() or "{}"
            try:
                return json.loads(body)
            except ValueError:
                return {}
    except Exception:  # noqa: BLE001
        return None
