"""The host's own test suites, run with and without fdsched loaded through FastDeploy's loader: a differential test.

For every *run* — ``no-plugin`` (``FD_PLUGINS`` unset: the host alone), ``default`` (``FD_PLUGINS=fdsched``,
no profile) and each shipped profile — pytest runs the host tree's own test files that exist in that tree (read
from the host's source tree, never copied) in a fresh process inside it, with ``-p fdsched.tools.hostsuite_pytest``:
that plugin calls FastDeploy's own ``load_model_register_plugins()`` before any test module is imported and
records every test's outcome (a failure with its reason, in a line) and what was installed. :func:`compare` holds
each run against the ``no-plugin`` run of the same tree: a test that passes without the plugin must pass with it,
unless the catalogue declares that a change the run applies alters that test (:class:`fdsched.patches.AlteredTest`,
by test id, with the reason and the upstream PR). A test that fails without the plugin is the host failing on this
machine (a CPU, no model), counted and not judged. Nothing here is per commit: it runs on any FastDeploy tree.

``fdsched host test`` runs it from the command line; ``tests/host/test_host_suites.py`` runs it in the host tier.
"""

from __future__ import annotations

import collections
import contextlib
import fnmatch
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fdsched.core.common import remove_files

import yaml

__all__ = [
    "SUITES", "NO_PLUGIN", "DEFAULT_RUN", "HostSuiteError", "SuiteTable", "RunResult", "load_table", "engine_profiles",
    "run_names", "covering_runs", "plugin_classes", "suite_files", "run_suite", "compare", "altered_tests",
]

SUITES = Path(__file__).with_name("host_suites.yaml")
NO_PLUGIN, DEFAULT_RUN = "no-plugin", "default"
LAST_ENV = "FDSCHED_HOSTSUITE_LAST"  # node ids the pytest plugin moves to the end of the session, in this order


class HostSuiteError(RuntimeError):
    """The suite table is malformed, or a run could not be made."""


@dataclass(frozen=True)
class SuiteTable:
    candidates: tuple  # the host test files that reach the plugin's seams (run where the tree has them)
    excluded: dict  # file -> why (every host); file@key -> why (the host of that key only)
    only_on: dict  # file -> host keys: run only there
    # file -> (why, node ids that leave threads running, run last in that file's own process)
    own_process: dict = field(default_factory=dict)


# The runs the test tiers make by default: no profile (every change auto), every change off, every change on, and
# the plugin's own reservation. Between them they build every class of the plugin's that any shipped profile builds,
# on every host CI sets up (tests/host/test_host_suites.py checks it on the host at hand); the other profiles only
# combine those classes differently or give them other values. ALL_PROFILES_ENV=1 runs every profile.
COVERING_RUNS = (DEFAULT_RUN, "baseline", "recommended", "adaptive")
ALL_PROFILES_ENV = "FDSCHED_TEST_ALL_PROFILES"


def engine_profiles() -> dict:
    """Shipped profile name -> the shipped profile an engine runs identically. Profiles that differ only in
    ``replay.*`` keys (settings only the replay reads: ``oracle``, ``unbounded``, ``sglang-retract`` are
    ``recommended`` in an engine) build the same classes with the same values, so a test of the engine or of the
    host's suites proves the same for each; a group's representative is the one whose replay keys are all defaults
    (else the first by name)."""
    from fdsched.core.settings import load_settings, shipped_profiles

    groups: dict = {}
    for name in shipped_profiles():
        settings = load_settings({}, profile=name)
        engine_view = tuple(sorted((k, repr(v)) for k, v in settings.values.items() if not k.startswith("replay.")))
        groups.setdefault(engine_view, []).append(settings)
    chosen = {}
    for members in groups.values():
        plain = [m for m in members if all(src == "default" for k, src in m.sources.items() if k.startswith("replay."))]
        for member in members:
            chosen[member.profile] = (plain or members)[0].profile
    return dict(sorted(chosen.items()))


def run_names() -> list:
    """``no-plugin``, ``default`` and every shipped profile an engine runs differently (a profile that differs from
    another only in replay-only keys runs the same classes: :func:`engine_profiles`)."""
    return [NO_PLUGIN, DEFAULT_RUN] + sorted(set(engine_profiles().values()))


def covering_runs(environ=None) -> list:
    """The runs with the plugin that the test tiers make: :data:`COVERING_RUNS`, or every run of :func:`run_names`
    when ``FDSCHED_TEST_ALL_PROFILES=1``."""
    environ = os.environ if environ is None else environ
    if environ.get(ALL_PROFILES_ENV) == "1":
        return run_names()[1:]
    return list(COVERING_RUNS)


