"""``fdsched explain``'s collection and formatting, on plain classes (no host): the chain, the overrides in the order
their definitions run, which mixin implements each of a change's methods."""

from __future__ import annotations

from fdsched.tools.explain import (
    NOT_OVERRIDDEN, ChangeRow, TargetExplanation, explain_class, format_explanation, read_section, replace_section,
)


class HostBase:
    def helper(self):
        return "base"


class Host(HostBase):
    def schedule(self):
        return ["host"]

    def recycle(self):
        return "host"


class ChangeA:
    def schedule(self):
        return ["a"] + super().schedule()


class ChangeB:
    def schedule(self):
        return ["b"] + super().schedule()

    def recycle(self):
        return "b"

    def _private_helper(self):  # not a host method: not an override
        return None


class Arm(ChangeB, ChangeA, Host):
    _fdsched_impl = {"a": "plugin", "b": "plugin"}  # installer data: never shown as an override


def _explained():
    return explain_class(
        "Host", Arm, Host,
        [("a", "plugin", "applied", ChangeA), ("b", "plugin", "applied", ChangeB), ("c", "host", "host already has it",
                                                                                   None)],
        {"a": ("schedule", "recycle"), "b": ("schedule", "recycle"), "c": ("recycle",)},
    )


def test_the_chain_is_the_mro_down_to_the_host_class():
    t = _explained()
    names = [name for name, _ in t.chain]
    assert names == [f"{__name__}.Arm", f"{__name__}.ChangeB", f"{__name__}.ChangeA", f"{__name__}.Host"]
    assert t.chain[-1][1] == "the host's class"
    assert t.host_bases == [f"{__name__}.HostBase", "object"]


def test_overrides_list_host_methods_in_the_order_their_definitions_run():
    t = _explained()
    assert dict(t.overrides) == {
        "recycle": [f"{__name__}.ChangeB", "host: Host"],
        "schedule": [f"{__name__}.ChangeB", f"{__name__}.ChangeA", "host: Host"],
    }
    assert Arm().schedule() == ["b", "a", "host"]  # the order shown is the order they run


def test_per_change_rows_name_the_implementing_mixin_or_none():
    rows = {row.change_id: row for row in _explained().changes}
    assert rows["a"].methods == (("schedule", f"{__name__}.ChangeA"), ("recycle", None))
    assert rows["b"].methods == (("schedule", f"{__name__}.ChangeB"), ("recycle", f"{__name__}.ChangeB"))
    assert rows["c"].mixin is None and rows["c"].methods == (("recycle", None),)


def test_text_and_markdown_formats():
    t = TargetExplanation(
        target="T", host_class="host.T", chain=[("T[x]", "the arm's class"), ("m.Mixin", "mixin of c"), ("host.T", "")],
        host_bases=["object"], overrides=[("run", ["m.Mixin", "host: T"])],
        changes=[ChangeRow("c", "plugin", "applied", "m.Mixin", (("run", "m.Mixin"), ("stop", None)))],
        note="a note",
    )
    text = format_explanation("profile x on a host", [t])
    assert text.splitlines() == [
        "profile x on a host",
        "",
        "T (host.T)",
        "  class chain (MRO), outermost first:",
        "     1. T[x]  [the arm's class]",
        "     2. m.Mixin  [mixin of c]",
        "     3. host.T",
        "     4. the host's own bases: object",
        "  overridden host methods (definitions in the order they run):",
        "    run: m.Mixin -> host: T",
        "  per change (decision; mixin; host method: implemented by):",
        "    c: applied; mixin: m.Mixin",
        "      run: m.Mixin",
        f"      stop: {NOT_OVERRIDDEN}",
        "",
        "a note",
    ]
    md = format_explanation("profile x on a host", [t], markdown=True)
    assert md.startswith("### profile x on a host\n\n#### T\n")
    assert "1. `T[x]`: the arm's class" in md
    assert "- `run`: `m.Mixin` -> `host: T`" in md
    assert f"| c | applied | `m.Mixin` | `run`: `m.Mixin`; `stop`: {NOT_OVERRIDDEN} |" in md


