"""The entry point FastDeploy calls (group ``fastdeploy.model_register_plugins``, name ``fdsched``).

FastDeploy's loader runs it in every process that imports ``fastdeploy.model_executor.models``
(building a ``ModelConfig`` does), but only when ``FD_PLUGINS`` lists ``fdsched``. With ``FD_PLUGINS``
unset, FastDeploy loads no plugin at all.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Read the settings, install what they select, log one line through the host's logger.

    A second call in the same process changes nothing. Bad settings, or a change switched ``on``
    that the host cannot take, raise before anything is patched; FastDeploy's loader does not catch
    the error, so the engine does not start half-configured.
    """
    from fastdeploy.utils import llm_logger

    from .installer import current, install

    first = current() is None
    report = install()
    if first:
        for decision in report.decisions.values():
            if decision.state == "skipped":
                llm_logger.warning(f"[fdsched] {decision.change_id} {decision.detail}")
        for rank, arm in sorted((report.arms or {}).items()):
            for decision in arm.decisions.values():
                if decision.state == "skipped":
                    llm_logger.warning(f"[fdsched] data-parallel rank {rank} (arm {arm.label}): {decision.change_id} {decision.detail}")
        llm_logger.info("[fdsched] " + report.summary())
        if report.settings["replay.oracle_reserve"]:
            llm_logger.warning(
                f"[fdsched] profile {report.settings.profile or '?'} sets replay.oracle_reserve: true, which only the "
                "replay uses (it admits by each request's true output length, known only from a trace); an engine "
                "runs it as its other settings say, and it is not meant for production: use recommended instead"
            )
        method = start_method()
        if method != "fork":
            llm_logger.warning(
                f"[fdsched] multiprocessing start method is {method!r}: engine child processes (data-parallel "
                "services, AsyncLLM's engine process) do not inherit the plugin and run the host's classes unless "
                "they load FastDeploy plugins themselves; use the 'fork' start method with this plugin"
            )


def start_method() -> str:
    """The start method ``multiprocessing.Process`` will use in this process (the host's children use the default)."""
    import multiprocessing

    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_context().get_start_method()
