"""A second plugin stacked on ours changes nothing: identical decisions with pass-through subclasses in between.

FastDeploy loads every plugin in ``FD_PLUGINS``, and an operator's platform code may subclass the scheduler too.
Here a "second plugin" subclasses the installed ``ResourceManagerV1`` and ``PrefixCacheManager`` with overrides of
every method the plugin hooks (the catalogue's ``replaces``) that only call ``super()``, rebinds them the way the
plugin itself does, and the same KV-pressure workloads run through the real scheduler (the replay driver) with and
without that layer. Victims and the step they were preempted in, the chunks admitted per step, decode tokens,
finishes and blocks in use must be the same, step for step, under every shipped profile.
"""

from __future__ import annotations

import pytest

from fdsched.core.settings import shipped_profiles

from .workloads import PRESSURE_SHAPE, kv_pressure_requests, run_workload

RM_MODULE = "fastdeploy.engine.sched.resource_manager_v1"
PCM_MODULE = "fastdeploy.cache_manager.prefix_cache_manager"

# Workloads whose pools run short: decode victims, prefill victims and running chunks short of blocks.
WORKLOADS = {
    "pressure": (PRESSURE_SHAPE, dict()),
    "long-prompts": (PRESSURE_SHAPE, dict(prompt=(30, 90), output=(10, 40))),
    "burst": (dict(PRESSURE_SHAPE, max_num_batched_tokens=24), dict(arrival_span=1, count=10, prompt=(30, 60), output=(20, 36), max_tokens=36)),
}


def hooked_methods(target: str) -> list:
    """Every method of ``target`` that some change's strategy serves (the catalogue's ``replaces``)."""
    from fdsched.patches import CATALOGUE

    names = set()
    for spec in CATALOGUE:
        for replaced in spec.replaces:
            owner, method = replaced.split(".", 1)
            if owner == target:
                names.add(method)
    return sorted(names)


def pass_through_subclass(base: type, methods: list) -> type:
    """A subclass of ``base`` whose overrides of ``methods`` only call ``super()`` (a second plugin's layer)."""
    holder = {}

    def forward(name):
        def method(self, *args, **kwargs):
            return getattr(super(holder["cls"], self), name)(*args, **kwargs)

        method.__name__ = name
        return method

    attrs = {name: forward(name) for name in methods if callable(getattr(base, name, None))}
    cls = type(base.__name__, (base,), attrs)
    holder["cls"] = cls
    return cls


def _fingerprint(records):
    return [
        (
            r.step,
            tuple(r.prefill_chunks),  # which requests were admitted / advanced, and by how much
            r.decode_tokens,
            tuple(r.preempted),  # victims with their phase, in this step
            tuple(r.finished),
            r.blocks_used,
            r.running,
            r.waiting,
        )
        for r in records
    ]


def _run(profile, workload, stacked):
    from fdsched.install import installer
    from fdsched.core.metrics import METRICS
    from fdsched.install.rebind import Rebinding
    from fdsched.replay.engine import EngineShape, build_manager, close_manager, logical_clock
    from fdsched.replay.oracle import ORACLE_PLUGIN_NAME, OracleReserve
    from fdsched.core.settings import load_settings

    shape, params = WORKLOADS[workload]
    requests = kv_pressure_requests(**params)
    settings = load_settings(environ={}, profile=profile)
    report = installer.install(settings)
    METRICS.reset()
    oracle = None
    if settings["replay.oracle_reserve"]:
        oracle = OracleReserve({rid: out for _, rid, _, out, _ in requests})
        report.policies.register(oracle, name=ORACLE_PLUGIN_NAME)
    layers, layers_by_target = [], {}
    if stacked:
        for module, target in ((RM_MODULE, "ResourceManagerV1"), (PCM_MODULE, "PrefixCacheManager")):
            cls = pass_through_subclass(report.classes[target], hooked_methods(target))
            layers.append(Rebinding(module, target, cls))
            layers_by_target[target] = cls
    try:
        for layer in layers:
            layer.apply()
        with logical_clock():
            manager = build_manager(EngineShape(**shape))
            try:
                if stacked:  # the second plugin's classes really sit on top of ours: theirs, then our fixed class
                    for obj, target in ((manager, "ResourceManagerV1"), (manager.cache_manager, "PrefixCacheManager")):
                        mro = type(obj).__mro__
                        assert mro[0] is layers_by_target[target] and mro[1] is report.classes[target]
                records = run_workload(manager, requests)
            finally:
                close_manager(manager)
    finally:
        for layer in reversed(layers):
            layer.restore()
        if oracle is not None:
            report.policies.unregister(oracle)
    return _fingerprint(records), METRICS.unconsumed_signals.copy()


@pytest.fixture(scope="module")
def uninstall_after():
    yield
    from fdsched.install import installer

    installer.uninstall()


def test_pass_through_layers_cover_every_hooked_method():
    from fdsched.patches import CATALOGUE
    from fdsched.patches._spec import served_methods

    for target in ("ResourceManagerV1", "PrefixCacheManager"):
        methods = hooked_methods(target)
        assert methods, target
        for spec in CATALOGUE:
            for strategy in spec.classes(target):  # every impl's, variant and shape: the seams they serve
                own = set(served_methods(strategy))
                assert own <= set(methods), (spec.change_id, own - set(methods))


@pytest.mark.parametrize("profile", sorted(shipped_profiles()))
def test_stacked_pass_through_subclasses_change_no_decision(uninstall_after, profile):
    victims = 0
    for workload in sorted(WORKLOADS):
        plain, plain_signals = _run(profile, workload, stacked=False)
        stacked, stacked_signals = _run(profile, workload, stacked=True)
        victims += sum(len(step[3]) for step in plain)
        _assert_same(workload, plain, stacked)
        assert plain_signals == stacked_signals == {}, "every one-shot signal was consumed by the check it was for"
    assert victims > 0, "the workloads must preempt"


def _assert_same(workload, plain, stacked):
    first_difference = next((i for i, (a, b) in enumerate(zip(plain, stacked)) if a != b), None)
    assert first_difference is None and len(plain) == len(stacked), (
        f"{workload}: decisions differ from step {first_difference}: plain {plain[first_difference:first_difference + 2]} "
        f"stacked {stacked[first_difference:first_difference + 2]}"
        if first_difference is not None
        else f"{workload}: plain drained in {len(plain)} steps, stacked in {len(stacked)}"
    )