def plugin_classes(info, run: str) -> Optional[frozenset]:
    """Every class of the plugin's (``fdsched.patches``) that ``run`` (a profile, or ``default``) uses on the probed
    host ``info``: each fixed class's chain and the strategies its instances build, as ``target:module.Class``; None
    where the host refuses it."""
    from fdsched.core.hooks import Policies, make_plugin_manager
    from fdsched.core.settings import load_settings
    from fdsched.install.installer import Arm, InstallError, _build, decide, strategy_row

    settings = load_settings({}, profile=None if run == DEFAULT_RUN else run)
    try:
        decisions = decide(settings, info)
    except InstallError:
        return None
    policies = Policies(make_plugin_manager(environ={}, load_entry_points=False))
    found = set()
    arm = Arm(run, settings, decisions)
    for target, fixed in _build(info, settings, decisions, policies).items():
        strategies = [*getattr(fixed, "_fdsched_outermost", ()), *strategy_row(target, arm, info).values()]
        used = list(fixed.__mro__) + [k for c in strategies if c is not None for k in c.__mro__]
        for cls in used:
            if cls.__module__.startswith("fdsched.patches"):
                found.add(f"{target}:{cls.__module__.rsplit('.', 1)[-1]}.{cls.__qualname__}")
    return frozenset(found)


def load_table(path: Path = SUITES) -> SuiteTable:
    """Read and check the table; a bad entry is one error naming its path in the file."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    where = str(path)
    allowed = {"candidates", "excluded", "only_on", "own_process"}
    if not isinstance(data, dict) or not {"candidates"} <= set(data) <= allowed:
        raise HostSuiteError(f"{where}: top-level keys {sorted(data or {})}; allowed: {', '.join(sorted(allowed))}")
    files = data["candidates"]
    if not files or not all(isinstance(f, str) and f.startswith("tests/") for f in files):
        raise HostSuiteError(f"{where}: candidates: {files!r}; allowed: a list of tests/... files")
    only_on = {}
    for path_, keys in (data.get("only_on") or {}).items():
        if path_ not in files or not isinstance(keys, list) or not keys:
            raise HostSuiteError(f"{where}: only_on.{path_}: {keys!r}; allowed: a candidate file -> a list of host keys")
        only_on[path_] = tuple(str(k) for k in keys)
    own = {}
    for path_, entry in (data.get("own_process") or {}).items():
        at = f"{where}: own_process.{path_}"
        if not isinstance(entry, dict) or set(entry) - {"why", "leaking_tests"} or "why" not in entry:
            raise HostSuiteError(f"{at}: {entry!r}; allowed: a mapping with why and leaking_tests (node ids)")
        nodes = tuple(entry.get("leaking_tests") or ())
        bad = [n for n in nodes if not str(n).startswith(path_ + "::")]
        if bad:
            raise HostSuiteError(f"{at}.leaking_tests: {bad}; allowed: node ids of {path_}")
        own[path_] = (" ".join(str(entry["why"]).split()), nodes)
    return SuiteTable(tuple(files), dict(data.get("excluded") or {}), only_on, own)


def suite_files(tree: str, key: Optional[str], table: SuiteTable) -> list:
    """The candidate files this tree has, less those excluded for every host or for this host's key."""
    found = []
    for path_ in table.candidates:
        if not os.path.isfile(os.path.join(tree, path_)) or path_ in table.excluded:
            continue
        if key is not None and f"{path_}@{key}" in table.excluded:
            continue
        if path_ in table.only_on and key not in table.only_on[path_]:
            continue
        found.append(path_)
    return found


@dataclass
class RunResult:
    host: str
    run: str
    outcomes: dict  # node id -> passed / failed / skipped
    install: dict
    exitstatus: int
    seconds: float
    output_tail: str = ""
    problems: list = field(default_factory=list)
    leaked_threads: dict = field(default_factory=dict)  # node id -> names of threads it left running
    refused_signals: list = field(default_factory=list)  # what hostsuite_pytest.signal_guard refused
    files: list = field(default_factory=list)  # the host test files the run ran
    reasons: dict = field(default_factory=dict)  # node id -> why it failed, in a line (hostsuite_pytest)

    def counts(self) -> dict:
        return {"passed": 0, "failed": 0, "skipped": 0, **collections.Counter(self.outcomes.values())}


