"""The served stack's configuration (:class:`EngineConfig`) and what is checked before anything is spawned:
the values (:func:`check_config`), the host and its serving modules (:func:`check_host_modules`). The error every
part of ``fdsched serve`` raises is :class:`ServeError`."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Optional

PORT_RANGE = (18000, 18999)
PORTS_PER_RANK = 6  # api, metrics, engine-worker-queue, cache-queue, pd-comm, rdma
REQUIRED_MODULES = ("fastdeploy", "fastapi", "uvicorn", "gunicorn", "aiozmq", "jinja2", "ml_dtypes",
                    "partial_json_parser", "zmq", "tokenizers", "prometheus_client")
LOOPBACK = "127.0.0.1"


class ServeError(RuntimeError):
    """One clear error (the CLI prints it without a traceback)."""


class HostMissing(ServeError):
    """The host, or the serving stack's modules, are not there (exit code 2, as every command without a host)."""


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


def overlap_schedule_off() -> list:
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


def swap_space_gb(model_dir: str, block_size: int, num_cpu_blocks: int) -> float:
    """FastDeploy's --swap-space (GiB) that gives exactly ``num_cpu_blocks`` CPU blocks for the model directory:
    the host computes int(swap_space * 2**30 / bytes_per_block) with bytes_per_block = kv heads * head_dim *
    2 bytes (bfloat16 cache) * 2 (K and V) * block_size * layers (CacheConfig, config.py ~1636-1652 at d38eeb8).
    Every factor is a power of two times a small integer here, so the float round trip is exact."""
    import json

    with open(os.path.join(model_dir, "config.json")) as fh:
        cfg = json.load(fh)
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = heads * head_dim * 2 * 2 * block_size * cfg["num_hidden_layers"]
    return num_cpu_blocks * per_block / 2 ** 30
