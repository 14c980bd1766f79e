"""fdsched.patches: the catalogue is data, and it cannot drift from the strategy code."""

from __future__ import annotations

import importlib
import re
import inspect
import pkgutil
import subprocess
import sys
from collections import defaultdict

import pytest

import fdsched.patches
from fdsched.patches import CATALOGUE, TARGETS, PatchSpec, Shapes, Variant, spec_for
from fdsched.patches._cache_queue import CacheQueue
from fdsched.patches._prefix_cache import PrefixCache
from fdsched.patches._scheduler import STEPS, Scheduler
from fdsched.patches._spec import declared, served_methods
from fdsched.core.settings import CHANGE_IDS, HOST_FIXES, SCHEMA

SCHEMA_BY_KEY = {s.key: s for s in SCHEMA}
PATCH_MODULES = sorted(
    # every change's module or package; the shared helpers (_base, _spec, _pass) are private modules
    info.name for info in pkgutil.iter_modules(fdsched.patches.__path__) if not info.name.startswith("_")
)
SPECS = {spec.change_id: spec for spec in CATALOGUE}
FIXED_CLASSES = {"EngineCacheQueue": CacheQueue, "PrefixCacheManager": PrefixCache, "ResourceManagerV1": Scheduler}


def own_methods(cls) -> set:
    """Functions a class defines itself, without the plugin's own names (private ``_fdsched`` helpers and
    public ``fdsched_`` accessors: never a host method)."""
    return {
        name
        for name, value in vars(cls).items()
        if (inspect.isfunction(value) or hasattr(value, "__set__")) and not name.startswith(("_fdsched", "fdsched_"))
    }


def test_catalogue_order_is_the_change_order():
    assert tuple(spec.change_id for spec in CATALOGUE) == CHANGE_IDS
    assert all(isinstance(spec, PatchSpec) for spec in CATALOGUE)


def test_spec_for():
    for change_id in CHANGE_IDS:
        assert spec_for(change_id).change_id == change_id
    with pytest.raises(KeyError):
        spec_for("no_such_change")


@pytest.mark.parametrize("change_id", CHANGE_IDS)
def test_strategies_serve_exactly_what_the_spec_replaces(change_id):
    """Per target, the seams the change's strategies serve (every impl, variant and shape together) are the methods
    its spec replaces there (``__init__``: the change acts when the fixed class builds the object), and the fixed
    class has each of them."""
    spec = SPECS[change_id]
    declared = defaultdict(set)
    for target_method in spec.replaces:
        target, method = target_method.split(".", 1)
        declared[target].add(method)
    assert set(declared) <= set(spec.strategies), f"{change_id}: replaces a method of a target without a strategy"
    for target in spec.strategies:
        seams = own_methods(FIXED_CLASSES[target])
        assert declared[target] <= seams, f"{change_id}: {target}'s class lacks {sorted(declared[target] - seams)}"
        served = {name for strategy in spec.classes(target) for name in served_methods(strategy)}
        assert served <= declared[target], f"{change_id}: {target}'s strategies serve {sorted(served)}"
        # what no strategy serves, the fixed class does itself, never with a seam method (a descriptor, the queue's)
        unserved = declared[target] - {"__init__"} - served
        assert not any(inspect.isfunction(vars(FIXED_CLASSES[target]).get(n)) for n in unserved), sorted(unserved)


@pytest.mark.parametrize("change_id", CHANGE_IDS)
def test_each_impl_has_its_entry_in_the_table(change_id):
    """Every impl has its entry in each target's table (None: the host's own code runs untouched there); the plugin's
    version always has a strategy somewhere."""
    spec = SPECS[change_id]
    for target, table in spec.strategies.items():
        assert set(table) == {"host", "plugin", "off"}
    assert any(table["plugin"] is not None for table in spec.strategies.values())
    assert SPECS["deferred_recycle"].strategies["PrefixCacheManager"]["host"] is None
    assert SPECS["pd_prefill_cache"].strategies["ResourceManagerV1"]["host"] is None
    table = SPECS["decode_only_preempt"].strategies["ResourceManagerV1"]
    assert table["plugin"].choose(True, None).decode_only is True
    assert table["off"].decode_only is False