# The host's engine tests take their ports from FD_ENGINE_QUEUE_PORT / FD_CACHE_QUEUE_PORT (6778 / 6779 by default;
# with data_parallel_size > 1 the port + 21 + rank: tests/engine/test_common_engine.py, _make_cfg), and EngineArgs
# asserts each is free. Each process gets a block of HOST_PORT_SPAN free ports for each, leased so that two host-suite
# processes never share one. A lease keeps only fdsched off, so HOST_PORT_RANGE is where no other process picks: under
# the ephemeral range (an outgoing connection once took one: "engine_worker_queue_port ... is already in use"), under
# FastDeploy's port finder (``find_free_ports``: 8000-65535) and the host tests' own ports, apart from serving's.
HOST_PORT_SPAN = 24
HOST_PORT_RANGE = (3000, 5999)


@contextlib.contextmanager
def _host_test_ports():
    """(engine queue port, cache queue port), each the first of HOST_PORT_SPAN free ports held for the block."""
    from fdsched.serve.ports import PortLease, free_ports

    lease = PortLease()
    try:
        block = free_ports(2 * HOST_PORT_SPAN, port_range=HOST_PORT_RANGE, lease=lease)
        yield block[0], block[HOST_PORT_SPAN]
    finally:
        lease.release()


def _run_env(run: str, results: str, scratch: str, ports: tuple) -> dict:
    """The environment of one pytest process over the host's files; ``ports``: from :func:`_host_test_ports`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FDSCHED_") and k != "FD_PLUGINS"}
    # Keep the fdsched home (a recorded host) but no plugin setting from the caller's shell: a run is its name.
    if os.environ.get("FDSCHED_HOME"):
        env["FDSCHED_HOME"] = os.environ["FDSCHED_HOME"]
    env.update(
        FDSCHED_HOSTSUITE_RESULTS=results,
        PROMETHEUS_MULTIPROC_DIR=os.path.join(scratch, "prom"),
        FD_LOG_DIR=os.path.join(scratch, "log"),
        PYTHONDONTWRITEBYTECODE="1",
    )
    os.makedirs(env["PROMETHEUS_MULTIPROC_DIR"])
    env["FD_ENGINE_QUEUE_PORT"], env["FD_CACHE_QUEUE_PORT"] = (str(p) for p in ports)
    if run != NO_PLUGIN:
        env["FD_PLUGINS"] = "fdsched"
        if run != DEFAULT_RUN:
            env["FDSCHED_PROFILE"] = run
    return env


def _groups(files: list, expectations: SuiteTable) -> list:
    """[(files, node ids to run last)]: the files that share a process, then one process per ``own_process`` file.

    Some of the host's test files leave threads running after their tests (tests/engine/test_common_engine.py:
    SplitwiseConnector receivers, the engine's ZMQ loops). In a shared process those threads keep executing host
    code while later tests patch the same module attributes, so a later test's outcome depended on thread timing
    (12 runs flagged flaky under load in one run of the test command). Such a file runs in a process of its own,
    and the tests that leak run last in it: no test runs after a leaked thread except other leaking tests.
    """
    shared = [f for f in files if f not in expectations.own_process]
    groups = [(shared, ())] if shared else []
    for f in files:
        if f in expectations.own_process:
            groups.append(([f], expectations.own_process[f][1]))
    return groups


def run_suite(tree: str, key: Optional[str], run: str, table: SuiteTable, timeout: float = 900,
              only: Optional[list] = None) -> RunResult:
    """Run the host's files under ``run`` in fresh pytest processes inside ``tree`` (one for the files that can share
    a process, one per ``own_process`` file); ``only``: just these node ids, in one process."""
    files = suite_files(tree, key, table)
    if not files and not only:
        raise HostSuiteError(f"the host tree {tree} has none of the host test files the suites run")
    groups = [(list(only), ())] if only else _groups(files, table)
    outcomes, leaked, refused, installs, statuses, seconds, tails, reasons = {}, {}, [], [], [], 0.0, [], {}
    for group, last in groups:
        data, took, tail = _run_process(tree, key or "?", run, group, last, timeout)
        outcomes.update(data["outcomes"])
        leaked.update(data.get("leaked_threads") or {})
        reasons.update(data.get("reasons") or {})
        refused.extend(data.get("refused_signals") or [])
        installs.append(data["install"])
        statuses.append(data["exitstatus"])
        seconds += took
        tails.append(tail)
    problems = []
    if any(install != installs[0] for install in installs[1:]):
        problems.append(f"the processes of one run installed differently: {installs}")
    exitstatus = next((st for st in statuses if st not in (0, 1)), max(statuses))
    return RunResult(key or "?", run, outcomes, installs[0], exitstatus, seconds, "\n".join(tails)[-6000:],
                     problems, leaked, refused, files, reasons)


# Shared-memory files the host's own tests leave in /dev/shm (FastDeploy's IPC locks and signals, named by port):
# about 64 per CI run over both hosts before this sweep.
SHM_DIR = "/dev/shm"
SHM_PATTERNS = ("fd_lock_gpu_cache_lock.*", "fmq_ctrl_w2e_rank*_*.ipc", "need_block_num_signal.*")


def _shm_names(shm_dir: str) -> set:
    try:
        return {name for name in os.listdir(shm_dir) if any(fnmatch.fnmatch(name, p) for p in SHM_PATTERNS)}
    except OSError:
        return set()


def _open_paths() -> set:
    """Paths some live process holds open or mapped (read from /proc; what this user may read)."""
    held = set()
    pids = [entry for entry in os.listdir("/proc") if entry.isdigit()] if os.path.isdir("/proc") else []
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    pass
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    fields = line.split(None, 5)  # address perms offset dev inode [path]
                    if len(fields) == 6:
                        held.add(fields[5].strip())
        except OSError:
            continue
    return held


def sweep_new_shm(before: set, shm_dir: str = SHM_DIR) -> list:
    """Remove the host tests' shared-memory files that appeared since ``before`` (:func:`_shm_names`) and that no
    live process holds open; returns the names removed. A file another process still uses is left. (The served
    engine removes exactly the entries its own processes recorded creating; the host's tests are not ours to
    instrument, so here the selection is by what appeared during the run, in the host's own name patterns.)"""
    new = sorted(_shm_names(shm_dir) - before)
    if not new:
        return []
    held = _open_paths()
    return remove_files([name for name in new if os.path.join(shm_dir, name) not in held], shm_dir)


def _run_process(tree: str, host: str, run: str, files: list, last: tuple, timeout: float) -> tuple:
    """(results data, seconds, output tail) of one pytest process over ``files``."""
    with tempfile.TemporaryDirectory(prefix="fdsched-hostsuite-") as scratch, _host_test_ports() as ports:
        results = os.path.join(scratch, "results.json")
        env = _run_env(run, results, scratch, ports)
        env["PYTHONPATH"] = os.pathsep.join([tree] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        if last:
            env[LAST_ENV] = "\n".join(last)
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "fdsched.tools.hostsuite_pytest",
                   "-o", "addopts=", *files]
        started = time.monotonic()
        shm_before = _shm_names(SHM_DIR)
        try:
            # A session of its own: the host's tests/engine/test_common_engine.py patches os.killpg, and threads its
            # tests leave running can call the real one after the patch is gone; in our process group that would
            # kill this pytest and whatever started it (it ended a CI run here mid-way on d38eeb8). Inside the
            # session, hostsuite_pytest.signal_guard refuses signals to the suite's own group and to other sessions
            # (the made-up pids of those tests can be real processes on a fresh machine).
            proc = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout,
                                  start_new_session=True)
        except subprocess.TimeoutExpired as exc:
            raise HostSuiteError(f"{host} host, run {run}: pytest did not finish in {timeout:.0f} s ({' '.join(files)})") from exc
        seconds = time.monotonic() - started
        sweep_new_shm(shm_before)
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-40:])
        if not os.path.isfile(results):
            raise HostSuiteError(f"{host} host, run {run}: pytest wrote no results (exit {proc.returncode}):\n{tail}")
        with open(results, encoding="utf-8") as fh:
            data = json.load(fh)
    return data, seconds, tail


