"""fdsched.core.hooks / fdsched.hookspecs: the plugin manager, the fast path, third-party overrides."""

from __future__ import annotations

import inspect

import pluggy
import pytest

import fdsched.hookspecs
from fdsched import hookspecs
from fdsched.core import admission, policies
from fdsched.core.hooks import DISABLE_ENV, Policies, _blocked_names, make_plugin_manager
from fdsched.hookspecs import hookimpl
from fdsched.core.policies import VictimCandidate

HOOK_NAMES = sorted(name for name, obj in vars(hookspecs).items() if hasattr(obj, hookspecs.PROJECT + "_spec"))

# Datasette style: every test that exercises a hook says so; a test below checks all are covered.
TESTED_HOOKS: set = set()


def exercises(*hook_names):
    for name in hook_names:
        assert name in HOOK_NAMES, name
    TESTED_HOOKS.update(hook_names)
    return lambda test: test


@pytest.fixture
def pm():
    return make_plugin_manager(environ={}, load_entry_points=False)


@pytest.fixture
def pol(pm):
    return Policies(pm)


def C(request_id, decoding, extend=False):
    return VictimCandidate(request_id, decoding, extend)


MIXED = [C("a", True), C("b", False), C("c", True, extend=True), C("d", False), C("e", True), C("f", False)]
CANDIDATE_LISTS = [
    [],
    MIXED,
    [C("p1", False), C("p2", False)],
    [C("x", True, extend=True), C("y", False, extend=True)],
    [C("d1", True), C("d2", True)],
]


# --------------------------------------------------------------------------------------------
# The specs themselves
# --------------------------------------------------------------------------------------------
def test_there_are_three_hooks():
    assert HOOK_NAMES == ["fdsched_estimate_reserve_blocks", "fdsched_is_decoding", "fdsched_select_preemption_victim"]
    assert sorted(n for n in hookspecs.__all__ if n.startswith("fdsched_")) == HOOK_NAMES


@pytest.mark.parametrize("name", HOOK_NAMES)
def test_every_hookspec_is_documented(name):
    spec = getattr(hookspecs, name)
    doc = inspect.getdoc(spec)
    assert doc, name
    assert ":param" in doc
    assert "versionadded" in doc
    assert ":returns:" in doc
    for param in inspect.signature(spec).parameters:
        assert f":param {param}:" in doc, f"{name} does not document {param}"


@pytest.mark.parametrize("name", HOOK_NAMES)
def test_every_hook_stops_at_the_first_result(name):
    assert getattr(hookspecs, name).fdsched_spec["firstresult"] is True


# --------------------------------------------------------------------------------------------
# The manager and the fast path
# --------------------------------------------------------------------------------------------
def test_manager_has_only_the_defaults(pm, pol):
    assert [name for name, _ in pm.list_name_plugin()] == ["fdsched-defaults"]
    assert pol.external_plugins() == []
    for name in HOOK_NAMES:
        assert len(getattr(pm.hook, name).get_hookimpls()) == 1
    assert pol._direct_victim and pol._direct_reserve and pol._direct_decoding


@exercises("fdsched_select_preemption_victim")
@pytest.mark.parametrize("candidates", CANDIDATE_LISTS)
def test_victim_fast_path_and_dispatch_equal_the_pure_functions(pm, pol, candidates):
    assert pol.select_victim(candidates, True) == policies.select_preemption_victim(candidates)
    assert pol.select_victim(candidates, False) == policies.select_any_phase_victim(candidates)
    # the default hook implementation (what dispatch reaches) gives the same answers
    hook = pm.hook.fdsched_select_preemption_victim
    assert hook(candidates=candidates, decode_only=True) == policies.select_preemption_victim(candidates)
    assert hook(candidates=candidates, decode_only=False) == policies.select_any_phase_victim(candidates)


def test_victim_answers_on_the_mixed_queue(pol):
    assert pol.select_victim(MIXED, True) == 4  # "e": last decoding, no extend tables
    assert pol.select_victim(MIXED, False) == 5  # "f": last without extend tables, a prefill


@exercises("fdsched_estimate_reserve_blocks")
@pytest.mark.parametrize(
    "args", [(100, 0, 0.5, 4096, 16), (100, 150, 0.7, 4096, 64), (10_000, 10, 1.0, 4096, 64), (64, 0, 1.0, 4096, 64)]
)
def test_reserve_fast_path_and_dispatch_equal_the_pure_function(pm, pol, args):
    expected = admission.reserve_blocks_for_request(*args)
    assert pol.reserve_blocks("r", *args) == expected
    max_new, generated, ratio, clip, block = args
    assert (
        pm.hook.fdsched_estimate_reserve_blocks(
            request_id="r", max_new_tokens=max_new, generated_tokens=generated, ratio=ratio,
            clip_max_new_tokens=clip, block_size=block,
        )
        == expected
    )


