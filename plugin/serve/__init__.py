"""The served engine on CPU: FastDeploy's real serving stack with the plugin loaded and a simulated GPU worker,
and load over HTTP from a trace.

:mod:`.seams` (what is replaced and why, applied in every process through an import hook), :mod:`.worker`
(the simulated worker), :mod:`.model` (a tiny model directory), :mod:`.launcher` (``fdsched serve`` and
:class:`~.launcher.ServedEngine`); :mod:`.load` (``fdsched load``: a trace against running servers),
:mod:`.served_report`, :mod:`.compare` (``fdsched load-vs-replay``). See docs/engine.md and docs/load.md.
"""
