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
    the error, so the engine does not start half-configured. The error is logged as one line and
    raised so that the process ends with that line, not a traceback (see :func:`_start_error`).
    """
    from fastdeploy.utils import llm_logger

    from fdsched.install.installer import InstallError, current, install
    from fdsched.core.settings import SettingsError

    first = current() is None
    try:
        report = install()
    except (SettingsError, InstallError) as exc:
        message = f"[fdsched] the engine does not start: {exc} (FD_PLUGINS=fdsched; check the settings with: fdsched doctor)"
        llm_logger.error(message)  # the engine's log file has it too
        raise _start_error(exc, message) from None
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