def altered_tests(install: dict) -> dict:
    """node id -> (change id, :class:`fdsched.patches.AlteredTest`) for the tests the changes a run applied alter
    on purpose (``install``: what the run's process installed: decisions and what the host has)."""
    from fdsched.patches import CATALOGUE

    found = {}
    decisions, has = install.get("decisions") or {}, install.get("has") or {}
    for spec in CATALOGUE:
        for altered in spec.alters_tests:
            if altered.applies(decisions.get(spec.change_id, "host"), bool(has.get(spec.change_id))):
                found[altered.test] = (spec.change_id, altered)
    return found


def compare(result: RunResult, baseline: RunResult) -> tuple:
    """(problems, altered): how ``result`` differs from the ``no-plugin`` run of the same tree. A test that passed
    without the plugin and does not pass in ``result`` is a problem unless a change the run applied declares it
    altered (then it is in ``altered``: node id -> why)."""
    problems = list(result.problems)
    install = result.install
    if install.get("refused"):  # the profile is refused on this host, in one line, before anything is patched
        return problems, {}
    if result.run == NO_PLUGIN:
        if install.get("installed"):
            problems.append(f"fdsched was installed although FD_PLUGINS was unset: {install.get('summary')}")
    elif not install.get("installed"):
        problems.append(f"FastDeploy's loader did not install fdsched (FD_PLUGINS=fdsched): {install.get('error') or 'no install'}")
    elif install.get("profile") != (None if result.run == DEFAULT_RUN else result.run):
        problems.append(f"installed with profile {install.get('profile')!r}, expected {result.run!r}")
    if result.exitstatus not in (0, 1):  # 2-4: interrupted, internal or usage error; 5: nothing collected
        problems.append(f"pytest exit status {result.exitstatus} (not a test failure: collection or usage error)")
    for path_ in result.files:
        if not any(node.split("::", 1)[0] == path_ for node in result.outcomes):
            problems.append(f"{path_}: no test ran")
    declared = altered_tests(install) if result.run != NO_PLUGIN else {}
    altered = {}
    for node, before in sorted(baseline.outcomes.items()):
        after = result.outcomes.get(node)
        if before != "passed" or after == "passed":
            continue
        if node in declared:
            change_id, entry = declared[node]
            altered[node] = f"{change_id} (PR {entry.upstream_pr}): {entry.why}"
        else:
            why = f" ({result.reasons[node]})" if node in result.reasons else ""
            problems.append(f"passes without the plugin, {after or 'did not run'} with it: {node}{why}")
    return problems, altered


