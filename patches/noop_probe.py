"""Change 6 — THROWAWAY: count the requests handed to the scheduler (proves CONTRIBUTING.md's steps).

Replaces:  ResourceManagerV1.add_request (counts the call, then runs the host's own)
Why:       none; a probe for the newcomer's check of issue 17, dropped after the walk.
Upstream:  PR 1 (closed); a placeholder number.
Needs it:  no host.
Switch:    FDSCHED_NOOP_PROBE / changes.noop_probe = auto | on | off.
Delete:    right after the walk.
Relies on: (probed at install: ``on`` fails naming it; ``auto`` skips)
  * add-request-queues: ``ResourceManagerV1.add_request`` puts the request on ``self.waiting``.
"""

from __future__ import annotations

from fdsched.patches._base import PluginBase, code_names
from fdsched.patches._spec import PatchSpec, Reliance


class NoopProbeMixin(PluginBase):
    """Counts ``add_request`` calls in ``fdsched_added``; the host's code does the rest."""

    def add_request(self, request):
        self.__dict__["fdsched_added"] = self.__dict__.get("fdsched_added", 0) + 1
        return super().add_request(request)


def _queues_waiting(info):
    if "waiting" not in code_names(info.host_classes["ResourceManagerV1"].add_request):
        return "ResourceManagerV1.add_request no longer puts the request on self.waiting"
    return None


SPEC = PatchSpec(
    change_id="noop_probe",
    title="Throwaway probe: count add_request calls",
    upstream_prs=(1,),
    upstream_state="closed",
    replaces=("ResourceManagerV1.add_request",),
    requires={"ResourceManagerV1.add_request": ("request",)},
    why="None: it proves the steps of CONTRIBUTING.md.",
    how="Counts each add_request call, then calls the host's.",
    hosts_needing="none",
    switch="FDSCHED_NOOP_PROBE",
    delete_when="right after the walk",
    mixins={"ResourceManagerV1": NoopProbeMixin},
    host_has=lambda info: False,
    relies_on=(Reliance("add-request-queues", "ResourceManagerV1.add_request puts the request on self.waiting",
                        _queues_waiting),),
)
