"""The plugin's ``PrefixCacheManager``: one class over the host's, whose seams hand each call to the strategies the
instance chose when it was built.

:class:`PrefixCache` is the whole class as it runs; :func:`over` puts it over the probed host class with one class
statement, with the install's table as class attributes: per data-parallel rank, the arm and one strategy class (or
None: the host's own code) per change, read from each change's ``SPEC.strategies`` (change × decision × host shape ×
settings) when the plugin was installed. ``__init__`` reads the instance's rank from the constructor's arguments,
as the scheduler's does, and builds that arm's strategies once, each over the next layer (``next``), which ends in
the host's own methods (:class:`fdsched.patches._host_code.HostCode`):

=============================  ===========================================================  ===========================
seam                           layers, outermost first                                      change
=============================  ===========================================================  ===========================
``update_cache_blocks``        the record fix, then the prefill node's gate, then the host  one_node_per_block, then
                                                                                            pd_prefill_cache
``can_allocate_gpu_blocks``    a running chunk's refusal (guard, off), then the host        ratio_reserve
eviction and recycling (4)     the batched eviction, then the host                          deferred_recycle
=============================  ===========================================================  ===========================

The record fix comes first so that the gate decides on (and the host builds from) the corrected count; the gate's
own records at finish (``fdsched_gate.record_blocks``) go to the host directly, which no fix changes.

What the scheduler reads here: ``fdsched_gate`` (the PD change's marks and its own records) and ``fdsched_plans``
(the slot of the scheduler's plan, handed over when the scheduler is built).
"""

from __future__ import annotations

from functools import partial

from fdsched.patches._base import HOST_INIT_RUNNING, QueueOwner, take_arm
from fdsched.patches._host_code import HostCode, hide_absent
from fdsched.patches._scheduler import NO_PLANS, defined_by

__all__ = ["PrefixCache", "over"]


SEAMS = ("update_cache_blocks", "can_allocate_gpu_blocks", "free_block_ids_async", "free_nodes_directly",
         "recycle_gpu_blocks", "_handle_free_gpu_node_without_cpu")


class PrefixCache:
    """Seams of the plugin's ``PrefixCacheManager`` (its class attributes come from :func:`over`)."""

    _fdsched_host_class: type  # the probed host class, the next class in the MRO
    _fdsched_rows: dict  # data-parallel rank (None: every rank not listed) -> (Arm, {change id: strategy or None})
    _fdsched_arms: dict  # data-parallel rank -> Arm (FDSCHED_PROFILE_BY_DP_RANK); empty for a single profile
    _fdsched_init_signature: object  # the host's __init__ signature (where the rank is read)

    fdsched_plans = NO_PLANS  # until a plugin scheduler built with this cache manager hands over its slot
    cache_task_queue = QueueOwner("cache_task_queue")  # in an online A/B, the client it stores takes its arm

    def __init__(self, *args, **kwargs):
        if self.__dict__.get(HOST_INIT_RUNNING):  # the host's own super(HostName, self).__init__: past the host
            super(self._fdsched_host_class, self).__init__(*args, **kwargs)
            return
        _, arm, row = take_arm(self, args, kwargs)
        host = HostCode(self._fdsched_host_class, SEAMS)
        # the host's own code while the host builds the object
        self._fdsched_recycle = self._fdsched_check = self._fdsched_recording = self.fdsched_gate = host
        self._fdsched_bind_seams(host)
        self.__dict__[HOST_INIT_RUNNING] = True
        try:
            super().__init__(*args, **kwargs)
        finally:
            del self.__dict__[HOST_INIT_RUNNING]

        def layer(change_id, next):
            strategy = row.get(change_id)
            return next if strategy is None else strategy(self, arm.settings, next)

        self._fdsched_recycle = layer("deferred_recycle", host)
        self._fdsched_check = layer("ratio_reserve", host)
        self.fdsched_gate = gate = layer("pd_prefill_cache", host)
        # a gate that lets every record through here (not a prefill node) is left out of the recording chain
        self._fdsched_recording = layer("one_node_per_block", host if getattr(gate, "passes_all", False) else gate)
        self._fdsched_bind_seams(host)

    def _fdsched_bind_seams(self, host) -> None:
        """Each seam's first layer, bound once: on the instance itself where no class below this one overrides the
        seam (a call then costs that layer's frame only, as the scheduler's seams do), and where the class's seam
        method finds it (a class another plugin derives from this one wraps every layer)."""
        first = {"update_cache_blocks": self._fdsched_recording, "can_allocate_gpu_blocks": self._fdsched_check}
        own = self.__dict__
        for name in SEAMS:
            layer = first.get(name, self._fdsched_recycle)
            method = getattr(layer, name)
            own[f"_fdsched_{name.lstrip('_')}"] = method
            if defined_by(type(self), name) is not PrefixCache:
                continue  # a class over this one overrides it (or marks it absent: the host lacks it): that runs
            own[name] = method.__get__(self) if layer is host else partial(method, self)

    def update_cache_blocks(self, *args, **kwargs):
        return self._fdsched_update_cache_blocks(self, *args, **kwargs)

    def can_allocate_gpu_blocks(self, *args, **kwargs):
        return self._fdsched_can_allocate_gpu_blocks(self, *args, **kwargs)

    def free_block_ids_async(self, *args, **kwargs):
        return self._fdsched_free_block_ids_async(self, *args, **kwargs)

    def free_nodes_directly(self, *args, **kwargs):
        return self._fdsched_free_nodes_directly(self, *args, **kwargs)

    def recycle_gpu_blocks(self, *args, **kwargs):
        return self._fdsched_recycle_gpu_blocks(self, *args, **kwargs)

    def _handle_free_gpu_node_without_cpu(self, *args, **kwargs):
        return self._fdsched_handle_free_gpu_node_without_cpu(self, *args, **kwargs)


def over(host_cls: type, rows: dict, attributes: dict) -> type:
    """The plugin's class over ``host_cls`` (what the host module's ``PrefixCacheManager`` is rebound to);
    ``attributes``: the install's other class attributes (arms, the single profile's decisions and settings)."""
    from fdsched.patches._base import init_signature

    class PrefixCacheManager(PrefixCache, host_cls):
        __doc__ = f"fdsched's PrefixCacheManager over {host_cls.__module__}.{host_cls.__qualname__}: see PrefixCache."
        __qualname__ = "PrefixCacheManager"
        _fdsched_host_class = host_cls
        _fdsched_rows = rows
        _fdsched_init_signature = init_signature(host_cls)

    for name, value in attributes.items():
        setattr(PrefixCacheManager, name, value)
    hide_absent(PrefixCacheManager, host_cls, SEAMS)  # a seam this host lacks stays missing
    return PrefixCacheManager
