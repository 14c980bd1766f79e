"""The package's layers, checked from the source (ast): one direction only, no circles, the engine path free of tooling.

    core      settings, pure policies, adaptive estimator, hook manager, metrics (no host import)
    patches   host subclasses: import core (and patches._base) only
    install   probe, known hosts, installer, rebinding: import core and patches
    entry     FastDeploy's entry point: imports install (and core)
    cmdline   what every command shares (output folders, quiet host output, /metrics scrapes): imports core only
    replay    the replay, its cost model and peak admission: below serve and tools
    serve     a served engine's runs: may use replay
    tools     the ``fdsched`` command itself: may use all of the above

A module-level import and an import inside a function count alike: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOPS = {"plugin": "fdsched", "patches": "fdsched.patches", "configs": "fdsched.configs"}


def _modules() -> dict:
    found = {}
    for top, package in TOPS.items():
        base = ROOT / top
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("").parts
            is_package = rel[-1] == "__init__"
            parts = package.split(".") + list(rel[:-1] if is_package else rel)
            found[".".join(parts)] = (path, is_package)
    return found


MODULES = _modules()


def _imports(name: str) -> set:
    path, is_package = MODULES[name]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        out.update(t for t in targets if t in MODULES and t != name)
    return out


GRAPH = {name: _imports(name) for name in MODULES}


def layer(name: str) -> str:
    parts = name.split(".")
    if len(parts) == 1:
        return "package"
    return {"hookspecs": "core", "entry": "entry"}.get(parts[1], parts[1])


# layer -> the layers it may import (besides itself and the package's __init__): the rule table
ALLOWED = {
    "core": {"core"},
    "patches": {"core"},
    "install": {"core", "patches"},
    "entry": {"core", "install"},
    "configs": set(),
    "cmdline": {"core"},
    "replay": {"core", "install", "patches", "cmdline"},
    "serve": {"core", "install", "cmdline", "replay"},
    "tools": {"core", "install", "patches", "cmdline", "replay", "serve"},
    "package": {"core"},
}


def test_every_module_is_in_a_known_layer():
    assert {layer(name) for name in MODULES} <= set(ALLOWED), sorted({layer(n) for n in MODULES} - set(ALLOWED))


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down_only(name):
    bad = sorted(t for t in GRAPH[name]
                 if layer(t) not in ALLOWED[layer(name)] | {layer(name), "package"})
    assert not bad, f"{name} ({layer(name)}) imports {bad}, outside {sorted(ALLOWED[layer(name)])}"


def test_no_circular_imports():
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            # a package importing its own submodules (a registry) and they importing it back is not a layering
            # circle only when every member is that one package; report the rest
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in sorted(GRAPH):
        if name not in index:
            visit(name)
    assert not cycles, f"import circles: {cycles}"


def test_the_engine_path_loads_no_tooling():
    """What FastDeploy's loader reaches from the entry point, transitively (lazy imports included)."""
    seen, todo = set(), ["fdsched.entry"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(GRAPH[name])
    tooling = sorted(n for n in seen if layer(n) in {"cmdline", "tools", "replay", "serve"})
    assert not tooling, f"the engine path reaches {tooling}"


def _layer_circles(rules: dict) -> set:
    """Pairs of distinct layers each allowed to import the other, directly or through other layers."""
    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in rules[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    reached = {name: reach(name) for name in rules}
    return {frozenset({a, b}) for a in rules for b in reached[a] if a != b and a in reached.get(b, set())}


def test_the_rule_table_has_no_circle():
    assert not _layer_circles(ALLOWED), sorted(map(sorted, _layer_circles(ALLOWED)))


def test_the_tooling_layers_import_in_one_direction():
    """replay < serve < tools, with cmdline under all three; the graph, not just the table."""
    order = {"cmdline": 0, "replay": 1, "serve": 2, "tools": 3}
    upward = sorted(f"{name} -> {target}" for name in GRAPH for target in GRAPH[name]
                    if layer(name) in order and layer(target) in order
                    and order[layer(target)] > order[layer(name)])
    assert not upward, f"imports against replay < serve < tools: {upward}"


def test_the_circle_check_sees_a_circle():
    assert _layer_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == {
        frozenset({"a", "b"}), frozenset({"a", "c"}), frozenset({"b", "c"})}
