"""``fdsched bench instructions``: how many instructions ``schedule()`` executes over the schedule bench's steps,
host vs plugin, counted by valgrind's callgrind.

The timed bench (``fdsched bench schedule``) measures what the bar is stated in, CPU time, but on a shared machine
its ratios move by several percent between runs of the same code. An instruction count does not move with the
machine's load: the same code on the same workload counts the same to a few parts in a million. It is not a time
(a cache miss costs many instructions' worth and is not in it), so it is read beside the timed bench, not in its
place: it says how much work the plugin adds, the timed bench what that work costs.

How: each arm runs in a process of its own under ``valgrind --tool=callgrind``, which collects only while a marker
function is on the stack (``--toggle-collect``). The marker is ``qsort_r``, which glibc's ``qsort`` runs its
comparator in: ``qsort`` is called through ctypes on two elements with a comparator that runs one ``schedule()``
call, so only ``schedule()`` (and the marker's own few thousand instructions) is counted: the host import, the
set-up and the driver's simulated worker are not. A process that runs the marker around nothing as often gives
the count taken off both arms; one that also runs it once around a loop of known size shows the marker counts
(else the command stops with one line). The workload is the
schedule bench's (:func:`fdsched.tools.bench._schedule_setup`), with the collector off. Needs valgrind and a C
library whose ``qsort`` works through ``qsort_r`` (glibc); each arm takes several minutes, most of it the host's
import under valgrind.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

from fdsched.tools.bench import add_shape_args

MARKER = "qsort_r"
MARKER_ARM = "marker"  # the arm that runs the marker around nothing
CHECK_ARM = "marker-check"  # the same, and once around a loop of known size: the marker must count it
CHECK_LOOP = 100_000  # sum(range(CHECK_LOOP)): over a million instructions
_COLLECTED = re.compile(r"^==\d+== Collected : (\d+)\s*$", re.MULTILINE)


class InstructionsError(RuntimeError):
    """What stops a count, in one line."""


def collected(callgrind_stderr: str) -> int:
    """The instruction count callgrind reports at exit (``==PID== Collected : N``)."""
    found = _COLLECTED.findall(callgrind_stderr)
    if len(found) != 1:
        raise InstructionsError(f"callgrind reported {len(found)} 'Collected' lines, expected 1")
    return int(found[0])


def in_marker(fn):
    """Run ``fn()`` once where callgrind counts (inside the C library's ``qsort_r``, which glibc's ``qsort`` calls,
    through the comparator) and return what it returned."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    compare_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    result = []

    def compare(a, b):
        if not result:
            result.append(fn())
        return 0

    compare_c = compare_type(compare)
    pair = (ctypes.c_int * 2)(1, 2)
    libc.qsort(pair, 2, ctypes.sizeof(ctypes.c_int), compare_c)
    if not result:
        raise InstructionsError("qsort did not call its comparator")
    return result[0]


def run_arm(arm: str, running: int, waiting: int, steps: int, block_size: int, workload: str = "spread") -> dict:
    """In the counted process: ``steps`` schedule() calls of ``arm`` ("host" or a profile) on the schedule bench's
    workload, each inside the marker; ``arm == MARKER_ARM``: the marker around nothing, ``steps`` times."""
    if arm in (MARKER_ARM, CHECK_ARM):  # no host needed
        gc.disable()
        for _ in range(steps):
            in_marker(lambda: None)
        if arm == CHECK_ARM:
            in_marker(lambda: sum(range(CHECK_LOOP)))
        return {"arm": arm, "steps": steps}
    from fdsched.tools.bench import import_host, scheduler_for
    from fdsched.tools.benchcommon import install_arm

    import_host()
    with scheduler_for(arm, running, waiting, block_size, workload) as (rm, driver):
        gc.collect()
        gc.disable()
        schedule = rm.schedule
        rm.schedule = lambda: in_marker(schedule)  # the driver calls rm.schedule(); only this call is counted
        admitting = sum(bool(driver.step().prefill_chunks) for _ in range(steps))
    install_arm(None)
    return {"arm": arm, "steps": steps, "admitting_steps": admitting}