@exercises("fdsched_is_decoding")
@pytest.mark.parametrize("args", [(True, 1, 10), (False, 100, 10), (None, 11, 10), (None, 10, 10), (None, 3, 10)])
def test_is_decoding_fast_path_and_dispatch_equal_the_pure_function(pm, pol, args):
    expected = policies.is_decoding(*args)
    assert pol.is_decoding("r", *args) is expected
    status, total, need = args
    hook = pm.hook.fdsched_is_decoding
    assert hook(request_id="r", status_is_decode=status, num_total_tokens=total, need_prefill_tokens=need) is expected


# --------------------------------------------------------------------------------------------
# Third-party implementations
# --------------------------------------------------------------------------------------------
class FirstRequestVictim:
    """Always preempt the oldest request."""

    @hookimpl
    def fdsched_select_preemption_victim(self, candidates, decode_only):
        return 0 if candidates else None


class AbstainingVictim:
    def __init__(self):
        self.calls = 0

    @hookimpl
    def fdsched_select_preemption_victim(self, candidates, decode_only):
        self.calls += 1
        return None


class FlatReserve:
    """Two blocks per request, except for requests it does not know."""

    @hookimpl
    def fdsched_estimate_reserve_blocks(self, request_id, max_new_tokens, generated_tokens, ratio,
                                        clip_max_new_tokens, block_size):
        return None if request_id.startswith("unknown") else 2


class DecodeByName:
    @hookimpl
    def fdsched_is_decoding(self, request_id, status_is_decode, num_total_tokens, need_prefill_tokens):
        if request_id.startswith("dec"):
            return True
        if request_id.startswith("pre"):
            return False
        return None


@exercises("fdsched_select_preemption_victim")
def test_plugin_overrides_select_victim(pol):
    plugin = FirstRequestVictim()
    pol.register(plugin, name="first-victim")
    assert pol.external_plugins() == ["first-victim"]
    assert pol._direct_victim is False
    assert pol._direct_reserve is True and pol._direct_decoding is True  # other hooks keep the fast path
    assert pol.select_victim(MIXED, True) == 0
    assert pol.select_victim(MIXED, False) == 0
    pol.unregister(plugin)
    assert pol._direct_victim is True
    assert pol.select_victim(MIXED, True) == 4


@exercises("fdsched_select_preemption_victim")
def test_victim_plugin_returning_none_falls_through_to_the_default(pol):
    plugin = AbstainingVictim()
    pol.register(plugin)
    assert pol.select_victim(MIXED, True) == 4
    assert pol.select_victim(MIXED, False) == 5
    assert pol.select_victim([C("p", False)], True) is None  # the default's own None
    assert plugin.calls == 3


@exercises("fdsched_estimate_reserve_blocks")
def test_plugin_overrides_reserve_blocks(pol):
    pol.register(FlatReserve(), name="flat")
    assert pol._direct_reserve is False
    assert pol.reserve_blocks("r1", 10_000, 0, 1.0, 4096, 64) == 2
    # None falls through to the default formula
    assert pol.reserve_blocks("unknown-1", 10_000, 0, 1.0, 4096, 64) == 64


@exercises("fdsched_is_decoding")
def test_plugin_overrides_is_decoding(pol):
    pol.register(DecodeByName(), name="by-name")
    assert pol._direct_decoding is False
    assert pol.is_decoding("dec-1", False, 1, 10) is True  # overrides even the status
    assert pol.is_decoding("pre-1", True, 100, 10) is False
    # None falls through to the default
    assert pol.is_decoding("other", None, 100, 10) is True
    assert pol.is_decoding("other", False, 100, 10) is False


@exercises("fdsched_select_preemption_victim")
def test_later_plugins_are_asked_first(pol):
    pol.register(AbstainingVictim(), name="abstain")
    pol.register(FirstRequestVictim(), name="first")
    assert pol.select_victim(MIXED, True) == 0
    assert pol.external_plugins() == ["abstain", "first"]


@exercises("fdsched_select_preemption_victim")
def test_refresh_switches_off_the_fast_path(pm, pol):
    pm.register(FirstRequestVictim())  # behind the relay's back
    assert pol._direct_victim is True
    assert pol.select_victim(MIXED, True) == 4  # still the cached fast path
    pol.refresh()
    assert pol._direct_victim is False
    assert pol.select_victim(MIXED, True) == 0


# --------------------------------------------------------------------------------------------
# Validation and entry-point blocking
# --------------------------------------------------------------------------------------------
class UnknownHook:
    @hookimpl
    def fdsched_select_preemption_victims(self, candidates):  # typo of a real hook name
        return 0


def test_unknown_hook_name_fails_check_pending(pm):
    pm.register(UnknownHook())
    with pytest.raises(pluggy.PluginValidationError, match="fdsched_select_preemption_victims"):
        pm.check_pending()


def test_policies_register_rejects_an_unknown_hook(pol):
    with pytest.raises(pluggy.PluginValidationError):
        pol.register(UnknownHook(), name="typo")


def test_a_rejected_plugin_is_not_left_registered(pol):
    class HalfGood(FirstRequestVictim, UnknownHook):
        pass

    plugin = HalfGood()
    with pytest.raises(pluggy.PluginValidationError):
        pol.register(plugin, name="half-good")
    assert not pol.pm.is_registered(plugin)
    assert pol.external_plugins() == []


