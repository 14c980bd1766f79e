"""``fdsched explain``'s collection and formatting, on plain classes (no host): the chain, the overrides in the order
their definitions run, each seam's layers, which strategy serves each of a change's methods."""

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


class Seams:
    """A fixed class's seams (each hands the call to its strategies; the plain test runs none)."""

    def schedule(self):
        return super().schedule()

    def recycle(self):
        return super().recycle()

    def _fdsched_private(self):  # the plugin's own name: never shown as an override
        return None


class Fixed(Seams, Host):
    _fdsched_impl = {"a": "plugin", "b": "plugin"}  # installer data: never shown as an override


class ChangeA:
    seams = ("schedule",)

    def schedule(self, host):
        return ["a"]


class ChangeB:
    seams = ("schedule", "recycle")

    def schedule(self, host):
        return ["b"]

    def recycle(self, host):
        return "b"


def _explained():
    return explain_class(
        "Host", Fixed, Host,
        [("a", "plugin", "applied", ChangeA), ("b", "plugin", "applied", ChangeB), ("c", "host", "host already has it",
                                                                                   None)],
        {"a": ("schedule", "recycle"), "b": ("schedule", "recycle"), "c": ("recycle",)},
    )


def test_the_chain_is_the_mro_down_to_the_host_class():
    t = _explained()
    names = [name for name, _ in t.chain]
    assert names == [f"{__name__}.Fixed", f"{__name__}.Seams", f"{__name__}.Host"]
    assert t.chain[0][1].startswith("the plugin's class") and t.chain[-1][1] == "the host's class"
    assert t.host_bases == [f"{__name__}.HostBase", "object"]


def test_overrides_list_host_methods_in_the_order_their_definitions_run():
    t = _explained()
    assert dict(t.overrides) == {
        "recycle": [f"{__name__}.Seams", "host: Host"],
        "schedule": [f"{__name__}.Seams", "host: Host"],
    }
    assert Fixed().schedule() == ["host"]  # the order shown is the order they run


def test_each_seam_lists_its_layers_later_changes_outside():
    assert dict(_explained().layers) == {
        "recycle": [f"{__name__}.ChangeB", "host: Host"],
        "schedule": [f"{__name__}.ChangeB", f"{__name__}.ChangeA", "host: Host"],
    }


def test_per_change_rows_name_the_serving_strategy_or_none():
    rows = {row.change_id: row for row in _explained().changes}
    assert rows["a"].methods == (("schedule", f"{__name__}.Seams -> {__name__}.ChangeA"), ("recycle", f"{__name__}.Seams"))
    assert rows["b"].methods == (("schedule", f"{__name__}.Seams -> {__name__}.ChangeB"),
                                 ("recycle", f"{__name__}.Seams -> {__name__}.ChangeB"))
    assert rows["c"].strategy is None and rows["c"].methods == (("recycle", None),)


def test_text_and_markdown_formats():
    t = TargetExplanation(
        target="T", host_class="host.T", chain=[("T", "the plugin's class"), ("m.Seams", "seams"), ("host.T", "")],
        host_bases=["object"], overrides=[("run", ["m.Seams", "host: T"])],
        changes=[ChangeRow("c", "plugin", "applied", "c.Strategy", (("run", "m.Seams -> c.Strategy"), ("stop", None)))],
        note="a note", layers=[("run", ["c.Strategy", "host: T"])],
    )
    text = format_explanation("profile x on a host", [t])
    assert text.splitlines() == [
        "profile x on a host",
        "",
        "T (host.T)",
        "  class chain (MRO), outermost first:",
        "     1. T  [the plugin's class]",
        "     2. m.Seams  [seams]",
        "     3. host.T",
        "     4. the host's own bases: object",
        "  overridden host methods (definitions in the order they run):",
        "    run: m.Seams -> host: T",
        "  each seam's layers for this arm (outermost first):",
        "    run: c.Strategy -> host: T",
        "  per change (decision; strategy; host method: implemented by):",
        "    c: applied; strategy: c.Strategy",
        "      run: m.Seams -> c.Strategy",
        f"      stop: {NOT_OVERRIDDEN}",
        "",
        "a note",
    ]
    md = format_explanation("profile x on a host", [t], markdown=True)
    assert md.startswith("### profile x on a host\n\n#### T\n")
    assert "1. `T`: the plugin's class" in md
    assert "- `run`: `m.Seams` -> `host: T`" in md and "- `run`: `c.Strategy` -> `host: T`" in md
    assert f"| c | applied | `c.Strategy` | `run`: `m.Seams -> c.Strategy`; `stop`: {NOT_OVERRIDDEN} |" in md


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

    names = [f"ratio_reserve.SomeLongStrategyName{i}" for i in range(6)] + ["host: ResourceManagerV1"]
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
    seams = ("recycle",)
    fdsched_host_role = "counts what the host's own code decides"

    def recycle(self, host):
        return "counted"


def test_a_change_whose_host_code_runs_but_whose_strategy_serves_says_what_the_plugin_does():
    t = explain_class("Host", Fixed, Host,
                      [("w", "host", "host already has it", Watcher), ("x", "host", "host already has it", None),
                       ("y", "host", "off (host's own pre-change code)", Watcher)],
                      {"w": ("recycle",), "x": ("schedule",), "y": ("recycle",)})
    rows = {row.change_id: row for row in t.changes}
    assert rows["w"].methods == (("recycle", f"{__name__}.Seams -> {__name__}.Watcher"),)
    assert "host already has it" not in rows["w"].detail
    assert rows["w"].detail == ("the host's own version runs (the host has the change); the plugin only counts what "
                                "the host's own code decides")
    assert rows["x"].detail == "host already has it"  # nothing of the plugin's runs: true as it stands
    assert rows["y"].detail == "off (host's own pre-change code); the plugin only counts what the host's own code decides"
