"""A change's strategy keeps its own state on itself: it sets no plugin attribute (``_fdsched*`` / ``fdsched*``) on the
host object it serves, so two strategies on one scheduler or cache manager cannot overwrite each other's state, and
what the fixed class keeps there is the fixed class's alone."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil

import fdsched.patches


def _strategy_classes():
    """(class, its class statement) for every strategy class under patches/ (a class with ``seams``)."""
    found = []
    for info in pkgutil.walk_packages(fdsched.patches.__path__, "fdsched.patches."):
        module = importlib.import_module(info.name)
        for node in ast.parse(inspect.getsource(module)).body:
            cls = getattr(module, getattr(node, "name", ""), None)
            if isinstance(node, ast.ClassDef) and isinstance(cls, type) and hasattr(cls, "seams"):
                found.append((cls, node))
    return found


def _host_parameters(node: ast.ClassDef) -> set:
    """The names the class's methods give the host object: each method's parameter right after ``self``."""
    names = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and len(item.args.args) > 1 and item.args.args[0].arg == "self":
            names.add(item.args.args[1].arg)
    return names


def test_no_strategy_sets_plugin_state_on_the_host_object():
    classes = _strategy_classes()
    assert len(classes) > 20, "the walk found too few strategy classes: it is broken"
    found = []
    for cls, node in classes:
        hosts = _host_parameters(node) & {"rm", "cm", "queue", "scheduler", "cache_manager"}
        for sub in ast.walk(node):
            targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(
                sub, (ast.AnnAssign, ast.AugAssign)) else []
            for target in targets:
                for element in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if (isinstance(element, ast.Attribute) and isinstance(element.value, ast.Name)
                            and element.value.id in hosts and element.attr.startswith(("_fdsched", "fdsched"))):
                        found.append(f"{cls.__qualname__}: {element.value.id}.{element.attr}")
    assert found == []
