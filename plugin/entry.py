"""The entry point FastDeploy calls (group ``fastdeploy.model_register_plugins``, name ``fdsched``).

FastDeploy's loader runs it in every process that imports ``fastdeploy.model_executor.models``
(building a ``ModelConfig`` does). From 2.4 on the loader calls it only when ``FD_PLUGINS`` lists
``fdsched``; older loaders (2.2, 2.3) call every installed plugin of the group when ``FD_PLUGINS`` is
unset. So the entry point asks itself: it does nothing unless ``FD_PLUGINS`` names ``fdsched``.
"""

from __future__ import annotations

import logging
import os

__all__ = ["register", "asked_for"]

PLUGIN_NAME = "fdsched"


def asked_for(environ=None) -> bool:
    """Whether the operator listed the plugin: ``FD_PLUGINS`` (comma-separated, as FastDeploy splits it) names it."""
    value = (os.environ if environ is None else environ).get("FD_PLUGINS")
    return value is not None and PLUGIN_NAME in [name.strip() for name in value.split(",")]


def _logger():
    try:
        from fastdeploy.utils import llm_logger

        return llm_logger
    except Exception:  # noqa: BLE001 - a host without it still gets our lines
        return logging.getLogger("fdsched")


def register() -> None:
    """Read the settings, install what they select, log one line through the host's logger.

    Nothing happens unless ``FD_PLUGINS`` names ``fdsched`` (:func:`asked_for`). A second call in the same
    process changes nothing. Bad settings, or a change switched ``on``/``off`` that the host cannot take, raise
    before anything is patched; FastDeploy's loader does not catch the error, so the engine does not start
    half-configured. The error is logged as one line and raised so that the process ends with that line, not a
    traceback (see :func:`_start_error`). Anything else that goes wrong here (a host the plugin cannot read)
    is logged as one error line and nothing is patched: the engine runs FastDeploy's own classes.
    """
    if not asked_for():
        return
    logger = _logger()
    try:
        from fdsched.core.settings import SettingsError
        from fdsched.install.installer import InstallError, current, install
        from fdsched.install.probe import HostNotFound
    except Exception as exc:  # noqa: BLE001 - a broken install of the plugin must not take the engine down
        logger.error(f"[fdsched] not installed: the plugin does not import ({type(exc).__name__}: {exc}); "
                     "the engine runs FastDeploy's own scheduler")
        return
    first = current() is None
    try:
        report = install()
    except (SettingsError, InstallError) as exc:
        message = f"[fdsched] the engine does not start: {exc} (FD_PLUGINS=fdsched; check the settings with: fdsched doctor)"
        logger.error(message)  # the engine's log file has it too
        raise _start_error(exc, message) from None
    except HostNotFound as exc:
        logger.error(f"[fdsched] not installed: {exc}; the engine runs FastDeploy's own scheduler")
        return
    except Exception as exc:  # noqa: BLE001 - nothing was patched (install restores on failure): say so, go on
        logger.error(f"[fdsched] not installed: {type(exc).__name__}: {exc}; nothing was patched, the engine runs "
                     "FastDeploy's own scheduler (please report this with the output of: fdsched doctor)")
        return
    if first:
        _log_install(logger, report)


def _log_install(logger, report) -> None:
    for decision in report.decisions.values():
        if decision.state == "skipped":
            logger.warning(f"[fdsched] {decision.change_id} {decision.detail}")
    for rank, arm in sorted((report.arms or {}).items()):
        for decision in arm.decisions.values():
            if decision.state == "skipped":
                logger.warning(f"[fdsched] data-parallel rank {rank} (arm {arm.label}): {decision.change_id} {decision.detail}")
    logger.info("[fdsched] " + report.summary())
    if report.settings["replay.oracle_reserve"]:
        logger.warning(
            f"[fdsched] profile {report.settings.profile or '?'} sets replay.oracle_reserve: true, which only the "
            "replay uses (it admits by each request's true output length, known only from a trace); an engine "
            "runs it as its other settings say, and it is not meant for production: use recommended instead"
        )
    method = start_method()
    if method != "fork":
        logger.warning(
            f"[fdsched] multiprocessing start method is {method!r}: engine child processes (data-parallel "
            "services, AsyncLLM's engine process) do not inherit the plugin and run the host's classes unless "
            "they load FastDeploy plugins themselves; use the 'fork' start method with this plugin"
        )


def _start_error(exc: Exception, message: str) -> BaseException:
    """``exc`` as an error that is still its own class (callers and tests catch ``SettingsError`` /
    ``InstallError`` as before) and also a ``SystemExit`` carrying ``message``.

    FastDeploy's loader calls the entry point without a ``try`` (``fastdeploy/plugins/model_register``: it
    only guards loading the entry point, not calling it), so the error travels up through the import of
    the model package. An ordinary exception ends the process with a 20-line traceback whose last line is
    the message; a ``SystemExit`` that reaches the top makes Python print just its message and exit 1: the
    operator sees one line. Code that catches ``Exception`` still catches it (it is a ``SettingsError``).
    """
    cls = _START_ERRORS.get(type(exc))
    if cls is None:
        cls = type(type(exc).__name__, (type(exc), SystemExit), {"__module__": type(exc).__module__})
        _START_ERRORS[type(exc)] = cls
    error = cls(str(exc))
    error.code = message
    return error


_START_ERRORS: dict = {}


def start_method() -> str:
    """The start method ``multiprocessing.Process`` will use in this process (the host's children use the default)."""
    import multiprocessing

    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_context().get_start_method()
