"""``fdsched bench schedule`` on the real host classes, small: what it returns holds together (the bench prints
numbers and asserts nothing; this checks its bookkeeping, not its speed)."""

from __future__ import annotations


def test_schedule_bench_keeps_each_steps_least_time_and_the_admitting_steps():
    from fdsched.tools.bench import bench_schedule, minima_ratios

    steps = 12
    result = bench_schedule(running=8, waiting=4, steps=steps, repeat=2, block_size=64, profile="adaptive",
                            gc_modes=("off",))
    assert set(result) == {("host", "off"), ("plugin", "off")}
    for figures in result.values():
        assert len(figures["minima"]) == steps and all(t > 0 for t in figures["minima"])
        assert min(figures["minima"]) <= figures["median"] <= max(figures["minima"]) * 1e3
        # the waiting requests' long prompts are admitted in chunks within the first steps
        assert figures["admitting"] and figures["admitting"] <= set(range(steps))
        assert figures["collections"] == [0.0, 0.0, 0.0]  # the collector held off while timed: none ran
    ratios = minima_ratios(result[("host", "off")], result[("plugin", "off")])
    assert ratios["all"] > 0 and ratios["admitting"] > 0 and ratios["admitting_steps"] >= 1


def test_a_null_schedule_bench_times_the_hosts_class_in_both_arms(monkeypatch):
    from fdsched.tools import bench

    installed = []
    real = bench.install_arm

    def recording(profile):
        installed.append(profile)
        return real(profile)

    monkeypatch.setattr(bench, "install_arm", recording)
    steps = 10
    result = bench.bench_schedule(running=8, waiting=4, steps=steps, repeat=2, block_size=64, profile="host",
                                  gc_modes=("off",))
    assert installed and set(installed) == {None}  # every run of either arm had the host's own class
    host, second = result[("host", "off")], result[("plugin", "off")]
    assert host["admitting"] and host["admitting"] == second["admitting"]  # the same class: the same steps admit
    assert len(second["minima"]) == steps and all(t > 0 for t in second["minima"])


def test_the_spread_workload_has_its_own_budgets_and_a_learned_estimator_and_nothing_ends_while_timed():
    from fdsched.tools.bench import scheduler_for
    from fdsched.tools.benchcommon import install_arm as _install

    try:
        for workload in ("spread", "uniform"):
            with scheduler_for("adaptive", 64, 2, 64, workload) as (rm, driver):
                budgets = {r.request_id: r.sampling_params.max_tokens for r in rm.running}
                learned = rm.fdsched_strategy("ratio_reserve").adaptive.state()
                for _ in range(200):  # the bench's default steps
                    driver.step()
                running = {r.request_id for r in rm.running}
            assert set(budgets) <= running  # none ended
            values = set(budgets.values())
            if workload == "uniform":
                assert values == {512} and learned["finished_seen"] == 0
            else:
                assert None in values and len(values - {None}) == 48 and min(values - {None}) >= 256
                # both kinds learned from the requests that finished before
                assert learned["absolute_tokens"]["learned"] and learned["relative_to_max_tokens"]["learned"]
    finally:
        _install(None)


def test_a_sweep_group_times_every_arm_in_a_process_of_its_own_against_the_first():
    import fastdeploy.engine.sched.resource_manager_v1 as host_module

    from fdsched.tools.bench import minima_ratios, run_arm_groups
    from fdsched.tools.benchsweep import sweep_arms

    before = host_module.ResourceManagerV1
    steps = 6
    arms = sweep_arms(["recommended", "baseline"])
    result = run_arm_groups(1, arms, (4, 2, steps, 64, "spread"), repeat=2, gc_modes=("off",), heap_objects=0)
    assert set(result) == {(arm, "off") for arm in arms}
    assert host_module.ResourceManagerV1 is before
    assert "groups" not in result[("host", "off")]  # the reference has no ratio against itself
    for arm in ("null", "recommended", "baseline"):
        figures = result[(arm, "off")]
        assert len(figures["minima"]) == steps and all(t > 0 for t in figures["minima"])
        (group,) = figures["groups"]  # one group: its own ratio is the whole result's
        assert group == minima_ratios(result[("host", "off")], figures)["all"]
    assert result[("null", "off")]["admitting"] == result[("host", "off")]["admitting"]  # the same class, same steps
