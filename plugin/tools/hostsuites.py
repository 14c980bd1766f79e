"""The host's own test suites, run with fdsched loaded through FastDeploy's loader: the cherry-pick tests.

For every *run* — ``no-plugin`` (``FD_PLUGINS`` unset: the host alone), ``default`` (``FD_PLUGINS=fdsched``,
no profile) and each shipped profile — pytest runs the host tree's own test files (read from the host's
source tree, never copied) in a fresh process inside that tree, with ``-p fdsched.tools.hostsuite_pytest``:
that plugin calls FastDeploy's own ``load_model_register_plugins()`` before any test module is imported
and records every test's outcome. :func:`compare` then holds the outcomes against the expectations table
(``host_suites.yaml``, shipped with the package): each expected failure names the test, the hosts, the
runs and its cause (the upstream PR whose behaviour change the test asserts, or the host failing on a CPU
machine without the plugin). Anything else failing, an expected failure that passes, a run that did not
install what it should, or a file that collected nothing is a problem.

``fdsched host test`` runs it from the command line; ``tests/host/test_host_suites.py`` runs it in the
host tier (so CI runs it on both hosts).
"""

from __future__ import annotations

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

from fdsched.core.common import EXIT_ERROR, EXIT_OK, remove_files, text_table

import yaml

__all__ = [
    "EXPECTATIONS",
    "NO_PLUGIN",
    "DEFAULT_RUN",
    "HostSuiteError",
    "Expectations",
    "RunResult",
    "load_expectations",
    "run_names",
    "run_suite",
    "compare",
]

EXPECTATIONS = Path(__file__).with_name("host_suites.yaml")
NO_PLUGIN, DEFAULT_RUN = "no-plugin", "default"
LAST_ENV = "FDSCHED_HOSTSUITE_LAST"  # node ids the pytest plugin moves to the end of the session, in this order
HOST_KEYS = ("old", "new")
CAUSES = ("plugin", "host")


class HostSuiteError(RuntimeError):
    """The expectations table is malformed, or a run could not be made."""


@dataclass(frozen=True)
class ExpectedFailure:
    test: str
    hosts: tuple
    runs: tuple  # ("all",) or run names
    cause: str
    why: str
    upstream_pr: Optional[int] = None
    change: Optional[str] = None

    def applies(self, host: str, run: str) -> bool:
        return host in self.hosts and ("all" in self.runs or run in self.runs)


@dataclass(frozen=True)
class Expectations:
    suites: dict  # host key -> tuple of files
    excluded: dict  # file (or file@host) -> why
    failures: tuple  # ExpectedFailure
    # file -> (why, node ids that leave threads running, run last in that file's own process)
    own_process: dict = field(default_factory=dict)

    def expected_failures(self, host: str, run: str) -> dict:
        return {f.test: f for f in self.failures if f.applies(host, run)}


def run_names() -> list:
    from fdsched.core.settings import shipped_profiles

    return [NO_PLUGIN, DEFAULT_RUN] + list(shipped_profiles())


def _flatten(items) -> list:
    out = []
    for item in items:
        out.extend(_flatten(item) if isinstance(item, list) else [item])
    return out


