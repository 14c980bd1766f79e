"""The seams that stand for host code a CPU machine cannot run as it is: the platform (S1, S7), the KV cache
shape and the transfer managers (S3-S6, S10, S12), the model config and the plugin loader (S4), the tokenizer's
end ids (S5), the output reader of ranks > 0 and of a prefill instance (S8, S9, S13), the listening address (S11).
What each replaces and why: :data:`fdsched.serve.seams.table.SEAMS`."""

from __future__ import annotations

import os
import sys

from .engine import count_manager_rpcs
from .env import HOST_ENV, MAIN_API_SERVER, MAIN_ENV_MULTI, XFER_ENV, main_module


def _sim_platform():
    from fastdeploy.platforms.cpu import CPUPlatform

    class SimulatedCudaPlatform(CPUPlatform):
        """A CPU platform that claims CUDA for configuration decisions only."""

        def is_cuda(self):
            return True

    return SimulatedCudaPlatform()


def _s1(module):
    module.current_platform = _sim_platform()


def _s3_s6(module):
    def _get_kv_cache_shape(self, max_block_num):
        model = self.config.model_config
        tp = self.config.parallel_config.tensor_parallel_size
        heads = max(1, int(model.num_key_value_heads) // tp)
        shape = [max_block_num, heads, self.config.cache_config.block_size, model.head_dim]
        return shape, list(shape)

    module.PrefixCacheManager._get_kv_cache_shape = _get_kv_cache_shape
    if getattr(module, "get_all_visible_devices", None) is None:
        module.get_all_visible_devices = lambda: "CUDA_VISIBLE_DEVICES=0"
    _s10(module)
    count_manager_rpcs()


class _TransferManagerLauncher:
    """Stands for the ``subprocess`` module inside prefix_cache_manager (S10): Popen of a command that runs the
    host's cache_transfer_manager.py runs the simulated one with the same arguments; all else is subprocess."""

    HOST_SCRIPT = os.sep + os.path.join("cache_manager", "cache_transfer_manager.py")
    HOST_MESSAGER = os.sep + os.path.join("cache_manager", "cache_messager.py")  # S12

    def __init__(self, real, script):
        self._real, self._script = real, script
        self._messager = os.path.join(os.path.dirname(script), "pdxfer.py")

    def Popen(self, cmd, *args, **kwargs):  # noqa: N802 (the subprocess name)
        if isinstance(cmd, str) and (self.HOST_SCRIPT in cmd or self.HOST_MESSAGER in cmd):
            words = cmd.split(" ")
            words = [self._script if w.endswith(self.HOST_SCRIPT) else self._messager if w.endswith(self.HOST_MESSAGER)
                     else w for w in words]
            cmd = " ".join(words)
        return self._real.Popen(cmd, *args, **kwargs)

    def __getattr__(self, item):
        return getattr(self._real, item)


def _s10(module):
    script = os.environ.get(XFER_ENV)
    if script and not isinstance(module.subprocess, _TransferManagerLauncher):
        module.subprocess = _TransferManagerLauncher(module.subprocess, script)


def _s4(module):
    def _post_init(self):
        self.is_unified_ckpt = False
        self.runner_type = "generate"
        self.convert_type = "none"
        self.supported_tasks = ["generate"]
        self.is_reasoning_model = False
        self.enable_mm = False
        self.kv_cache_quant_scale_path = os.path.join(self.model, "kv_cache_scale.json")
        self._architecture = self.architectures[0]
        self.pooler_config = None
        self.override_name_from_config()
        self.read_from_env()
        self.read_model_config()
        from fastdeploy.plugins.model_register import load_model_register_plugins

        load_model_register_plugins()  # FastDeploy's loader: loads fdsched only when FD_PLUGINS names it

    module.ModelConfig._post_init = _post_init


def _s5_fallback(module):
    def get_eos_token_id(tokenizer, generation_config=None):
        ids = []
        if generation_config is not None and getattr(generation_config, "eos_token_id", None) is not None:
            eos = generation_config.eos_token_id
            ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        if not ids and tokenizer.eos_token_id is not None:
            ids = [tokenizer.eos_token_id]
        return ids

    module.get_eos_token_id = get_eos_token_id


def _s7(module):
    if main_module() == MAIN_ENV_MULTI:
        module._current_platform = _sim_platform()


def _s8(module):
    original = module.TokenProcessor.process_sampling_results_use_zmq

    def process_sampling_results_use_zmq(self):
        if self.cfg.parallel_config.local_data_parallel_id == 0:
            return original(self)
        while True:  # rank > 0: the same three steps the host runs on rank 0
            datas = self.zmq_server.recv_pyobj()
            try:
                self._reschedule_preempt_task_use_zmq(datas)
                self.postprocess(self._process_batch_output_use_zmq(datas))
            except Exception as exc:  # as the host's loop: log and go on
                print(f"[fdsched-serve] output reader rank>0: {exc!r}", file=sys.stderr, flush=True)

    module.TokenProcessor.process_sampling_results_use_zmq = process_sampling_results_use_zmq

    # S9: the decode status on the ZMQ path (hosts that split RUNNING into RUNNING_PREFILL / RUNNING_DECODE)
    from fastdeploy.engine.request import RequestStatus

    if not hasattr(RequestStatus, "RUNNING_DECODE"):
        return
    original_batch = module.TokenProcessor._process_batch_output_use_zmq

    def _process_batch_output_use_zmq(self, receive_datas):
        rm = self.resource_manager
        for data in receive_datas:
            tokens = data.tokens
            if tokens is None or len(tokens) == 0 or tokens[-1] < 0 or rm.stop_flags[data.batch_id]:
                continue
            task = rm.tasks_list[data.batch_id]
            if task is not None and task.status == RequestStatus.RUNNING_PREFILL:
                task.status = RequestStatus.RUNNING_DECODE  # what the get_output path does on a real token
        return original_batch(self, receive_datas)

    module.TokenProcessor._process_batch_output_use_zmq = _process_batch_output_use_zmq


def _s13(module):
    """S13: on a prefill instance, the ZMQ output path hands a finished prefill's result to the engine's scheduler,
    as the get_output path does. The host's ZMQ path keeps it back unless the scheduler is the old splitwise one, so
    the prefill api_server never answers and the Router, which waits for both answers, hangs."""
    tp = module.TokenProcessor
    per_token, batch = tp._process_per_token, tp._process_batch_output_use_zmq

    def _process_per_token(self, task, batch_id, token_ids, result, is_prefill):
        out = per_token(self, task, batch_id, token_ids, result, is_prefill)
        if is_prefill and out is not None and getattr(out, "finished", False) \
                and self.cfg.scheduler_config.name != "splitwise":
            self.__dict__.setdefault("_fdsched_prefill_results", []).append(out)
        return out

    def _process_batch_output_use_zmq(self, receive_datas):
        held = self.__dict__.setdefault("_fdsched_prefill_results", [])
        results = batch(self, receive_datas)
        if held:
            results = list(results or []) + [r for r in held if all(r is not x for x in (results or []))]
            held.clear()
        return results

    tp._process_per_token = _process_per_token
    tp._process_batch_output_use_zmq = _process_batch_output_use_zmq


# S11 -------------------------------------------------------------------------------------------

def _listen_host() -> str:
    return os.environ.get(HOST_ENV, "")


def _s11_uvicorn(module):
    host = _listen_host()
    if not host or main_module() != MAIN_API_SERVER or getattr(module.run, "_fdsched", False):
        return
    real = module.run

    def run(app, *args, **kwargs):
        if kwargs.get("host") == "0.0.0.0":
            kwargs["host"] = host
        return real(app, *args, **kwargs)

    run._fdsched = True
    module.run = run


def _s11_host_ip(module):
    host = _listen_host()
    if host and host not in ("0.0.0.0", "::") and hasattr(module, "get_host_ip"):
        module.get_host_ip = lambda: host


AFTER_LOAD = {
    "fastdeploy.engine.args_utils": [_s1],
    "fastdeploy.cache_manager.prefix_cache_manager": [_s3_s6],
    "fastdeploy.config": [_s4, _s11_host_ip],
    "uvicorn": [_s11_uvicorn],
    "fastdeploy.platforms": [_s7],
    "fastdeploy.output.token_processor": [_s8, _s13],
}
ON_IMPORT_ERROR = {"paddleformers.trl.llm_utils": _s5_fallback, "paddleformers.cli.utils.llm_utils": _s5_fallback}