def test_preemption_strategies_are_chosen_by_the_host_not_asked_per_call():
    """Change 2's strategy for a host with the preemption seam answers the seam and leaves the host's loop alone; for a
    host without it, it runs the loop and serves no seam the host would not call (chosen once, per scheduler)."""
    from fdsched.patches import decode_only_preempt as dop

    table = SPECS["decode_only_preempt"].strategies["ResourceManagerV1"]
    for impl in ("host", "plugin"):
        with_seam, without = table[impl].choose(True, None), table[impl].choose(False, None)
        assert with_seam is not without
        assert with_seam.seams == ("_select_preempt_candidate",)
        for shape in without if isinstance(without, Shapes) else (without,):
            assert shape.seams == ("_trigger_preempt",)
    # a host without the seam: the loop, with or without the decode node's output-cache save (2.5 has none)
    assert table["plugin"].choose(False, None) == (dop.PolicyPreemptLoop, dop.PolicyPreemptNoDecodeSave)
    assert "host_defines" not in vars(dop)  # no method asks which host it runs on


@pytest.mark.parametrize("change_id", CHANGE_IDS)
def test_targets_and_requirements_name_known_host_classes(change_id):
    spec = SPECS[change_id]
    assert set(spec.strategies) <= set(TARGETS)
    calls = [name for target in spec.strategies for strategy in spec.classes(target)
             for name in declared(strategy, "fdsched_calls")]
    for name in list(spec.replaces) + calls:
        target, method = name.split(".", 1)
        assert target in TARGETS and method.isidentifier(), name


@pytest.mark.parametrize("change_id", CHANGE_IDS)
def test_spec_text_fields_are_filled(change_id):
    spec = SPECS[change_id]
    for field in ("title", "why", "how", "hosts_needing", "delete_when", "upstream_state"):
        value = getattr(spec, field)
        assert isinstance(value, str) and value.strip(), f"{change_id}.{field} is empty"
    assert spec.upstream_state in ("merged", "open", "closed", "none")
    assert (spec.upstream_state == "none") == (change_id in HOST_FIXES)  # a host fix has no upstream PR (yet)


@pytest.mark.parametrize("change_id", CHANGE_IDS)
def test_switch_is_the_settings_variable(change_id):
    spec = SPECS[change_id]
    assert spec.switch == "FDSCHED_" + change_id.upper()
    assert SCHEMA_BY_KEY[f"changes.{change_id}"].env == spec.switch


@pytest.mark.parametrize("change_id", CHANGE_IDS)
def test_upstream_prs_are_ints(change_id):
    prs = SPECS[change_id].upstream_prs
    assert isinstance(prs, tuple) and (bool(prs) or change_id in HOST_FIXES)
    assert all(type(pr) is int and pr > 0 for pr in prs)


@pytest.mark.parametrize("change_id", CHANGE_IDS)
def test_probe_callables_are_callable(change_id):
    spec = SPECS[change_id]
    assert callable(spec.host_has)
    assert all(callable(r.check) and r.when and set(r.when) <= {"plugin", "off"} for r in spec.relies_on)
    assert spec.host_has_as_selected is None or callable(spec.host_has_as_selected)


def test_every_patch_module_is_referenced_by_exactly_one_spec():
    referenced = defaultdict(list)
    for spec in CATALOGUE:
        # a change's module, or the package that holds one module per implementation (ratio_reserve)
        classes = [c for target in spec.strategies for c in spec.classes(target)]
        for module in {".".join(cls.__module__.split(".")[:3]) for cls in classes}:
            referenced[module].append(spec.change_id)
    for name in PATCH_MODULES:
        module = importlib.import_module(f"fdsched.patches.{name}")
        assert len(referenced[module.__name__]) == 1, f"{name}: referenced by {referenced[module.__name__]}"
        assert module.SPEC in CATALOGUE
        assert referenced[module.__name__] == [module.SPEC.change_id]
    assert set(referenced) == {f"fdsched.patches.{name}" for name in PATCH_MODULES}


