"""The package's layers, checked from the source (ast): one direction only, no circles, the engine path free of tooling.

    core      settings, pure policies, adaptive estimator, hook manager, metrics (no host import)
    patches   host subclasses: import core (and patches._base) only
    install   probe, known hosts, installer, rebinding: import core and patches
    entry     FastDeploy's entry point: imports install (and core)
    tools, replay, serve   what only the ``fdsched`` command loads

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


# layer -> the layers it may import (besides itself and the package's __init__)
ALLOWED = {
    "core": {"core"},
    "patches": {"core"},
    "install": {"core", "patches"},
    "entry": {"core", "install"},
    "configs": set(),
    "replay": {"core", "install", "patches", "tools"},
    "serve": {"core", "install", "replay", "tools"},
    "tools": {"core", "install", "patches", "replay", "serve"},
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
    tooling = sorted(n for n in seen if layer(n) in {"tools", "replay", "serve"})
    assert not tooling, f"the engine path reaches {tooling}"
