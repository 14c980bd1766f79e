"""Build the real host scheduler without a GPU: its configs, the scheduler, its requests, a logical clock.

The one harness: the replay (:mod:`fdsched.replay.runner`), the benchmarks (:mod:`fdsched.tools.bench`)
and the host tests all build the scheduler through this module and step it with
:class:`fdsched.replay.driver.Driver` (which plays worker and token processor). It builds
``ResourceManagerV1`` through whatever class the host module binds at call time, so with the plugin
installed it is the plugin's subclass; the configs are the host's own classes, so the host's own config
checks run on the shape (:func:`host_config`).

Everything is deterministic for the same inputs: the prefix cache's LRU timestamps come from a logical clock
(:func:`logical_clock`).
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Optional

from fdsched.core.common import ceil_div
from fdsched.replay.trace import ENGINE_DEFAULTS, TraceError, check_engine_shape

__all__ = [
    "EngineShape",
    "prepare_host_environment",
    "build_manager",
    "close_manager",
    "make_request",
    "logical_clock",
]


def prepare_host_environment() -> None:
    """Environment the host's modules need on a CPU machine (idempotent; set before importing them)."""
    os.environ.setdefault("ENABLE_V1_KVCACHE_SCHEDULER", "1")
    for var in ("PROMETHEUS_MULTIPROC_DIR", "FD_LOG_DIR"):
        if not os.environ.get(var):
            os.environ[var] = tempfile.mkdtemp(prefix=f"fdsched-{var.lower()}-")
            _remove_at_exit(os.environ[var])


def _remove_at_exit(path: str) -> None:
    """The directory this process made goes when it exits (only in the process that made it: a forked child
    inherits the registration, not the ownership)."""
    import atexit
    import shutil

    owner = os.getpid()
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(path, ignore_errors=True))


@dataclass(frozen=True)
class EngineShape:
    """The engine the scheduler thinks it runs on (defaults: :data:`fdsched.replay.trace.ENGINE_DEFAULTS`)."""

    block_size: int = ENGINE_DEFAULTS["block_size"]
    num_gpu_blocks: int = ENGINE_DEFAULTS["num_gpu_blocks"]
    max_num_seqs: int = ENGINE_DEFAULTS["max_num_seqs"]
    max_num_batched_tokens: int = ENGINE_DEFAULTS["max_num_batched_tokens"]
    max_model_len: int = ENGINE_DEFAULTS["max_model_len"]
    enable_prefix_caching: bool = ENGINE_DEFAULTS["enable_prefix_caching"]
    splitwise_role: str = ENGINE_DEFAULTS["splitwise_role"]
    enc_dec_block_num: int = ENGINE_DEFAULTS["enc_dec_block_num"]

    def check(self) -> None:
        """Raises :class:`fdsched.replay.trace.TraceError` (a ValueError) naming the bad key."""
        check_engine_shape(asdict(self))


class HostConfigError(TraceError):
    """The host refuses the scheduler the replay builds (its own config checks, or a config shape the replay does
    not know); the message is the host's own, in one line."""


def build_manager(shape: EngineShape, dp_rank: int = 0, dp_size: Optional[int] = None):
    """:func:`_build_manager`; a host that refuses the replay's engine shape is one :class:`HostConfigError`."""
    try:
        return _build_manager(shape, dp_rank, dp_size)
    except TraceError:
        raise
    except Exception as exc:  # noqa: BLE001 - the host's own check (an assert) or a config shape it does not take
        first = (str(exc).splitlines() or ["?"])[0]
        first = first if len(first) <= 160 else first[:157] + "..."
        raise HostConfigError(
            f"FastDeploy (fdsched doctor says which) refuses the replay's engine shape ({type(exc).__name__}: {first}); the replay "
            "builds the scheduler's configs as FastDeploy 2.4 and later do: if the message names a setting, change "
            "it with the replay's flag of that name, else this host cannot be replayed"
        ) from None