def test_wrong_parameter_name_is_rejected_at_register(pm):
    class WrongArgs:
        @hookimpl
        def fdsched_is_decoding(self, request_id, no_such_argument):
            return True

    with pytest.raises(pluggy.PluginValidationError):
        pm.register(WrongArgs())


def test_unmarked_functions_are_not_hooks(pol):
    class Unmarked:
        def fdsched_select_preemption_victim(self, candidates, decode_only):
            return 0

    pol.register(Unmarked(), name="unmarked")
    assert pol._direct_victim is True
    assert pol.select_victim(MIXED, True) == 4


@pytest.mark.parametrize(
    "raw, expected",
    [
        (None, None),
        ("", None),
        ("  ", None),
        ("0", None),
        ("1", set()),
        ("all", set()),
        ("ALL", set()),
        ("true", set()),
        ("a,b", {"a", "b"}),
        (" a , b ,, ", {"a", "b"}),
        ("only-one", {"only-one"}),
    ],
)
def test_blocked_names(raw, expected):
    environ = {} if raw is None else {DISABLE_ENV: raw}
    assert _blocked_names(environ) == expected


def test_blocked_names_are_blocked_in_the_manager():
    pm = make_plugin_manager(environ={DISABLE_ENV: "a,b"})
    assert pm.is_blocked("a") and pm.is_blocked("b")
    assert not pm.is_blocked("fdsched-defaults")
    # pluggy keeps a blocked name as a placeholder without a plugin object
    assert [name for name, plugin in pm.list_name_plugin() if plugin is not None] == ["fdsched-defaults"]


def test_blocked_names_are_not_reported_as_external_plugins():
    pol = Policies(make_plugin_manager(environ={DISABLE_ENV: "a,b"}))
    assert pol.external_plugins() == []


def test_blocking_everything_loads_no_entry_points():
    pm = make_plugin_manager(environ={DISABLE_ENV: "1"})
    assert [name for name, _ in pm.list_name_plugin()] == ["fdsched-defaults"]
    assert Policies(pm)._direct_victim is True


def test_hookimpl_is_exported_at_the_documented_place():
    assert fdsched.hookspecs.hookimpl is hookimpl
    assert isinstance(hookimpl, pluggy.HookimplMarker)
    assert hookimpl.project_name == "fdsched"


def test_hookimpl_is_reachable_as_documented_in_hookspecs():
    import fdsched

    assert fdsched.hookimpl is hookimpl


# Keep last in the file for readability; it does not depend on test order (TESTED_HOOKS is filled at import).
def test_every_hook_is_exercised_in_this_file():
    assert TESTED_HOOKS == set(HOOK_NAMES)


def test_reserve_override_is_none_without_a_third_party_and_its_answer_with_one(pol):
    args = ("r1", 3000, 10, 0.7, 4096, 16)
    assert pol.reserve_blocks_override(*args) is None  # only the defaults: the adaptive estimator answers

    class Fixed:
        @hookimpl
        def fdsched_estimate_reserve_blocks(self, request_id, max_new_tokens, generated_tokens, ratio,
                                            clip_max_new_tokens, block_size):
            return 3 if request_id == "r1" else None

    pol.register(Fixed(), name="fixed")
    assert pol.reserve_blocks_override(*args) == 3
    # A third party that passes on a request leaves it to the estimator: the plugin's ratio default is not asked.
    assert pol.reserve_blocks_override("r2", 3000, 10, 0.7, 4096, 16) is None
    assert pol.reserve_blocks("r2", 3000, 10, 0.7, 4096, 16) == admission.reserve_blocks_for_request(3000, 10, 0.7, 4096, 16)


@pytest.mark.parametrize("raw, state", [
    ("1", "blocked by FDSCHED_DISABLE_EXTERNAL_HOOKS=1"),
    ("acme,other", "blocked by FDSCHED_DISABLE_EXTERNAL_HOOKS=acme,other"),
    ("other", "not loaded"),  # not blocked; pluggy finds no distribution behind the fake entry point
])
def test_doctor_states_say_blocked_not_none(monkeypatch, raw, state):
    import importlib.metadata
    from types import SimpleNamespace

    from fdsched.core.hooks import external_plugin_states

    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None: [SimpleNamespace(name="acme")] if group == "fdsched.hooks" else [])
    rows, blocked_all = external_plugin_states({DISABLE_ENV: raw})
    assert rows == [("acme", state)]
    assert blocked_all is (raw == "1")


def test_doctor_prints_a_blocked_plugin_as_blocked(monkeypatch, capsys):
    import importlib.metadata
    from types import SimpleNamespace

    from fdsched.tools.cli import main

    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None: [SimpleNamespace(name="acme")] if group == "fdsched.hooks" else [])
    monkeypatch.setenv(DISABLE_ENV, "1")
    monkeypatch.setenv("FDSCHED_HOST_SOURCE", "/nonexistent")
    main(["doctor"])
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("third-party hook plugins"))
    assert line.endswith(": acme (blocked by FDSCHED_DISABLE_EXTERNAL_HOOKS=1)")
