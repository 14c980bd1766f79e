"""fastdeploy-sched-plugin: upstream FastDeploy scheduler and prefix-cache changes, switchable.

Import name ``fdsched``. Layers, one direction only: :mod:`fdsched.core.policies` (pure) <-
:mod:`fdsched.patches` (host subclasses) <- :mod:`fdsched.install.installer` (probe, decide, rebind) <-
:mod:`fdsched.entry` / :mod:`fdsched.tools.cli`.
"""

__version__ = "0.1.0"

from fdsched.hookspecs import hookimpl  # noqa: E402  (third parties: ``@fdsched.hookimpl``)

__all__ = ["__version__", "hookimpl"]
