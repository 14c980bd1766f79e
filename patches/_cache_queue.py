"""The plugin's ``EngineCacheQueue``: one class over the host's, whose seams hand each call to the strategy the
instance chose when it was built.

:class:`CacheQueue` is the whole class as it runs (its seams: ``__init__``, ``get_transfer_done_signal`` and the
server's done lists); :func:`over` puts it over the probed host class with one class statement and the install's
context as class attributes. What an instance does is chosen once, in ``__init__``, from the catalogue's strategy
table (:data:`fdsched.patches.nonpolling_transfer.RECEIVERS`: the arm's decision for the change -> the receiver,
built from the arm's settings): no class per arm.

The queue is built without a data-parallel rank (the engine's server serves every rank; each cache manager builds a
client with rank 0), so a client starts with the single profile's receiver, and the cache manager that stores it
hands it that manager's arm (:meth:`CacheQueue.fdsched_serve`, called by :class:`fdsched.patches._base.QueueOwner`).
The server's lists can wait when any arm's receiver waits: a waitable list behaves as a plain one for a polling
receiver.
"""

from __future__ import annotations

from fdsched.patches._host_code import host_method
from fdsched.patches.nonpolling_transfer import WaitableDoneLists, receiver_for

__all__ = ["CacheQueue", "over"]


class CacheQueue:
    """Seams of the plugin's ``EngineCacheQueue`` (its class attributes come from :func:`over`)."""

    _fdsched_host_class: type  # the probed host class, the next class in the MRO
    _fdsched_impl: dict  # change id -> impl: the single profile's decisions (a client's start)
    _fdsched_settings: object  # the single profile's settings
    _fdsched_serves_waiting: bool  # some arm's receiver waits: the server's done lists can wait

    tansfer_done_queue_init = WaitableDoneLists()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fdsched_receiver = self._fdsched_receiver_for(self._fdsched_impl, self._fdsched_settings)

    def get_transfer_done_signal(self, *args, **kwargs):
        return self._fdsched_receiver.get_transfer_done_signal(self, *args, **kwargs)

    def fdsched_serve(self, impl, settings) -> None:
        """Told by the cache manager that stores this client, in an online A/B: that manager's arm's decisions and
        settings choose the receiver."""
        self._fdsched_receiver = self._fdsched_receiver_for(impl, settings)

    def _fdsched_receiver_for(self, impl: dict, settings):
        host_take = host_method(self._fdsched_host_class, "get_transfer_done_signal")
        return receiver_for(self, impl["nonpolling_transfer"], settings, host_take)


def over(host_cls: type, impl: dict, settings, serves_waiting: bool) -> type:
    """The plugin's class over ``host_cls`` (what the host module's ``EngineCacheQueue`` is rebound to)."""

    class EngineCacheQueue(CacheQueue, host_cls):
        __doc__ = f"fdsched's EngineCacheQueue over {host_cls.__module__}.{host_cls.__qualname__}: see CacheQueue."
        __qualname__ = "EngineCacheQueue"
        _fdsched_host_class = host_cls
        _fdsched_impl = dict(impl)
        _fdsched_settings = settings
        _fdsched_serves_waiting = serves_waiting

    return EngineCacheQueue
