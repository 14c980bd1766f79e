"""fdsched.cmdline.quiet: the host's chatter (print, stderr, C-level writes, logging, warnings) goes to a log file; the
progress bar's stream still reaches the terminal; -v (verbose) redirects nothing."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import logging, os, sys, warnings
    from fdsched.cmdline.quiet import host_output_to, log_note

    handler = logging.StreamHandler(sys.stderr)          # built before, as the host builds its loggers
    logger = logging.getLogger("host"); logger.addHandler(handler); logger.setLevel(logging.INFO)
    print("before")
    with host_output_to(sys.argv[1] if sys.argv[1] != "-" else None, verbose=sys.argv[2] == "1") as log:
        print("chatter: print")
        sys.stderr.write("chatter: stderr\\n")
        os.write(2, b"chatter: fd 2\\n")
        os.write(1, b"chatter: fd 1\\n")
        logger.warning("chatter: logging")
        warnings.warn("chatter: warning")
        log.terminal.write("BAR 1/2\\n"); log.terminal.flush()
    print("after")
    logger.warning("a log line after the block")
    print(log_note(log))
    """
)


def _run(tmp_path, verbose: bool):
    log = tmp_path / "out" / "host.log"
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(log), "1" if verbose else "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result, log


def test_host_output_goes_to_the_log_and_the_bar_to_the_terminal(tmp_path):
    result, log = _run(tmp_path, verbose=False)
    assert "chatter:" not in result.stdout + result.stderr
    assert "BAR 1/2" in result.stderr
    assert result.stdout.splitlines()[:2] == ["before", "after"]
    assert "a log line after the block" in result.stderr  # descriptors restored
    text = log.read_text()
    for what in ("print", "stderr", "fd 2", "fd 1", "logging", "warning"):
        assert f"chatter: {what}" in text, what
    assert f"{log}" in result.stdout and "-v shows them" in result.stdout  # the output names the log


def test_verbose_redirects_nothing(tmp_path):
    result, log = _run(tmp_path, verbose=True)
    assert "chatter: stderr" in result.stderr and "chatter: print" in result.stdout
    assert not log.exists()
