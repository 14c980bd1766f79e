"""Code names a host by what it can do (``ReserveSeams``, ``PolicyPreemptLoop``), never by its age.

Tests and docs may say "the old host" / "the new host" when they mean the two test hosts; an identifier in
``plugin/`` or ``patches/`` (a class, function, variable, attribute, argument or import alias) may not.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AGE = re.compile(r"old_?host|new_?host", re.IGNORECASE)


def _identifiers(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, node.name
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg
        elif isinstance(node, ast.alias):
            yield getattr(node, "lineno", 0), node.asname or node.name
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.lineno, node.arg


def _age_names() -> list:
    found = []
    for top in ("plugin", "patches"):
        for path in sorted((ROOT / top).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            found += [f"{path.relative_to(ROOT)}:{line}: {name}" for line, name in _identifiers(tree) if AGE.search(name)]
    return found


def test_no_identifier_names_a_host_by_age():
    assert not _age_names(), "name the host's capability instead: " + "; ".join(_age_names())


def test_the_check_sees_an_age_name():
    tree = ast.parse("class PolicyPreemptOldHostMixin: pass\nnew_host = 1\ndef f(old_host): pass\n")
    assert sorted(name for _, name in _identifiers(tree) if AGE.search(name)) == [
        "PolicyPreemptOldHostMixin", "new_host", "old_host"]


SPOKEN_AGE = re.compile(r"\b(old|new)[ _-]?host\b", re.IGNORECASE)


def test_no_comment_or_string_in_the_code_names_a_host_by_age():
    """Comments and messages in ``plugin/`` and ``patches/`` name a FastDeploy line, a commit or a capability: the next
    line makes "the new host" wrong."""
    found = []
    for top in ("plugin", "patches"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                if SPOKEN_AGE.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}")
    assert not found, f"a host named by its age: {found}"
    assert SPOKEN_AGE.search("# seen on the new host") and not SPOKEN_AGE.search("renew hosting")
