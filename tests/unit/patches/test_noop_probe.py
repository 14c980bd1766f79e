"""noop_probe (THROWAWAY): the plugin arm counts add_request calls and runs the host's; the host arm does not count."""

from __future__ import annotations

import types

from fdsched.core.settings import CHANGE_IDS, load_settings
from fdsched.install.installer import Decision, _build
from fdsched.patches import TARGETS, spec_for


class FakeHost:
    def __init__(self, config=None, local_data_parallel_id=0):
        self.waiting = []

    def add_request(self, request):
        self.waiting.append(request)


def _scheduler(impl: str):
    targets = {t: type(t, (FakeHost,), {}) for t in TARGETS}
    info = types.SimpleNamespace(host_classes=targets, has={}, problems={})
    decisions = {cid: Decision(cid, "off", "host", "off", "off") for cid in CHANGE_IDS}
    decisions["noop_probe"] = Decision("noop_probe", "on", impl, "applied", "applied")
    return _build(info, load_settings(environ={}, profile="baseline"), decisions, policies=None)["ResourceManagerV1"]()


def test_the_plugin_arm_counts_and_still_queues():
    scheduler = _scheduler("plugin")
    scheduler.add_request("a")
    scheduler.add_request("b")
    assert scheduler.fdsched_added == 2
    assert scheduler.waiting == ["a", "b"]


def test_the_host_arm_does_not_count():
    scheduler = _scheduler("host")
    scheduler.add_request("a")
    assert "fdsched_added" not in scheduler.__dict__
    assert scheduler.waiting == ["a"]


def test_the_reliance_names_a_host_that_does_not_queue():
    class Elsewhere(FakeHost):
        def add_request(self, request):
            return request

    spec = spec_for("noop_probe")
    good = types.SimpleNamespace(host_classes={"ResourceManagerV1": FakeHost})
    bad = types.SimpleNamespace(host_classes={"ResourceManagerV1": Elsewhere})
    assert spec.check_reliances(good) == {}
    assert "self.waiting" in spec.check_reliances(bad)["add-request-queues"]