def test_patch_modules_are_named_after_their_change():
    assert PATCH_MODULES == sorted(CHANGE_IDS)


@pytest.mark.parametrize("name", PATCH_MODULES)
def test_patch_module_docstring_has_every_section(name):
    doc = importlib.import_module(f"fdsched.patches.{name}").__doc__ or ""
    for section in ("Replaces:", "Why:", "Upstream:", "Switch:", "Delete:"):
        assert section in doc, f"{name} docstring lacks {section}"


@pytest.mark.parametrize("name", PATCH_MODULES)
def test_patch_module_docstring_names_its_switch(name):
    module = importlib.import_module(f"fdsched.patches.{name}")
    assert module.SPEC.switch in module.__doc__


def test_importing_the_plugin_imports_no_host():
    code = (
        "import sys, fdsched, fdsched.core.settings, fdsched.core.hooks, fdsched.core.policies, fdsched.install.rebind, "
        "fdsched.patches, fdsched.install.installer, fdsched.tools.cli, fdsched.install.probe\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('fastdeploy', 'paddle'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# ---- the docstrings say what the specs say ----------------------------------------------------------------
_SECTION = re.compile(r"^([A-Z][A-Za-z ]*):(\s|$)")
_HOST_METHOD = re.compile(r"\b(" + "|".join(TARGETS) + r")\.(\w+)")


def docstring_sections(doc: str) -> dict:
    """Header (e.g. "Replaces") -> its text: the header line and the indented lines under it."""
    sections, current = {}, None
    for line in doc.splitlines():
        match = _SECTION.match(line)
        if match:
            current = match.group(1)
            sections[current] = line[match.end(1) + 1 :]
        elif current and line.startswith(" ") and line.strip():
            sections[current] += "\n" + line
        else:
            current = None
    return sections


def _module_of(change_id):
    return importlib.import_module(f"fdsched.patches.{change_id}")


@pytest.mark.parametrize("change_id", CHANGE_IDS)
def test_replaces_section_names_exactly_the_spec_replaces(change_id):
    text = docstring_sections(_module_of(change_id).__doc__)["Replaces"]
    named = {f"{target}.{method}" for target, method in _HOST_METHOD.findall(text)}
    assert named == set(SPECS[change_id].replaces), (
        f"{change_id}: 'Replaces:' names {sorted(named - set(SPECS[change_id].replaces))} not in SPEC.replaces and "
        f"omits {sorted(set(SPECS[change_id].replaces) - named)}"
    )


@pytest.mark.parametrize("change_id", CHANGE_IDS)
def test_relies_on_section_lists_exactly_the_spec_reliances(change_id):
    spec = SPECS[change_id]
    sections = docstring_sections(_module_of(change_id).__doc__)
    listed = re.findall(r"^\s+\* ([\w-]+):", sections.get("Relies on", ""), re.M)
    assert listed == [r.name for r in spec.relies_on], f"{change_id}: 'Relies on:' drifted from SPEC.relies_on"
    for reliance in spec.relies_on:
        assert reliance.text.strip() and callable(reliance.check)


# ---- the order in which changes' strategies wrap the seams they share -------------------------------------------
# Each fixed class builds an arm's strategies innermost first in catalogue order, so later entries wrap earlier ones.
# (target, seam) -> (outermost first) the change ids whose strategies serve it, and why that order is the right one.
WRAP_ORDER = {
    ("PrefixCacheManager", "update_cache_blocks"): (
        ("one_node_per_block", "pd_prefill_cache"),
        "the record fix corrects the count first, so the prefill node's gate decides on (and the host builds from) the "
        "corrected count; the gate's own records at finish go to the host directly",
    ),
    ("ResourceManagerV1", "_get_running_request_reserve_blocks"): (
        ("prefill_node_reserve", "ratio_reserve"),
        "prefill_node_reserve is chosen only where the host's own reservation runs (ratio_reserve auto on a host with "
        "it: ratio_reserve has no strategy there), so the two never both answer; pinned for every option",
    ),
    ("ResourceManagerV1", "get_new_block_nums"): (
        ("decode_node_reserve", "ratio_reserve"),
        "both read the host's count and pass it on unchanged: decode_node_reserve notes a decode node's running chunk "
        "in the pass's plan, ratio_reserve focuses the plan on the request (and, pre-change or guarded, decides on its "
        "chunk); neither reads what the other wrote",
    ),
    ("ResourceManagerV1", "_get_can_schedule_prefill_threshold_block"): (
        ("decode_node_reserve", "ratio_reserve"),
        "a decode node's running chunk is answered outside any reservation (its own blocks), so decode_node_reserve "
        "must see the threshold first; every other threshold goes on to the reservation (the plugin's, or under "
        "ratio_reserve auto the host's). Not in an arm whose ratio_reserve is off, whose own running chunk answer "
        "it would otherwise pre-empt",
    ),
    ("ResourceManagerV1", "_trigger_preempt"): (
        ("ratio_reserve", "decode_only_preempt"),
        "ratio_reserve must see every preemption call, whichever loop runs inside it (the host's, or change 2's): "
        "its guard declines before any loop runs, and it re-estimates the ratio / resets the host's fixed "
        "reservation after the loop, so reservation state is the reservation change's alone",
    ),
}


# The steps of the one schedule() (fdsched.patches._scheduler), per kind: the changes whose strategies take part, in the
# order they run (catalogue order), and why.
STEP_ORDER = {
    "pass_end": (
        ("decode_only_preempt", "ratio_reserve"),
        "after every pass, also one that raised: the no-victim episode ends, then the reservation closes its budget "
        "under the host's lock (putting the waiting queue and the pre-change preempt tasks back in place); neither "
        "reads the other's state",
    ),
    "pass_result": (
        ("pd_prefill_cache",),
        "the prefill node's pre-change recording reads the pass's final task list, so it runs after the budget closed "
        "(the pre-change preempt tasks are in the list then)",
    ),
    "after_passes": (
        ("preempted_seat_resume",),
        "the seat fix acts between two whole passes (after one that scheduled nothing): the pass it runs again has "
        "its own plan, ends and results",
    ),
}


def _options(spec, target: str, impl=None) -> tuple:
    """The change's strategy classes for ``target``: every option, or only those of ``impl``."""
    if impl is None:
        return spec.classes(target)
    chosen = spec.strategies.get(target, {}).get(impl)
    found = []
    for option in chosen.options if isinstance(chosen, Variant) else (chosen,) if chosen else ():
        found.extend(option if isinstance(option, Shapes) else (option,))
    return tuple(found)


def _layers(target: str, impl=None) -> list:
    """(change id, strategy class) in the order the fixed class wraps them, outermost first."""
    return [(spec.change_id, cls) for spec in reversed(CATALOGUE) for cls in _options(spec, target, impl)]


@pytest.mark.parametrize("kind", sorted(STEP_ORDER))
def test_steps_run_in_the_pinned_order(kind):
    assert set(STEP_ORDER) == set(STEPS)
    expected, why = STEP_ORDER[kind]
    owners = tuple(dict.fromkeys(cid for cid, cls in reversed(_layers("ResourceManagerV1")) if hasattr(cls, kind)))
    assert why and owners == expected
    for impl in ("host", "plugin", "off"):  # and so in a scheduler running every change's impl
        owners = tuple(dict.fromkeys(cid for cid, cls in reversed(_layers("ResourceManagerV1", impl))
                                     if hasattr(cls, kind)))
        assert owners == tuple(c for c in expected if c in owners)


def test_one_schedule_wrapper_under_patches():
    """Every change acts at a pass through a step; the only ``schedule()`` the plugin defines is the scheduler's."""
    import ast
    from pathlib import Path

    root = Path(fdsched.patches.__file__).parent
    found = [f"{path.relative_to(root)}:{node.lineno}" for path in sorted(root.rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.FunctionDef) and node.name == "schedule"]
    assert len(found) == 1 and found[0].startswith("_scheduler.py:"), found


def test_every_shared_seam_has_a_pinned_wrap_order():
    servers = defaultdict(set)
    for target in TARGETS:
        for change_id, cls in _layers(target):
            for seam in cls.seams:
                servers[(target, seam)].add(change_id)
    shared = {key for key, changes in servers.items() if len(changes) > 1}
    assert shared == set(WRAP_ORDER), "a seam two changes serve needs its order pinned (and explained) here"


@pytest.mark.parametrize("key", sorted(WRAP_ORDER))
def test_changes_wrap_shared_seams_in_the_pinned_order(key):
    target, seam = key
    expected, why = WRAP_ORDER[key]
    assert why
    assert tuple(dict.fromkeys(cid for cid, cls in _layers(target) if seam in cls.seams)) == expected
    for impl in ("host", "plugin", "off"):  # and so for every arm, whatever each change's impl
        in_arm = tuple(dict.fromkeys(cid for cid, cls in _layers(target, impl) if seam in cls.seams))
        assert in_arm == tuple(cid for cid in expected if cid in in_arm)


@pytest.mark.parametrize("mode", ["safe", "upstream"])
def test_pd_recording_is_chosen_by_mode_and_host_not_read_per_call(mode):
    """Change 4's strategy pair follows the arm's mode and the host once, when it is chosen: the gate lets through
    only that behaviour's moments, and only the behaviour that records itself carries the method that does."""
    from fdsched.core.settings import load_settings
    from fdsched.patches import pd_prefill_cache as pd

    spec = SPECS["pd_prefill_cache"]
    settings = load_settings(environ={"FDSCHED_PD_PREFILL_CACHE_MODE": mode}, profile="baseline")
    host_class = type("AnyRecorder", (), {"update_cache_blocks": lambda self, task, block_size, num_computed_tokens: None})
    for host_has in (False, True):
        gate, _ = spec.choose("PrefixCacheManager", "plugin", host_class, host_has, settings)
        scheduler = spec.strategies["ResourceManagerV1"]["plugin"].choose(host_has, settings)
        if mode == "safe":
            assert gate.allowed == frozenset() and scheduler is pd.PdSafe
        else:
            assert gate.allowed == {pd.PREALLOCATION}
            # the host that has the change records at preallocation itself; the plugin records only where it lacks it
            assert scheduler is (pd.PdRecording if host_has else pd.PdUpstreamRecord)
    assert spec.choose("PrefixCacheManager", "off", host_class, True, settings)[0].allowed == {pd.CHUNK}
    assert spec.strategies["ResourceManagerV1"]["off"] is pd.PdPreChange
    source = inspect.getsource(pd)
    assert "_fdsched_settings" not in source and ".has[" not in source  # no call reads the mode or the host


@pytest.mark.parametrize("estimator", ["ratio", "adaptive"])
def test_the_cache_manager_consults_the_pass_only_where_the_plugin_refuses_a_running_chunk(estimator):
    """Change 3's cache-manager strategy: the guard's refusal of a running chunk's check on a host without the reserve
    seams, and off's pre-change running pass; on a host with the seams the plugin's version needs nothing of the cache
    manager (the verdict asks the pool itself), so its check stays the host's."""
    from fdsched.core.settings import load_settings
    from fdsched.patches.ratio_reserve.budget import CHECK_SHAPES

    table = SPECS["ratio_reserve"].strategies["PrefixCacheManager"]
    settings = load_settings(environ={"FDSCHED_RESERVE_ESTIMATOR": estimator}, profile="recommended")
    assert table["plugin"].choose(True, settings) is None
    assert table["plugin"].choose(False, settings) is CHECK_SHAPES
    assert table["off"] is CHECK_SHAPES and table["host"] is None