def run_and_compare(tree: str, key: Optional[str], run: str, table: SuiteTable, baseline: RunResult,
                    timeout: float = 900) -> tuple:
    """(result, problems, altered): one run held against the ``no-plugin`` run. No retry: a failure is a failure
    (the thread-leaking files run in processes of their own, see :func:`_groups`)."""
    result = baseline if run == NO_PLUGIN else run_suite(tree, key, run, table, timeout)
    problems, altered = compare(result, baseline)
    return result, problems, altered


def check_loader(tree: str, plugins: Optional[str], timeout: float = 300) -> dict:
    """What FastDeploy's own plugin loader does in a fresh process with ``FD_PLUGINS`` = ``plugins`` (None: unset):
    ``{"installed": bool, "summary" / "error": ..., "exit": int}``. On a host whose loader loads every plugin when
    ``FD_PLUGINS`` is unset (2.2, 2.3), the plugin must still do nothing then."""
    code = (
        "import json, sys\n"
        "from fastdeploy.plugins.model_register import load_model_register_plugins\n"
        "load_model_register_plugins()\n"
        "from fdsched.install.installer import current\n"
        "r = current()\n"
        "print('FDSCHED_LOADER ' + json.dumps({'installed': r is not None, 'summary': r.summary() if r else None}))\n"
    )
    with tempfile.TemporaryDirectory(prefix="fdsched-loader-") as scratch, _host_test_ports() as ports:
        env = _run_env(DEFAULT_RUN if plugins else NO_PLUGIN, os.path.join(scratch, "unused.json"), scratch, ports)
        env.pop("FD_PLUGINS", None)
        if plugins is not None:
            env["FD_PLUGINS"] = plugins
        env["PYTHONPATH"] = os.pathsep.join([tree] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        proc = subprocess.run([sys.executable, "-c", code], cwd=scratch, env=env, capture_output=True, text=True,
                              timeout=timeout, start_new_session=True)
    for line in proc.stdout.splitlines():
        if line.startswith("FDSCHED_LOADER "):
            data = json.loads(line.split(" ", 1)[1])
            data["exit"] = proc.returncode
            return data
    tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
    return {"installed": False, "error": tail, "exit": proc.returncode}


def host_tree_and_key() -> tuple:
    """(source tree, the host's short name or None for an unknown commit, label) of the host fdsched finds; raises
    HostSuiteError when it is not a source tree with tests."""
    from fdsched.install.probe import probe
    from fdsched.install.hosts import host_key

    info = probe()
    if not os.path.isdir(os.path.join(info.location, "tests")):
        raise HostSuiteError(f"{info.label} has no tests/ folder: the host suites need a FastDeploy source tree (fdsched host setup)")
    return info.location, host_key(info.commit), info.label
