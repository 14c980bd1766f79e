"""How the served stack's processes get the seams: the sitecustomize the launcher writes loads the seams package by
its path, with every seam family, and nothing of fdsched. No host."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from fdsched.serve import seams


def test_the_sitecustomize_loads_every_seam_family_and_nothing_of_fdsched(tmp_path):
    seams.write_sitecustomize(str(tmp_path))
    code = ("import json, sys; m = sys.modules['_fdsched_serve_seams']; "
            "print(json.dumps({'modules': sorted(n for n in sys.modules if 'seams' in n or n.startswith('fdsched')), "
            "'hooked': sorted(m._AFTER_LOAD), 'finder': type(sys.meta_path[0]).__name__}))")
    env = dict(os.environ, PYTHONPATH=str(tmp_path), **{seams.ENABLE_ENV: "1"})
    env.pop(seams.STATE_ENV, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    families = ("drain", "engine", "env", "hostcode", "ledger")
    assert found["modules"] == ["_fdsched_serve_seams"] + [f"_fdsched_serve_seams.{f}" for f in families]
    assert found["finder"] == "_SeamFinder"
    assert {"fastdeploy.engine.engine", "fastdeploy.config", "zmq", "fastapi.applications"} <= set(found["hooked"])


def test_without_the_switch_the_sitecustomize_does_nothing(tmp_path):
    seams.write_sitecustomize(str(tmp_path))
    code = "import sys; print(sorted(n for n in sys.modules if 'seams' in n))"
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    env.pop(seams.ENABLE_ENV, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
