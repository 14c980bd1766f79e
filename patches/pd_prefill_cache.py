"""Change 4 — PD disaggregation: prefill nodes record their blocks in the radix tree.

Replaces:  ResourceManagerV1.preallocate_resource_in_p, the running-prefill cache update for the prefill role
Why:       with splitwise_role == "prefill" the host did not record a request's blocks into the radix
           tree, so the prefix hit rate on prefill nodes was low.
Upstream:  PR 7364, 2.6 cherry-pick 7387 (merged; in the "new host" d38eeb8).
Needs it:  2.6 before 7387 (old host e7c8dc2); the safe mode is for every host.
Switch:    FDSCHED_PD_PREFILL_CACHE = auto | on | off, FDSCHED_PD_PREFILL_CACHE_MODE = safe | upstream.
Delete:    when every supported host records only computed blocks at preallocation.
"""

from __future__ import annotations

from . import PatchSpec
from ._base import PluginBase


class PdPrefillCacheMixin(PluginBase):
    """Placeholder until the recording paths land: the probe reports it as unavailable."""


def _not_yet(info):
    return "not implemented in this plugin version yet"


def _has_pd_record(info) -> bool:
    from fdsched.host import code_names

    return "update_cache_blocks" in code_names(info.rm_class.preallocate_resource_in_p)


SPEC = PatchSpec(
    change_id="pd_prefill_cache",
    title="PD prefill-node prefix-cache recording",
    upstream_prs=(7364, 7387),
    upstream_state="merged",
    target="ResourceManagerV1",
    replaces=(),
    requires={"preallocate_resource_in_p": ("request",)},
    why="Prefill nodes did not record blocks in the radix tree, so their prefix hit rate was low.",
    how="upstream: record the whole prompt at preallocation; safe: record computed blocks, the rest after the prefill.",
    hosts_needing="2.6 before PR 7387 (old host e7c8dc2); safe mode on every host",
    switch="FDSCHED_PD_PREFILL_CACHE",
    delete_when="every supported host records only computed blocks at preallocation",
    mixin=PdPrefillCacheMixin,
    host_has=_has_pd_record,
    extra_check=_not_yet,
)
