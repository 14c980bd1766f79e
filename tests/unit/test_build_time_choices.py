"""Every choice is made when the class is built: no method under patches/ asks at call time which host, PD role or
mode it runs in, and none reads an exception's text to decide.

What the walk forbids, in every function defined in a class body of ``patches/**/*.py`` (a method) that is not a
build-time function:

* the host's version or shape: reading an attribute ``split_status`` or ``_fdsched_host`` (the probe's answers), or
  calling ``hasattr`` (a shape probe on the object);
* the PD role, fixed for an object's life: an attribute ``splitwise_role``, or the string ``"splitwise_role"`` (as
  in ``getattr(self, "splitwise_role")``);
* a mode of the host's config fixed for the scheduler's life: an attribute ``speculative_config``;
* the arm's mode or settings: subscripting ``..._fdsched_settings[...]``, or reading ``_fdsched_impl``;
* exception-message sniffing: inside an ``except ... as name:`` handler, ``str(name)``, ``repr(name)`` or
  ``name.args``.

Build-time functions, where each of these is how the choice is made: ``__init__``, ``__new__``,
``__init_subclass__``, ``__set_name__``, a ``cached_property`` (runs once per object), and the plugin's
``_fdsched_make_*`` / ``_fdsched_bind_*`` methods, which only build-time functions may call (checked too).
Module-level functions (probes, variant choosers, run by the installer) are build time by definition.

The host's own switches that the host itself reads at call time (``envs.X``, ``cache_config.enable_prefix_caching``,
``kvcache_storage_backend``) are not choices of the plugin's: a paraphrase of host code reads them where the host
does.
"""

from __future__ import annotations

import ast
from pathlib import Path

import fdsched.patches

PATCHES = Path(fdsched.patches.__file__).parent

BUILD_TIME_NAMES = {"__init__", "__new__", "__init_subclass__", "__set_name__"}
BUILD_TIME_PREFIXES = ("_fdsched_make_", "_fdsched_bind_")
HOST_SHAPE = {"split_status", "_fdsched_host"}
ROLE = {"splitwise_role"}
CONFIG_MODE = {"speculative_config"}
ARM_MODE = {"_fdsched_impl"}


def _is_build_time(func: ast.FunctionDef) -> bool:
    if func.name in BUILD_TIME_NAMES or func.name.startswith(BUILD_TIME_PREFIXES):
        return True
    for decorator in func.decorator_list:
        name = decorator.attr if isinstance(decorator, ast.Attribute) else getattr(decorator, "id", None)
        if name == "cached_property":
            return True
    return False


def _handler_names(func) -> set:
    return {h.name for h in ast.walk(func) if isinstance(h, ast.ExceptHandler) and h.name}


def _function_violations(func: ast.FunctionDef) -> list:
    found = []
    caught = _handler_names(func)
    build_time = _is_build_time(func)
    for node in ast.walk(func):
        where = f"{func.name} line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            if not build_time and node.attr in HOST_SHAPE:
                found.append(f"{where}: reads the host's version/shape ({node.attr}) at call time")
            if not build_time and node.attr in ROLE:
                found.append(f"{where}: reads the PD role ({node.attr}) at call time")
            if not build_time and node.attr in CONFIG_MODE:
                found.append(f"{where}: reads a config mode ({node.attr}) at call time")
            if not build_time and node.attr in ARM_MODE:
                found.append(f"{where}: reads the arm's mode ({node.attr}) at call time")
        if isinstance(node, ast.Constant) and node.value in ROLE and not build_time:
            found.append(f"{where}: names the PD role attribute at call time")
        if isinstance(node, ast.Subscript) and not build_time:
            target = node.value
            if isinstance(target, ast.Attribute) and target.attr == "_fdsched_settings":
                found.append(f"{where}: reads the arm's settings at call time")
        if isinstance(node, ast.Call):
            callee = node.func
            if not build_time and isinstance(callee, ast.Name) and callee.id == "hasattr":
                found.append(f"{where}: probes the object's shape (hasattr) at call time")
            if (
                isinstance(callee, ast.Name) and callee.id in ("str", "repr") and node.args
                and isinstance(node.args[0], ast.Name) and node.args[0].id in caught
            ):
                found.append(f"{where}: reads an exception's text ({callee.id}({node.args[0].id}))")
            if (
                not build_time and isinstance(callee, ast.Attribute) and callee.attr.startswith(BUILD_TIME_PREFIXES)
            ):
                found.append(f"{where}: calls the build-time {callee.attr} at call time")
        if isinstance(node, ast.Attribute) and node.attr == "args" and isinstance(node.value, ast.Name) and node.value.id in caught:
            found.append(f"{where}: reads an exception's arguments ({node.value.id}.args)")
    return found


def violations(source: str) -> list:
    """Every call-time choice in ``source`` (a module's text), as ``"Class.method line N: what"``."""
    found = []
    for cls in ast.walk(ast.parse(source)):
        if not isinstance(cls, ast.ClassDef):
            continue
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.extend(f"{cls.name}.{v}" for v in _function_violations(item))
    return found


def test_no_method_under_patches_chooses_at_call_time():
    found = []
    for path in sorted(PATCHES.rglob("*.py")):  # the change modules and packages (ratio_reserve/), the helpers
        found.extend(f"{path.relative_to(PATCHES)}: {v}" for v in violations(path.read_text()))
    assert found == [], "choices made at call time (make them when the class or object is built):\n" + "\n".join(found)


def test_the_walk_finds_each_kind_of_call_time_choice():
    source = '''
class M:
    def __init__(self):
        self.decodes = self.config.scheduler_config.splitwise_role != "prefill"  # build time: allowed
        self.wait = self._fdsched_settings["tunables.transfer_wait_seconds"]

    def version(self, request):
        return request.status == (1 if self._fdsched_host.split_status else 2)

    def role(self):
        return getattr(self, "splitwise_role", None) == "prefill"

    def mode(self):
        return self._fdsched_settings["tunables.transfer_force_direct_recycle"]

    def shape(self):
        return hasattr(self, "init_reserve_output_block_num")

    def slack(self):
        return self.config.speculative_config.method is not None

    def sniff(self):
        try:
            pass
        except TypeError as exc:
            if "argument" not in str(exc):
                raise

    def rebinds(self):
        self._fdsched_bind_role(True)
'''
    found = violations(source)
    assert not [v for v in found if v.startswith("M.__init__")]
    for method, what in [
        ("version", "version/shape"), ("role", "PD role"), ("mode", "settings"), ("shape", "hasattr"),
        ("slack", "config mode"), ("sniff", "exception's text"), ("rebinds", "build-time"),
    ]:
        assert any(v.startswith(f"M.{method} ") and what in v for v in found), (method, found)
