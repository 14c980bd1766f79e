"""The engine path's shape, read from the source (ast): what a reader of ``patches/`` and ``plugin/install/`` must not
meet.

* no ``ast`` parse of host source and no map keyed by thread under ``patches/``: a host is probed by calling or by
  reading its bytecode, and the scheduler's plan is found through the slot it hands its cache manager;
* one ``schedule()`` in ``patches/`` (the scheduler's fixed class's: ``tests/unit/test_catalogue.py``);
* no class made at run time (``type(name, bases, attrs)``): each target has one class, written out;
* a class statement in a function only for a target's one fixed class: its seam class and the host class as bases,
  no method in its body;
* no object's ``__class__`` reassigned.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PATH = ("patches", "plugin/install")

def _files(tops=ENGINE_PATH):
    for top in tops:
        for path in sorted((ROOT / top).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def _enclosing(tree):
    """node -> the name of the function it is in (the innermost), for every node in a function."""
    owner = {}
    for func in ast.walk(tree):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(func):
                owner[node] = func.name  # an inner function's nodes are visited again later and take its name
    return owner


def _found(predicate) -> set:
    found = set()
    for rel, tree in _files():
        owner = _enclosing(tree)
        found |= {f"{rel}:{owner.get(node, '<module>')}" for node in ast.walk(tree) if predicate(node)}
    return found


def _is_class_factory(node) -> bool:
    """``type(name, bases, attrs)`` or ``types.new_class(...)``."""
    if not isinstance(node, ast.Call):
        return False
    if isinstance(node.func, ast.Name) and node.func.id == "type" and len(node.args) == 3:
        return True
    return isinstance(node.func, (ast.Name, ast.Attribute)) and getattr(node.func, "attr", getattr(
        node.func, "id", None)) == "new_class"


def _reassigns_class(node) -> bool:
    return isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Attribute) and t.attr == "__class__" for t in node.targets)


def test_no_host_source_is_parsed_under_patches():
    readers, source = set(), ("getsource", "getsourcelines")
    for rel, tree in _files(("patches",)):
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(alias.name.split(".")[0] == "ast" for alias in node.names):
                readers.add(f"{rel}: import ast")
            elif isinstance(node, ast.ImportFrom) and ((node.module or "").split(".")[0] == "ast"
                                                       or any(alias.name in source for alias in node.names)):
                readers.add(f"{rel}: from {node.module} import ...")
            elif isinstance(node, ast.Attribute) and node.attr in source:
                readers.add(f"{rel}: .{node.attr}")
    assert not readers, f"host source read or parsed under patches/: {sorted(readers)}"


def test_no_map_is_keyed_by_thread_under_patches():
    """No ``x[get_ident()]`` and no ``x.get(get_ident())`` (nor ``threading.get_ident()``, ``threading.local``)."""
    def thread_id(node) -> bool:
        return isinstance(node, ast.Call) and (
            (isinstance(node.func, ast.Name) and node.func.id == "get_ident")
            or (isinstance(node.func, ast.Attribute) and node.func.attr == "get_ident"))

    keyed = set()
    for rel, tree in _files(("patches",)):
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and thread_id(node.slice):
                keyed.add(f"{rel}:{node.lineno}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("get", "pop", "setdefault", "add", "discard") and node.args
                  and thread_id(node.args[0])):
                keyed.add(f"{rel}:{node.lineno}")
            elif isinstance(node, ast.Attribute) and node.attr == "local":
                keyed.add(f"{rel}:{node.lineno}")
    assert not keyed, f"a map keyed by thread under patches/: {sorted(keyed)}"


def test_no_class_is_made_at_run_time():
    found = _found(_is_class_factory)
    assert not found, f"a class factory (type(name, bases, attrs)) on the engine path: {sorted(found)}"


# Class statements in a function ("path:function"): a target's one fixed class over the probed host class. Its body
# holds only the install's values; every method is in the module-level seam class it derives from, readable as is.
FIXED_CLASSES = {
    "patches/_cache_queue.py:over": "EngineCacheQueue: CacheQueue's seams over the host's class",
    "patches/_prefix_cache.py:over": "PrefixCacheManager: PrefixCache's seams over the host's class",
    "patches/_scheduler.py:over": "ResourceManagerV1: Scheduler's seams over the host's class",
}


def test_class_statements_in_functions_are_the_listed_fixed_classes():
    found, bodies = set(), {}
    for rel, tree in _files():
        for func in ast.walk(tree):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(func):
                    if isinstance(node, ast.ClassDef):
                        found.add(f"{rel}:{func.name}")
                        bodies[f"{rel}:{func.name}"] = node
    assert found == set(FIXED_CLASSES), f"class statements in functions: {sorted(found)}; listed: {sorted(FIXED_CLASSES)}"
    for where, node in bodies.items():
        methods = [n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        assert not methods, f"{where}: methods {methods} belong in the module-level seam class"
        assert all(isinstance(b, ast.Name) for b in node.bases) and len(node.bases) == 2, (
            f"{where}: bases must be the seam class and the host class, nothing chosen at run time")


def test_no_object_changes_class():
    found = _found(_reassigns_class)
    assert not found, f"an object's __class__ reassigned: {sorted(found)}"


# The classes that tell the cache manager something of a pass (``StepPlan.expect``): where the plugin refuses a running
# chunk the host has no seam to refuse, the host's own check of the chunk must answer False. Every other decision is
# made where it is asked (an admission's verdict asks the pool itself) and needs nothing of the cache manager.
TELLS_THE_CACHE_MANAGER = {
    "patches/ratio_reserve/budget.py:RunningChunkGuard": "a host without the reserve seams: the guarded chunk",
    "patches/ratio_reserve/off.py:PreChangeReserve": "off on a host with the change: the pre-change running pass",
}


def test_only_the_adapters_that_refuse_a_running_chunk_tell_the_cache_manager_anything():
    found = set()
    for rel, tree in _files(("patches",)):
        for cls in ast.walk(tree):
            if not isinstance(cls, ast.ClassDef):
                continue
            for node in ast.walk(cls):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "expect"):
                    found.add(f"{rel}:{cls.name}")
    assert found == set(TELLS_THE_CACHE_MANAGER), (
        f"StepPlan.expect called in {sorted(found)}; listed: {sorted(TELLS_THE_CACHE_MANAGER)}")
