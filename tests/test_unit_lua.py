"""Runs the pure-Lua unit tests in tests/unit/ with luajit."""

import glob
import os
import subprocess

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
FILES = sorted(glob.glob(os.path.join(ROOT, "tests", "unit", "*.lua")))


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_unit(path):
    env = dict(os.environ)
    env["LUA_PATH"] = "%s/lib/?.lua;%s/tests/unit/?.lua;%s/tests/lua/?.lua;;" \
        % (ROOT, ROOT, ROOT)
    res = subprocess.run(["luajit", path], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "ok " in res.stdout, "the file ran no case:\n" + res.stdout
