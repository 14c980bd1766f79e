"""The host's own methods as the last layer of a fixed class's seams (:mod:`fdsched.patches._scheduler`,
:mod:`fdsched.patches._prefix_cache`, :mod:`fdsched.patches._cache_queue`), and a seam the host lacks."""

from __future__ import annotations

__all__ = ["HostCode", "host_method", "Absent", "hide_absent"]


def _no_attribute(host_cls, name: str) -> AttributeError:
    """The error an object of ``host_cls`` raises for a method it does not have."""
    return AttributeError(f"'{host_cls.__name__}' object has no attribute '{name}'")


def host_method(host_cls, name: str):
    """``host_cls``'s own function ``name`` (called as ``function(host_object, *args)``), or, where the host has none,
    one that raises the AttributeError an object of the host class would raise."""
    function = getattr(host_cls, name, None)
    if callable(function):
        return function

    def missing(*args, **kwargs):
        raise _no_attribute(host_cls, name)

    return missing


class HostCode:
    """The last layer of every seam in ``seams``: the host's own method, as :func:`host_method` gives it."""

    def __init__(self, host_cls, seams):
        for name in seams:
            setattr(self, name, host_method(host_cls, name))


class Absent:
    """A fixed class's seam the host class does not have: reading it raises the AttributeError an object of the host
    class would raise, so ``hasattr`` and ``getattr(obj, name, default)`` answer as on the host's own object."""

    def __init__(self, host_cls, name: str) -> None:
        self.host_cls, self.name = host_cls, name

    def __get__(self, obj, owner=None):
        raise _no_attribute(self.host_cls, self.name)


def hide_absent(cls, host_cls, seams) -> None:
    """Put :class:`Absent` on ``cls`` (a fixed class over ``host_cls``) for every seam ``host_cls`` lacks."""
    for name in seams:
        if not callable(getattr(host_cls, name, None)):
            setattr(cls, name, Absent(host_cls, name))
