"""What the benchmarks share: installing an arm's classes, naming the host, and timing a run with the
garbage collector on, due or off (:mod:`fdsched.tools.bench`, :mod:`fdsched.tools.evictbench`,
:mod:`fdsched.tools.transferbench`, :mod:`fdsched.tools.instructions`)."""

from __future__ import annotations

import gc
import time


def install_arm(profile):
    """Install ``profile``'s classes (None: the host's own) and return the arm's name."""
    from fdsched.install import installer
    from fdsched.core.settings import load_settings

    if profile is None:
        installer.uninstall()
        return "host"
    installer.install(load_settings(profile=profile))
    return profile


def host_label() -> str:
    from fdsched.install.probe import probe

    return probe().label


def timed(run, gc_on):
    """Run ``run()`` with the collector on (True), on with a full collection due ("due") or off (False);
    return (seconds, result, collections per generation while it ran)."""
    counts = [0, 0, 0]

    def count(phase, info):
        if phase == "start":
            counts[info["generation"]] += 1

    was_enabled = gc.isenabled()
    if gc_on == "due":
        make_full_collection_due()
    gc.callbacks.append(count)
    if gc_on:
        gc.enable()
    else:
        gc.disable()
    try:
        started = time.perf_counter()
        result = run()
        seconds = time.perf_counter() - started
    finally:
        gc.callbacks.remove(count)
        _DUE.clear()
        if was_enabled:
            gc.enable()
        else:
            gc.disable()
    return seconds, result, counts


# GC modes of the benches: "on" (the collector's counters stand where building the workload left them),
# "due" (on, and a full collection is due: the next objects that survive into the oldest generation start
# one), "off" (collections held off while timed).
GC_MODES = ("on", "due", "off")


_DUE: list = []


def make_full_collection_due(margin: int = 500) -> None:
    """Put the collector where a long-running engine regularly is: just short of a full collection.

    CPython runs a full collection when the oldest generation's counter is over its threshold AND the
    objects that reached that generation since the last full collection exceed a quarter of the ones
    that were there (the "long-lived pending" rule). An engine's requests keep promoting objects, so it
    crosses that line now and then; whatever loop promotes the last few thousand objects pays for a
    traversal of the whole heap. Here: collect, then promote ``total / 4 - margin`` fresh objects with
    young-generation collections, which also bring the oldest generation's counter over its threshold, and
    bring the middle generation's counter to its threshold: the timed code's first collection is a
    middle-generation one (its survivors count as pending), and the one after it is a full collection if
    the timed code keeps more than ``margin`` new objects alive meanwhile.
    """
    gc.collect()
    total = len(gc.get_objects())
    _DUE.clear()
    _DUE.extend([i] for i in range(max(0, total // 4 - margin)))
    for _ in range(gc.get_threshold()[2] + 1):
        gc.collect(1)  # survivors move to the oldest generation (pending grows), its counter goes up by one
    for _ in range(gc.get_threshold()[1]):
        gc.collect(0)  # the middle generation's counter goes up by one


def full_collection_ms(repeat: int = 3) -> float:
    """The median time of one full collection of this process as it stands: what a due collection costs the
    code that happens to trigger it (the trade against the eviction's hold, docs/gc.md)."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2] * 1e3
