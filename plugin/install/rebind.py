"""Rebinding a class everywhere it was bound at import time, and undoing it exactly.

``from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1`` copies the name into
the importing module, so replacing the attribute on the defining module is not enough. A
:class:`Rebinding` replaces the object in the defining module and in every loaded module that holds
it: every attribute of the host's own modules (``fastdeploy.*``, aliases included) and the same name
in any other module. Modules imported later read the defining module, which already holds the
replacement. :meth:`Rebinding.restore` puts back exactly what it replaced.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

__all__ = ["Rebinding"]


class Rebinding:
    def __init__(self, defining_module: str, name: str, replacement: Any, scan_prefixes: tuple = ("fastdeploy",)):
        self.defining_module = defining_module
        self.name = name
        self.replacement = replacement
        self.scan_prefixes = scan_prefixes
        self.original = getattr(sys.modules[defining_module], name)
        self.sites: list[tuple[ModuleType, str]] = []

    def _holders(self):
        original = self.original
        for module_name, module in list(sys.modules.items()):
            if not isinstance(module, ModuleType) or module_name.startswith("fdsched"):
                continue
            namespace = getattr(module, "__dict__", None)
            if not namespace:
                continue
            if module_name.startswith(self.scan_prefixes):
                for attr, value in list(namespace.items()):
                    if value is original:
                        yield module, attr
            elif namespace.get(self.name) is original:
                yield module, self.name

    def apply(self) -> list[str]:
        """Replace every binding; return the ``module.attr`` sites, defining module first. Idempotent."""
        if self.sites:
            return [f"{module.__name__}.{attr}" for module, attr in self.sites]
        sites = sorted(self._holders(), key=lambda site: (site[0].__name__ != self.defining_module, site[0].__name__))
        for module, attr in sites:
            setattr(module, attr, self.replacement)
        self.sites = sites
        return [f"{module.__name__}.{attr}" for module, attr in sites]

    def restore(self) -> None:
        """Put the original back wherever the replacement still stands (and in the defining module)."""
        for module, attr in self.sites:
            if getattr(module, attr, None) is self.replacement:
                setattr(module, attr, self.original)
        defining = sys.modules.get(self.defining_module)
        if defining is not None and getattr(defining, self.name, None) is self.replacement:
            setattr(defining, self.name, self.original)
        self.sites = []