def count_arm(arm: str, running: int, waiting: int, steps: int, block_size: int, workload: str, valgrind: str) -> dict:
    """Run :func:`run_arm` in a fresh interpreter under callgrind; its report plus ``instructions``."""
    with tempfile.TemporaryDirectory(prefix="fdsched-callgrind-") as tmp:
        command = [
            valgrind, "--tool=callgrind", "--collect-atstart=no", f"--toggle-collect={MARKER}",
            f"--callgrind-out-file={os.path.join(tmp, 'callgrind.out')}",
            sys.executable, "-m", "fdsched.tools.instructions", arm, str(running), str(waiting), str(steps),
            str(block_size), workload,
        ]
        env = dict(os.environ, PYTHONHASHSEED="0")  # the same dict layouts in every arm
        done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        ours = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("==")]
        tail = ours[-1] if ours else "(no output)"
        raise InstructionsError(f"the {arm} arm exited with {done.returncode} under valgrind: {tail}")
    reports = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not reports:
        raise InstructionsError(f"the {arm} arm printed no report")
    report = json.loads(reports[-1])
    report["instructions"] = collected(done.stderr)
    return report


def run(args) -> int:
    from fdsched.core.settings import load_settings, resolve_profile

    resolve_profile(args.profile, "--profile")
    load_settings(environ={}, profile=args.profile)
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise InstructionsError("valgrind is not on PATH: each arm is counted under its callgrind (e.g. apt-get install valgrind)")
    from fdsched.install.probe import find_host

    find_host()  # no host: its one line now, not from the first arm minutes later
    shape = (args.running, args.waiting, args.steps, args.block_size, args.workload)
    print(f"schedule() instructions, {args.running} running ({args.workload}) + {args.waiting} waiting, {args.steps} steps, each arm "
          f"in a process of its own under callgrind (plugin profile {args.profile}); this takes several minutes")
    marker = count_arm(MARKER_ARM, *shape, valgrind)["instructions"]
    inside = count_arm(CHECK_ARM, *shape, valgrind)["instructions"] - marker
    if inside < CHECK_LOOP * 5:
        raise InstructionsError(
            f"callgrind counted {inside} instructions for a loop of {CHECK_LOOP} turns inside the marker: this C "
            f"library's qsort does not run its comparator inside {MARKER} (glibc's does), so nothing would be counted")
    host = count_arm("host", *shape, valgrind)
    plugin = count_arm(args.profile, *shape, valgrind)
    if host["admitting_steps"] != plugin["admitting_steps"]:
        print(f"note: the arms admitted in {host['admitting_steps']} and {plugin['admitting_steps']} steps: they "
              "did not do the same scheduling work")
    h, p = host["instructions"] - marker, plugin["instructions"] - marker
    print(f"host   {h / args.steps:>14,.0f} instructions a step")
    print(f"plugin {p / args.steps:>14,.0f} instructions a step")
    print(f"ratio  {p / h:>14.4f}  (plugin / host; the marker's own {marker / args.steps:,.0f} a step taken off both)")
    return 0


def add_command(which) -> None:
    parser = which.add_parser("instructions", help="schedule() instructions per step under callgrind: host vs "
                              "plugin (needs valgrind; a count the machine's load does not move)")
    add_shape_args(parser, "schedule() calls counted", most_steps=100_000)
    parser.add_argument("--profile", default="recommended", help="the plugin's profile")
    parser.set_defaults(func=run)


def main(argv=None) -> int:
    """The counted process: ``python -m fdsched.tools.instructions ARM RUNNING WAITING STEPS BLOCK_SIZE WORKLOAD``."""
    arm, running, waiting, steps, block_size, workload = (argv if argv is not None else sys.argv[1:])
    report = run_arm(arm, int(running), int(waiting), int(steps), int(block_size), workload)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