def load_expectations(path: Path = EXPECTATIONS) -> Expectations:
    """Read and check the table; a bad entry is one error naming its path in the file."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    where = str(path)
    if not {"suites", "excluded", "expected_failures"} <= set(data) <= {"suites", "excluded", "expected_failures", "own_process"}:
        raise HostSuiteError(f"{where}: top-level keys {sorted(data)}; allowed: suites, excluded, expected_failures, "
                             "own_process")
    suites = {}
    for host in HOST_KEYS:
        files = _flatten(data["suites"].get(host) or [])
        if not files or not all(isinstance(f, str) and f.startswith("tests/") for f in files):
            raise HostSuiteError(f"{where}: suites.{host}: {files!r}; allowed: a list of tests/... files")
        suites[host] = tuple(files)
    from fdsched.core.settings import CHANGE_IDS

    names = set(run_names()) | {"all"}
    failures = []
    for i, entry in enumerate(data["expected_failures"]):
        at = f"{where}: expected_failures[{i}]"
        keys = set(entry)
        allowed = {"test", "hosts", "runs", "cause", "why", "upstream_pr", "change"}
        if not {"test", "hosts", "runs", "cause", "why"} <= keys <= allowed:
            raise HostSuiteError(f"{at}: keys {sorted(keys)}; allowed: {', '.join(sorted(allowed))}")
        runs = ("all",) if entry["runs"] == "all" else tuple(entry["runs"])
        bad_runs = [r for r in runs if r not in names]
        if bad_runs:
            raise HostSuiteError(f"{at}.runs: {bad_runs}; allowed: all, {', '.join(sorted(names - {'all'}))}")
        hosts = tuple(entry["hosts"])
        if not hosts or any(h not in HOST_KEYS for h in hosts):
            raise HostSuiteError(f"{at}.hosts: {list(hosts)}; allowed: old, new")
        if entry["cause"] not in CAUSES:
            raise HostSuiteError(f"{at}.cause: {entry['cause']!r}; allowed: plugin, host")
        if (entry["cause"] == "plugin") != isinstance(entry.get("upstream_pr"), int):
            raise HostSuiteError(f"{at}.upstream_pr: {entry.get('upstream_pr')!r}; allowed: a PR number iff cause is plugin")
        if (entry["cause"] == "plugin") != (entry.get("change") in CHANGE_IDS):
            raise HostSuiteError(f"{at}.change: {entry.get('change')!r}; allowed: one of {', '.join(CHANGE_IDS)} iff cause is plugin")
        if entry["cause"] == "plugin" and NO_PLUGIN in runs + (("all",) if "all" in runs else ()):
            raise HostSuiteError(f"{at}.runs: a plugin-caused failure cannot apply to the {NO_PLUGIN} run")
        failures.append(
            ExpectedFailure(
                entry["test"], hosts, runs, entry["cause"], " ".join(str(entry["why"]).split()), entry.get("upstream_pr"),
                entry.get("change"),
            )
        )
    own = {}
    for path, entry in (data.get("own_process") or {}).items():
        at = f"{where}: own_process.{path}"
        if not isinstance(entry, dict) or set(entry) - {"why", "leaking_tests"} or "why" not in entry:
            raise HostSuiteError(f"{at}: {entry!r}; allowed: a mapping with why and leaking_tests (node ids)")
        nodes = tuple(entry.get("leaking_tests") or ())
        bad = [n for n in nodes if not str(n).startswith(path + "::")]
        if bad:
            raise HostSuiteError(f"{at}.leaking_tests: {bad}; allowed: node ids of {path}")
        own[path] = (" ".join(str(entry["why"]).split()), nodes)
    return Expectations(suites, dict(data["excluded"] or {}), tuple(failures), own)


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

    def counts(self) -> dict:
        counts = {"passed": 0, "failed": 0, "skipped": 0}
        for outcome in self.outcomes.values():
            counts[outcome] += 1
        return counts


def _os_free_ports(count: int) -> list:
    """``count`` distinct ports the OS reports free now (bound to port 0 together, then released)."""
    import socket

    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("0.0.0.0", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _run_env(run: str, results: str, scratch: str) -> dict:
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
    # The host's engine tests build their configs on FD_ENGINE_QUEUE_PORT / FD_CACHE_QUEUE_PORT (default 6778 /
    # 6779), and FastDeploy's EngineArgs asserts each is free: any other process holding one of them fails whichever
    # test builds a config then (seen: test_control_abort_requests_not_v1_raises, old host, under load). Free ports
    # of the OS's own picking instead, per process.
    env["FD_ENGINE_QUEUE_PORT"], env["FD_CACHE_QUEUE_PORT"] = (str(p) for p in _os_free_ports(2))
    if run != NO_PLUGIN:
        env["FD_PLUGINS"] = "fdsched"
        if run != DEFAULT_RUN:
            env["FDSCHED_PROFILE"] = run
    return env


def _groups(files: list, expectations: Expectations) -> list:
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


def run_suite(
    tree: str, host: str, run: str, expectations: Expectations, timeout: float = 900, only: Optional[list] = None
) -> RunResult:
    """Run the host's files for ``host`` under ``run`` in fresh pytest processes inside ``tree`` (one for the
    files that can share a process, one per ``own_process`` file); ``only``: just these node ids, in one process."""
    files = [f for f in expectations.suites[host] if os.path.isfile(os.path.join(tree, f))]
    missing = sorted(set(expectations.suites[host]) - set(files))
    if missing:
        raise HostSuiteError(f"the host tree {tree} has no {', '.join(missing)}; allowed: the files of host_suites.yaml")
    groups = [(list(only), ())] if only else _groups(files, expectations)
    outcomes, leaked, refused, installs, statuses, seconds, tails = {}, {}, [], [], [], 0.0, []
    for group, last in groups:
        data, took, tail = _run_process(tree, host, run, group, last, timeout)
        outcomes.update(data["outcomes"])
        leaked.update(data.get("leaked_threads") or {})
        refused.extend(data.get("refused_signals") or [])
        installs.append(data["install"])
        statuses.append(data["exitstatus"])
        seconds += took
        tails.append(tail)
    problems = []
    if any(install != installs[0] for install in installs[1:]):
        problems.append(f"the processes of one run installed differently: {installs}")
    exitstatus = next((st for st in statuses if st not in (0, 1)), max(statuses))
    result = RunResult(host, run, outcomes, installs[0], exitstatus, seconds, "\n".join(tails)[-6000:],
                       problems, leaked, refused)
    return result


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
    engine's :func:`fdsched.serve.launcher.sweep_shm` removes by its stack's ports; the host's tests pick their
    own ports, so here the selection is by what appeared.)"""
    new = sorted(_shm_names(shm_dir) - before)
    if not new:
        return []
    held = _open_paths()
    return remove_files([name for name in new if os.path.join(shm_dir, name) not in held], shm_dir)


