"""What every mixin may use: the runtime choice per change and small views of host requests.

The installer builds each plugin class as ``type(name, (*mixins, PluginBase, HostClass), attrs)``
and sets, as class attributes:

* ``_fdsched_impl``: change id -> ``"host"`` (the host's own code runs), ``"plugin"`` (the plugin's
  version of the change) or ``"legacy"`` (the plugin emulates the pre-change code on a host that
  already has the change);
* ``_fdsched_settings``, ``_fdsched_policies`` (:class:`fdsched.hooks.Policies`), ``_fdsched_host``
  (:class:`fdsched.host.HostInfo`) and ``_fdsched_host_class`` (the class that was replaced).
"""

from __future__ import annotations

import sys

__all__ = ["PluginBase", "host_global"]


def host_global(module_name: str, name: str):
    """A name from a loaded host module's globals (logger, envs, trace helpers)."""
    return getattr(sys.modules[module_name], name)


class PluginBase:
    _fdsched_impl: dict = {}
    _fdsched_settings = None
    _fdsched_policies = None
    _fdsched_host = None
    _fdsched_host_class = None

    # ---- request views -------------------------------------------------------------------
    def _fdsched_is_decoding(self, request) -> bool:
        """The one decode test (victim choice, ratio estimate, metrics), through the hook."""
        host = self._fdsched_host
        status_is_decode = (request.status == host.request_status.RUNNING_DECODE) if host.split_status else None
        return self._fdsched_policies.is_decoding(
            request.request_id, status_is_decode, request.num_total_tokens, request.need_prefill_tokens
        )


class InitGuard:
    """First base of every plugin class: lets the host's explicit ``super(HostName, self)`` work.

    ``ResourceManagerV1.__init__`` calls ``super(ResourceManagerV1, self).__init__``. Once the
    plugin rebinds ``ResourceManagerV1`` in the host module to its subclass, that call resolves to
    the plugin class's MRO and would enter the plugin's ``__init__`` chain again. The re-entry lands
    here (right after the plugin class in the MRO); it continues past the host class instead.
    """

    def __init__(self, *args, **kwargs):
        if self.__dict__.get("_fdsched_constructing"):
            super(self._fdsched_host_class, self).__init__(*args, **kwargs)
            return
        self.__dict__["_fdsched_constructing"] = True
        try:
            super().__init__(*args, **kwargs)
        finally:
            self.__dict__.pop("_fdsched_constructing", None)
