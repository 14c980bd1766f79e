"""fdsched.install.rebind: replace a class everywhere it was bound, and put back exactly what was replaced.

Uses throw-away modules (types.ModuleType) in sys.modules, scanned with scan_prefixes=('rebindtest',).
"""

from __future__ import annotations

import sys
import types

import pytest

from fdsched.install.rebind import Rebinding

PREFIXES = ("rebindtest",)


class Original:
    pass


class Replacement(Original):
    pass


class ThirdParty(Original):
    pass


def _leftovers():
    return sorted(n for n in sys.modules if n.startswith(("rebindtest", "rbt_", "fdsched._rebindtest")))


@pytest.fixture(scope="module", autouse=True)
def _sys_modules_cleaned_up():
    assert _leftovers() == []
    yield
    assert _leftovers() == [], "throw-away modules left in sys.modules"


@pytest.fixture
def make_module():
    created = []

    def _make(name: str, **attrs) -> types.ModuleType:
        assert name not in sys.modules
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module
        created.append(name)
        return module

    yield _make
    for name in created:
        sys.modules.pop(name, None)


@pytest.fixture
def world(make_module):
    """A defining module, an importing module with an alias, and modules outside the scan prefixes."""
    return types.SimpleNamespace(
        defining=make_module("rebindtest_def", Thing=Original, helper=len),
        user=make_module("rebindtest_user", Thing=Original, Alias=Original, Other=int),
        plain=make_module("rbt_plain_consumer", Thing=Original, Alias=Original),
        unrelated=make_module("rbt_unrelated", Thing=ThirdParty),
        ours=make_module("fdsched._rebindtest_holder", Thing=Original, Alias=Original),
    )


def snapshot(*modules):
    return {module.__name__: dict(vars(module)) for module in modules}


def test_apply_replaces_in_defining_and_importing_modules(world):
    rebinding = Rebinding("rebindtest_def", "Thing", Replacement, scan_prefixes=PREFIXES)
    assert rebinding.original is Original
    sites = rebinding.apply()

    assert world.defining.Thing is Replacement
    assert world.user.Thing is Replacement
    assert world.user.Alias is Replacement  # alias in a scanned module
    assert world.plain.Thing is Replacement  # same name outside the prefixes
    assert world.plain.Alias is Original  # alias outside the prefixes is not looked for
    assert world.unrelated.Thing is ThirdParty  # not the original: untouched
    assert world.user.Other is int and world.defining.helper is len

    assert sites[0] == "rebindtest_def.Thing"  # defining module first
    assert sorted(sites) == sorted(
        ["rebindtest_def.Thing", "rebindtest_user.Thing", "rebindtest_user.Alias", "rbt_plain_consumer.Thing"]
    )
    assert len(sites) == len(set(sites))


def test_sites_after_the_defining_module_are_sorted_by_module(world, make_module):
    make_module("rebindtest_aaa", Thing=Original)
    sites = Rebinding("rebindtest_def", "Thing", Replacement, scan_prefixes=PREFIXES).apply()
    modules = [site.rsplit(".", 1)[0] for site in sites]
    assert modules[0] == "rebindtest_def"
    assert modules[1:] == sorted(modules[1:])
    assert "rebindtest_aaa" in modules


def test_fdsched_modules_are_never_touched(world):
    before = snapshot(world.ours)
    rebinding = Rebinding("rebindtest_def", "Thing", Replacement, scan_prefixes=PREFIXES + ("fdsched",))
    sites = rebinding.apply()
    assert not any(site.startswith("fdsched") for site in sites)
    assert snapshot(world.ours) == before
    assert world.ours.Thing is Original and world.ours.Alias is Original
    rebinding.restore()
    assert snapshot(world.ours) == before


def test_restore_puts_back_exactly_what_was_there(world):
    modules = (world.defining, world.user, world.plain, world.unrelated, world.ours)
    before = snapshot(*modules)
    rebinding = Rebinding("rebindtest_def", "Thing", Replacement, scan_prefixes=PREFIXES)
    rebinding.apply()
    assert snapshot(*modules) != before
    rebinding.restore()
    after = snapshot(*modules)
    assert after.keys() == before.keys()
    for name in before:
        assert after[name].keys() == before[name].keys()
        for attr, value in before[name].items():
            assert after[name][attr] is value, f"{name}.{attr}"
    assert rebinding.sites == []


def test_restore_twice_is_harmless(world):
    rebinding = Rebinding("rebindtest_def", "Thing", Replacement, scan_prefixes=PREFIXES)
    rebinding.apply()
    rebinding.restore()
    rebinding.restore()
    assert world.defining.Thing is Original and world.user.Alias is Original


def test_restore_does_not_clobber_a_third_party_in_the_defining_module(world):
    rebinding = Rebinding("rebindtest_def", "Thing", Replacement, scan_prefixes=PREFIXES)
    rebinding.apply()
    world.defining.Thing = ThirdParty  # someone else patched after us
    rebinding.restore()
    assert world.defining.Thing is ThirdParty
    # everywhere our replacement still stood, the original is back
    assert world.user.Thing is Original
    assert world.user.Alias is Original
    assert world.plain.Thing is Original


def test_restore_does_not_clobber_a_third_party_in_an_importing_module(world):
    rebinding = Rebinding("rebindtest_def", "Thing", Replacement, scan_prefixes=PREFIXES)
    rebinding.apply()
    world.user.Alias = ThirdParty
    rebinding.restore()
    assert world.user.Alias is ThirdParty
    assert world.user.Thing is Original
    assert world.defining.Thing is Original


def test_restore_reaches_a_module_imported_after_apply(world, make_module):
    rebinding = Rebinding("rebindtest_def", "Thing", Replacement, scan_prefixes=PREFIXES)
    rebinding.apply()
    # a module imported later reads the defining module, which holds the replacement ...
    late = make_module("rebindtest_late", Thing=world.defining.Thing)
    assert late.Thing is Replacement
    rebinding.restore()
    # ... and restore only promised the sites it replaced plus the defining module
    assert world.defining.Thing is Original
    assert late.Thing is Replacement


def test_default_prefix_scans_only_fastdeploy(world):
    # with the default prefixes ('fastdeploy',), our test modules are not scanned: only the name is matched
    rebinding = Rebinding("rebindtest_def", "Thing", Replacement)
    assert rebinding.scan_prefixes == ("fastdeploy",)
    sites = rebinding.apply()
    try:
        assert world.user.Thing is Replacement
        assert world.user.Alias is Original
        assert "rebindtest_user.Alias" not in sites
    finally:
        rebinding.restore()
    assert world.user.Thing is Original


def test_missing_defining_module_or_name_fails_early(world):
    with pytest.raises(KeyError):
        Rebinding("rebindtest_absent", "Thing", Replacement, scan_prefixes=PREFIXES)
    with pytest.raises(AttributeError):
        Rebinding("rebindtest_def", "NoSuchName", Replacement, scan_prefixes=PREFIXES)