def _run_process(tree: str, host: str, run: str, files: list, last: tuple, timeout: float) -> tuple:
    """(results data, seconds, output tail) of one pytest process over ``files``."""
    with tempfile.TemporaryDirectory(prefix="fdsched-hostsuite-") as scratch:
        results = os.path.join(scratch, "results.json")
        env = _run_env(run, results, scratch)
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
            # kill this pytest and whatever started it (it ended a CI run here mid-way on the new host). Inside the
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


def compare(result: RunResult, expectations: Expectations) -> list:
    """Every way the run differs from the table (empty when it matches)."""
    problems = list(result.problems)
    install = result.install
    if result.run == NO_PLUGIN:
        if install.get("installed"):
            problems.append(f"fdsched was installed although FD_PLUGINS was unset: {install.get('summary')}")
    elif not install.get("installed"):
        problems.append("FastDeploy's loader did not install fdsched (FD_PLUGINS=fdsched)")
    elif install.get("profile") != (None if result.run == DEFAULT_RUN else result.run):
        problems.append(f"installed with profile {install.get('profile')!r}, expected {result.run!r}")
    if result.exitstatus not in (0, 1):  # 2-4: interrupted, internal or usage error; 5: nothing collected
        problems.append(f"pytest exit status {result.exitstatus} (not a test failure: collection or usage error)")
    for path in expectations.suites[result.host]:
        if not any(node.split("::", 1)[0] == path for node in result.outcomes):
            problems.append(f"{path}: no test ran")
    expected = expectations.expected_failures(result.host, result.run)
    for node, outcome in sorted(result.outcomes.items()):
        if outcome == "failed" and node not in expected:
            problems.append(f"unexpected failure: {node}")
        elif outcome != "failed" and node in expected:
            entry = expected[node]
            problems.append(f"expected to fail ({entry.cause}{f', PR {entry.upstream_pr}' if entry.upstream_pr else ''}) but {outcome}: {node}")
    for node in sorted(set(expected) - set(result.outcomes)):
        problems.append(f"expected failure did not run: {node}")
    return problems


