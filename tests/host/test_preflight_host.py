"""doctor's pre-flight read against the real host tree: what its loader does with FD_PLUGINS unset, and the FD_*
names it reads."""

from __future__ import annotations

import os

from fdsched.install.probe import probe
from fdsched.tools.preflight import host_variables, loader_when_unset


def test_the_loader_and_the_variables_are_read_from_the_host_tree():
    info = probe()
    when = loader_when_unset(info.location)
    assert when in ("all", "none")
    if info.commit and info.commit.startswith(("e7c8dc2", "d38eeb8")):  # 2.6: no plugin unless FD_PLUGINS names it
        assert when == "none"
    read = host_variables(info.location)
    assert {"FD_PLUGINS", "FD_LOG_DIR"} <= read
    assert not any(name.startswith("FDSCHED_") for name in read)
    assert os.path.isdir(os.path.join(info.location, "fastdeploy"))
