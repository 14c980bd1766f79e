"""The served engine on CPU: FastDeploy's real serving stack with the plugin loaded and a simulated GPU worker.

:mod:`.seams` (what is replaced and why, applied in every process through an import hook), :mod:`.worker`
(the simulated worker), :mod:`.model` (a tiny model directory), :mod:`.launcher` (``fdsched serve`` and
:class:`~.launcher.ServedEngine`). See docs/engine.md.
"""
