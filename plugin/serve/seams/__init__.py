"""Every seam the served engine needs on a CPU machine: as data (:data:`.table.SEAMS`) and as code, one module per
family (:mod:`.hostcode`: host code a CPU cannot run; :mod:`.engine`: the engine process's workers and probes;
:mod:`.ledger`: what the processes create and how they end; :mod:`.drain`: the api_server's drain gate).

How the seams reach every process
---------------------------------
The served stack is several processes: the Router, ``multi_api_server`` (which starts one
``python -m fastdeploy.entrypoints.openai.api_server`` per data-parallel rank with ``subprocess``), each
api_server (gunicorn/uvicorn with the ``LLMEngine`` in its process, plus its queue-manager children), and
the simulated workers. The launcher (:mod:`fdsched.serve.launcher`) writes a ``sitecustomize.py`` into a
temporary directory and puts that directory on ``PYTHONPATH`` **only in the environment of the served
stack** (with ``FDSCHED_SERVE_SEAMS=1``). Python imports ``sitecustomize`` at start-up in every process
that inherits that environment, spawned ones included. It loads *this package by its path* (under a private
module name, so the ``fdsched`` package and the plugin are NOT imported; its modules import only each other) and
installs an import hook (:class:`_SeamFinder` on ``sys.meta_path``). The hook does nothing until one of the host
modules a family names (its ``AFTER_LOAD``) is imported; right after that module has executed it applies that
module's seams. A process
that never imports those modules (the Router) is not changed at all. Without ``FDSCHED_SERVE_SEAMS=1``
the ``sitecustomize`` returns at once.

Why an import hook rather than a wrapper entry point: the operator's commands stay exactly the
production ones (``python -m fastdeploy.entrypoints.openai.api_server``, ``multi_api_server``,
``fastdeploy.router.launch``), and the processes those commands spawn get the same seams without any of
them knowing.

The plugin is loaded only by FastDeploy's own loader (``load_model_register_plugins``, which reads
``FD_PLUGINS``): seam S4 calls that loader where the model-zoo import would have called it. Nothing
here imports ``fdsched``.

Seams change nothing else of the host. Each entry of :data:`.table.SEAMS` names the host lines it stands for on
both supported hosts (new d38eeb8, old e7c8dc2) and why it is needed.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

from . import drain, engine, hostcode, ledger
from .drain import DRAIN_DIR, drain_counts, request_abort, request_drain
from .env import (
    ENABLE_ENV, FINISH_DELAY_ENV, HOST_ENV, MAIN_ENV_MULTI, RPC_COUNT_ENV, SHM_LEDGER, STATE_ENV, TIME_SCHEDULE_ENV,
    WORKER_ENV, XFER_ENV, main_module,
)
from .ledger import exit_status, record_created, record_creations, watch_api_servers

__all__ = [  # what the launcher side uses; each family's own names are in its module
    "ENABLE_ENV", "WORKER_ENV", "STATE_ENV", "XFER_ENV", "RPC_COUNT_ENV", "TIME_SCHEDULE_ENV", "FINISH_DELAY_ENV",
    "HOST_ENV", "SHM_LEDGER", "DRAIN_DIR", "request_drain", "request_abort", "drain_counts", "record_created",
    "exit_status", "install", "write_sitecustomize",
]

# ---------------------------------------------------------------------------------------------- the hook

def _after_load() -> dict:
    """Host module -> the seams applied right after it executed (each family says which of its seams go where)."""
    found: dict = {}
    for family in (hostcode, engine, ledger, drain):
        for name, seams in family.AFTER_LOAD.items():
            found.setdefault(name, []).extend(seams)
    return found


_AFTER_LOAD = _after_load()
_ON_IMPORT_ERROR = dict(hostcode.ON_IMPORT_ERROR)  # host module -> the seam applied when importing it fails


class _SeamLoader(importlib.abc.Loader):
    def __init__(self, real, name):
        self._real, self._name = real, name

    def create_module(self, spec):
        return self._real.create_module(spec)

    def exec_module(self, module):
        if self._name in _ON_IMPORT_ERROR:
            try:
                self._real.exec_module(module)
            except ImportError:
                _ON_IMPORT_ERROR[self._name](module)
            return
        self._real.exec_module(module)
        for patch in _AFTER_LOAD[self._name]:
            patch(module)

    def __getattr__(self, item):  # get_code, get_source, is_package ... from the real loader
        return getattr(self._real, item)


class _SeamFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _AFTER_LOAD and name not in _ON_IMPORT_ERROR:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _SeamLoader(spec.loader, name)
                return spec
        return None


def install() -> bool:
    """Install the import hook in this process when ``FDSCHED_SERVE_SEAMS=1``; True when installed."""
    if os.environ.get(ENABLE_ENV) != "1":
        return False
    if not any(isinstance(f, _SeamFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SeamFinder())
        os.environ.setdefault("FD_USE_GET_SAVE_OUTPUT_V1", "1")
        os.environ.setdefault("ENABLE_V1_KVCACHE_SCHEDULER", "1")
        if os.environ.get(STATE_ENV):
            record_creations()
            if main_module() == MAIN_ENV_MULTI:
                watch_api_servers()
    return True


SITECUSTOMIZE = '''\
# Written by fdsched serve: installs the served engine's seams (see {path}). Only on the served stack's PYTHONPATH.
import os as _os
if _os.environ.get("{env}") == "1":
    import importlib.util as _u
    _spec = _u.spec_from_file_location("_fdsched_serve_seams", {path!r}, submodule_search_locations=[{folder!r}])
    _mod = _u.module_from_spec(_spec)
    import sys as _sys
    _sys.modules["_fdsched_serve_seams"] = _mod
    _spec.loader.exec_module(_mod)
    _mod.install()
'''


def write_sitecustomize(directory: str) -> str:
    path = os.path.join(directory, "sitecustomize.py")
    with open(path, "w") as fh:
        fh.write(SITECUSTOMIZE.format(path=os.path.abspath(__file__), folder=os.path.dirname(os.path.abspath(__file__)),
                                      env=ENABLE_ENV))
    return path
