"""docs/explain.md cannot drift: its section for this host is regenerated from the installer's classes and compared,
and ``fdsched explain`` builds exactly the classes the installer installs."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "explain.md"


def test_the_page_section_of_this_host_is_what_the_code_builds():
    from fdsched.install.probe import probe
    from fdsched.tools.explain import docs_section, read_section, section_key

    if not PAGE.is_file():
        pytest.skip("docs/explain.md is not in this installation (an sdist/wheel without docs/)")
    info = probe()
    key = section_key(info)
    documented = read_section(PAGE.read_text(encoding="utf-8"), key)
    if documented is None:
        pytest.skip(f"docs/explain.md has no section for the {key} host (it documents the old and new hosts)")
    generated = docs_section(info)
    if generated != documented:
        diff = "\n".join(difflib.unified_diff(documented.splitlines(), generated.splitlines(), "docs/explain.md",
                                              "generated", lineterm="", n=1))
        pytest.fail(f"docs/explain.md is out of date for the {key} host; regenerate it on that host with "
                    f"`python -m fdsched.tools.explain --write-docs docs/explain.md`:\n{diff[:4000]}")


@pytest.mark.parametrize("profile", ["baseline", "adaptive"])
def test_explain_shows_the_installed_class_chain(profile):
    """The chain the command prints is the MRO of the class the installed plugin constructs."""
    from fdsched.core.settings import load_settings
    from fdsched.install import installer
    from fdsched.tools.explain import class_name, explain_host

    settings = load_settings(environ={}, profile=profile)
    _, targets, label = explain_host(settings, {})
    assert label == profile
    report = installer.install(settings, arms={})
    try:
        for t in targets:
            host_cls = report.host.host_classes[t.target]
            mro = report.classes[t.target].__mro__
            expected = [class_name(c) for c in mro[:mro.index(host_cls)]]
            assert [name for name, _ in t.chain[:-1]] == expected
            assert t.chain[-1][0].endswith("." + host_cls.__qualname__)
    finally:
        installer.uninstall()