def _build_manager(shape: EngineShape, dp_rank: int = 0, dp_size: Optional[int] = None):
    """A ``ResourceManagerV1`` built from real host configs, the way the host's own tests build one.

    ``dp_rank`` / ``dp_size``: the data-parallel rank this scheduler is for (passed as the engine passes it,
    ``local_data_parallel_id``, and set in ``parallel_config``) and the number of ranks.
    """
    from fastdeploy.engine.sched import resource_manager_v1

    config = host_config(shape, dp_rank, dp_size)
    return resource_manager_v1.ResourceManagerV1(max_num_seqs=shape.max_num_seqs, config=config, tensor_parallel_size=1,
                                                 splitwise_role=shape.splitwise_role, local_data_parallel_id=dp_rank)


def host_config(shape: EngineShape, dp_rank: int = 0, dp_size: Optional[int] = None, replay_check: bool = True):
    """The host's ``FDConfig`` for ``shape``, built with the host's own config classes, so the host's own checks
    (``FDConfig``'s post-processing and ``check``: the KV pool against ``max_model_len``, the batch token budget
    against the sequences, ...) run on it. Raises what the host raises (mostly ``AssertionError``); first, with
    ``replay_check``, :class:`TraceError` for a shape the replay cannot drive."""
    from types import SimpleNamespace

    if replay_check:
        shape.check()
    prepare_host_environment()
    from fastdeploy.config import CacheConfig, FDConfig, ParallelConfig, SchedulerConfig
    from fastdeploy.engine import args_utils

    v1_flag = os.environ.get("ENABLE_V1_KVCACHE_SCHEDULER")
    engine_args = args_utils.EngineArgs(
        max_num_seqs=shape.max_num_seqs,
        num_gpu_blocks_override=shape.num_gpu_blocks,
        max_num_batched_tokens=shape.max_num_batched_tokens,
    )
    # On a CPU paddle wheel EngineArgs turns the V1 scheduler off in the process environment, and on hosts whose
    # envs module reads variables lazily it also assigns envs.ENABLE_V1_KVCACHE_SCHEDULER = 0, a module attribute
    # that from then on hides the variable (2.5's FDConfig.check then asserts max_num_batched_tokens >=
    # max_model_len, a V0-only rule). Undo both: the V1 scheduler is what is replayed.
    os.environ["ENABLE_V1_KVCACHE_SCHEDULER"] = v1_flag or "1"
    _drop_cpu_v1_override()
    args = asdict(engine_args)

    cache = CacheConfig(args)
    cache.block_size = shape.block_size
    cache.max_block_num_per_seq = ceil_div(shape.max_model_len, shape.block_size) + 1
    cache.enc_dec_block_num = shape.enc_dec_block_num
    cache.enable_prefix_caching = shape.enable_prefix_caching
    cache.enable_output_caching = False
    cache.bytes_per_token_per_layer = 1
    cache.bytes_per_layer_per_block = 1  # what 2.4's prefix cache reads instead (sizes only its log line here)
    cache.kv_cache_ratio = 1.0
    model = SimpleNamespace(enable_mm=False, max_model_len=shape.max_model_len, architectures=["fdsched_replay_model"],
                            mm_max_tokens_per_item=None, version=None, print=lambda *a, **k: None)
    scheduler = SchedulerConfig(args)
    scheduler.splitwise_role = shape.splitwise_role
    fd_config = FDConfig(
        model_config=model,
        cache_config=cache,
        parallel_config=ParallelConfig(args),
        graph_opt_config=engine_args.create_graph_optimization_config(),
        speculative_config=SimpleNamespace(method=None, num_speculative_tokens=0),
        scheduler_config=scheduler,
    )
    # The scheduler names a machine-wide shared-memory signal after this port; processes that build
    # managers side by side (test runs, replays) would share one name and unlink each other's signal.
    _name_signals_privately(fd_config.parallel_config, dp_rank)
    fd_config.parallel_config.local_data_parallel_id = dp_rank
    if dp_size is not None:
        fd_config.parallel_config.data_parallel_size = dp_size
    return fd_config


