"""The plugin's mixins share one instance per host object: an attribute one mixin sets in ``self`` must not be set
by another mixin it is not related to, nor be the name of another's method (one would overwrite the other)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from collections import defaultdict

import fdsched.patches


def _patch_classes():
    classes = {}
    for info in pkgutil.walk_packages(fdsched.patches.__path__, "fdsched.patches."):
        module = importlib.import_module(info.name)
        tree = ast.parse(inspect.getsource(module))
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and isinstance(getattr(module, node.name, None), type):
                classes[getattr(module, node.name)] = node
    return classes


def _set_on_self(node: ast.ClassDef) -> set:
    names = set()
    for sub in ast.walk(node):
        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(sub, ast.AnnAssign) else []
        for target in targets:
            for element in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(element, ast.Attribute) and isinstance(element.value, ast.Name) and element.value.id == "self":
                    names.add(element.attr)
    return names


def test_no_two_unrelated_mixins_set_the_same_attribute_or_shadow_a_method():
    classes = _patch_classes()
    setters, methods = defaultdict(set), defaultdict(set)
    for cls, node in classes.items():
        for name in _set_on_self(node):
            if name.startswith(("_fdsched", "fdsched")):
                setters[name].add(cls)
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                methods[item.name].add(cls)
    assert setters, "no attribute found: the walk is broken"

    def related(a, b):
        return issubclass(a, b) or issubclass(b, a)

    clashes = []
    for name, owners in setters.items():
        for a in owners:
            for b in owners | methods.get(name, set()):
                if a is not b and not related(a, b):
                    clashes.append((name, a.__qualname__, b.__qualname__))
    assert clashes == []