def run_and_compare(tree: str, host: str, run: str, expectations: Expectations, timeout: float = 900) -> tuple:
    """(result, problems): one run held against the table. No retry: a failure is a failure (the thread-leaking
    files run in processes of their own, see :func:`_groups`)."""
    result = run_suite(tree, host, run, expectations, timeout)
    return result, compare(result, expectations)


# ---- CLI -----------------------------------------------------------------------------------------
def add_command(host_sub) -> None:
    test = host_sub.add_parser(
        "test",
        help="run the host's own test files with fdsched loaded, under every profile, against host_suites.yaml",
    )
    test.add_argument("--run", nargs="+", metavar="RUN", help=f"runs to make (default: all: {NO_PLUGIN}, {DEFAULT_RUN}, every profile)")
    test.add_argument("--timeout", type=float, default=900, help="seconds per run (default 900)")
    test.set_defaults(func=cmd_test)


def host_tree_and_key() -> tuple:
    """(source tree, old/new) of the host fdsched finds; raises HostSuiteError when it is not a supported tree."""
    from fdsched.install.probe import probe
    from fdsched.install.hosts import host_key

    info = probe()
    if not os.path.isdir(os.path.join(info.location, "tests")):
        raise HostSuiteError(f"{info.label} has no tests/ folder: the host suites need a FastDeploy source tree (fdsched host setup)")
    key = host_key(info.commit)
    if key is None:
        raise HostSuiteError(f"{info.label}: no expectations for this commit; allowed: the old (e7c8dc2) or new (d38eeb8) host")
    return info.location, key, info.label


def cmd_test(args) -> int:
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        print("fdsched host test: error: pytest is not installed here; allowed: pip install pytest (or, in a checkout of this project: pip install '.[test]')",
              file=sys.stderr)
        return EXIT_ERROR
    expectations = load_expectations()
    tree, key, label = host_tree_and_key()
    runs = args.run or run_names()
    unknown = [r for r in runs if r not in run_names()]
    if unknown:
        print(f"fdsched host test: error: --run {unknown}; allowed: {', '.join(run_names())}", file=sys.stderr)
        return EXIT_ERROR
    print(f"host suites on {label} ({key} host): {len(expectations.suites[key])} files, {len(runs)} runs")
    rows, failed = [], False
    for run in runs:
        result, problems = run_and_compare(tree, key, run, expectations, timeout=args.timeout)
        counts = result.counts()
        expected = sum(1 for node in expectations.expected_failures(key, run) if result.outcomes.get(node) == "failed")
        rows.append((run, counts["passed"], counts["failed"], expected, counts["skipped"], len(problems), f"{result.seconds:.1f}"))
        for node, threads in sorted(result.leaked_threads.items()):
            where = "own process" if node.split("::", 1)[0] in expectations.own_process else "SHARED process"
            print(f"  {run}: left threads running ({where}): {node}: {', '.join(threads)}")
        for call in result.refused_signals:
            print(f"  {run}: refused a signal to a process the suite did not start: {call}")
        for problem in problems:
            print(f"  {run}: {problem}")
        if problems:
            failed = True
            print(result.output_tail)
    print(text_table(rows, ("run", "passed", "failed", "expected failures", "skipped", "problems", "seconds")))
    print("host suites: " + ("FAILED" if failed else "all outcomes as expected"))
    return EXIT_ERROR if failed else 0