def _drop_cpu_v1_override() -> None:
    """Remove an ``ENABLE_V1_KVCACHE_SCHEDULER`` attribute that EngineArgs assigned on the host's lazy ``envs``
    module (a module-level ``__getattr__`` reads the environment only while no such attribute exists)."""
    import sys

    envs = sys.modules.get("fastdeploy.envs")
    if envs is not None and "__getattr__" in vars(envs) and "ENABLE_V1_KVCACHE_SCHEDULER" in vars(envs):
        delattr(envs, "ENABLE_V1_KVCACHE_SCHEDULER")


def _name_signals_privately(parallel, dp_rank: int) -> None:
    """The port the scheduler names its signal after, for ``dp_rank``: ``local_engine_worker_queue_port`` (2.5 and
    later) and ``engine_worker_queue_port[dp_rank]`` (2.4), set to :func:`_private_signal_suffix`."""
    private = _private_signal_suffix(dp_rank)
    parallel.local_engine_worker_queue_port = private
    ports = getattr(parallel, "engine_worker_queue_port", None)
    if isinstance(ports, list):
        ports = ports + [0] * max(0, dp_rank + 1 - len(ports))
        ports[dp_rank] = private
        parallel.engine_worker_queue_port = ports


def _private_signal_suffix(dp_rank: int = 0) -> int:
    """A number no other process (nor another rank's scheduler in this one) uses at the same time (not a port
    anyone listens on). Linux pids stay below 2**22, so ranks are 10**7 apart."""
    return 1_000_000 + os.getpid() + 10_000_000 * dp_rank


def close_manager(manager) -> None:
    """Release what a manager holds outside Python objects (shared memory, thread pools)."""
    signal = getattr(manager, "need_block_num_signal", None)  # 2.2 has none
    try:
        if signal is not None:
            signal.clear()
    except FileNotFoundError:
        # The signal's shared-memory name is the same for every manager built with the same engine
        # port (e.g. other test processes on this machine); one of them may unlink it between the
        # host's existence check and its unlink. Nothing is left to release then.
        pass
    for name in ("finish_execution_pool", "async_preprocess_pool"):  # a line may lack either
        pool = getattr(manager, name, None)
        if pool is not None:
            pool.shutdown(wait=True)


def make_request(request_id: str, prompt_token_ids: list, max_tokens: Optional[int]):
    from fastdeploy.engine.request import Request, RequestMetrics

    request = Request.from_dict({"request_id": request_id, "multimodal_inputs": {}})
    request.prompt_token_ids = list(prompt_token_ids)
    request.prompt_token_ids_len = len(request.prompt_token_ids)
    request.need_prefill_tokens = request.prompt_token_ids_len
    request.output_token_ids = []
    request.disaggregate_info = {}
    request.metrics = RequestMetrics(**_metrics_arguments(RequestMetrics))
    request.sampling_params.max_tokens = max_tokens
    return request


_METRICS_ARGUMENTS: dict = {}


def _metrics_arguments(metrics_cls) -> dict:
    """What the host's ``RequestMetrics`` needs to be built: nothing, or (2.4) an ``arrival_time`` (0.0 here: the
    driver stamps the real one when the request is added)."""
    found = _METRICS_ARGUMENTS.get(metrics_cls)
    if found is None:
        import inspect

        try:
            params = inspect.signature(metrics_cls).parameters
        except (TypeError, ValueError):
            params = {}
        arrival = params.get("arrival_time")
        found = {"arrival_time": 0.0} if arrival is not None and arrival.default is inspect.Parameter.empty else {}
        _METRICS_ARGUMENTS[metrics_cls] = found
    return found


@contextmanager
def logical_clock(start: float = 1_000_000.0):
    """Make ``time.time()`` in the prefix cache module a counter, so LRU order never ties on wall time."""
    import fastdeploy.cache_manager.prefix_cache_manager as pcm_module

    original = pcm_module.time
    state = {"now": start}

    class _Clock:
        def __getattr__(self, name):
            return getattr(original, name)

        @staticmethod
        def time():
            state["now"] += 1.0
            return state["now"]

    pcm_module.time = _Clock()
    try:
        yield
    finally:
        pcm_module.time = original