def test_sections_are_replaced_in_place_or_appended():
    page = "intro\n"
    page = replace_section(page, "<!-- explain:old start -->\nA\n<!-- explain:old end -->", "old")
    page = replace_section(page, "<!-- explain:new start -->\nB\n<!-- explain:new end -->", "new")
    page = replace_section(page, "<!-- explain:old start -->\nA2\n<!-- explain:old end -->", "old")
    assert page == ("intro\n\n<!-- explain:old start -->\nA2\n<!-- explain:old end -->\n\n"
                    "<!-- explain:new start -->\nB\n<!-- explain:new end -->\n")
    assert read_section(page, "new") == "<!-- explain:new start -->\nB\n<!-- explain:new end -->"
    assert read_section(page, "other") is None


def test_the_command_without_a_host_is_one_line(monkeypatch, capsys, tmp_path):
    import importlib.util
    import sys

    import pytest

    from fdsched.tools.cli import main

    if "fastdeploy" in sys.modules or importlib.util.find_spec("fastdeploy") is not None:
        pytest.skip("FastDeploy is importable in this run")
    monkeypatch.setenv("FDSCHED_HOST_SOURCE", str(tmp_path))
    monkeypatch.setenv("FDSCHED_HOME", str(tmp_path / "home"))
    assert main(["explain", "--profile", "baseline"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("fdsched explain: error: ")
    assert main(["explain", "--profile", "nosuch"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nosuch" in err


def test_long_chains_wrap_before_an_arrow():
    from fdsched.tools.explain import TEXT_WIDTH, _wrap_chain

    names = [f"ratio_reserve.SomeLongMixinName{i}" for i in range(6)] + ["host: ResourceManagerV1"]
    lines = _wrap_chain("    schedule: ", names)
    assert len(lines) > 1 and all(len(line) <= TEXT_WIDTH for line in lines)
    assert all(line.lstrip().startswith("-> ") for line in lines[1:])
    assert " ".join(line.strip() for line in lines) == "schedule: " + " -> ".join(names)


def test_a_host_the_installer_cannot_build_on_is_one_line(monkeypatch, capsys, tmp_path):
    """A host whose classes break the probe or the build (an AttributeError in a probe, say) is one line, exit 1."""
    import fdsched.tools.explain as explain
    from fdsched.tools.cli import main

    def broken(*args, **kwargs):
        raise AttributeError("type object 'ResourceManagerV1' has no attribute 'preallocate_resource_in_p'")

    monkeypatch.setenv("FDSCHED_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(explain, "explain_host", broken)
    assert main(["explain", "--profile", "baseline"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [
        "fdsched explain: error: cannot build the classes on this host: AttributeError: type object "
        "'ResourceManagerV1' has no attribute 'preallocate_resource_in_p'"
    ]


class Watcher:
    fdsched_host_role = "counts what the host's own code decides"

    def recycle(self):
        return super().recycle()


class WatchedArm(Watcher, Host):
    pass


def test_a_change_whose_host_code_runs_but_whose_mixin_overrides_says_what_the_plugin_does():
    t = explain_class("Host", WatchedArm, Host,
                      [("w", "host", "host already has it", Watcher), ("x", "host", "host already has it", None),
                       ("y", "host", "off (host's own pre-change code)", Watcher)],
                      {"w": ("recycle",), "x": ("schedule",), "y": ("recycle",)})
    rows = {row.change_id: row for row in t.changes}
    assert rows["w"].methods == (("recycle", f"{__name__}.Watcher"),)
    assert "host already has it" not in rows["w"].detail
    assert rows["w"].detail == ("the host's own version runs (the host has the change); the plugin only counts what "
                                "the host's own code decides")
    assert rows["x"].detail == "host already has it"  # nothing of the plugin's runs: true as it stands
    assert rows["y"].detail == "off (host's own pre-change code); the plugin only counts what the host's own code decides"
