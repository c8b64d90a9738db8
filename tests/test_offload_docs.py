"""The runtime samples of docs/offload.md and docs/offload-runtimes.md,
built and loaded as written (the repository path put in for
/path/to/resty-loom): a C runtime, a Rust crate, a Go module and a Python
module, each answering a call through real nginx."""

import hashlib
import json
import os
import re
import subprocess

import pytest

from test_offload_core import ROOT, call, start

DOCS = os.path.join(ROOT, "docs")


def block(doc, first_line):
    """The fenced block of docs/<doc> whose first line starts so."""
    with open(os.path.join(DOCS, doc)) as f:
        text = f.read()
    for body in re.findall(r"^```[\w-]*\n(.*?)^```$", text, re.S | re.M):
        # the doc-example test's marker (docs/development.md) says this
        # test runs the block
        body = re.sub(r"^(#|//|--) doc-test: .*\n", "", body)
        if body.startswith(first_line):
            return body.replace("/path/to/resty-loom", ROOT)
    raise AssertionError("no block starting %r in %s" % (first_line, doc))


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def sh(script, cwd, timeout=600):
    res = subprocess.run(["sh", "-ec", script], cwd=cwd, capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, script + res.stdout + res.stderr


def fnv_rounds(data, rounds):
    h = 0xcbf29ce484222325
    for _ in range(rounds):
        for b in data:
            h = ((h ^ b) * 0x100000001b3) & 0xffffffffffffffff
    return b"%016x" % h


def test_c_sample(nginx, tmp_path):
    write(str(tmp_path / "upper.c"), block("offload.md", "/* upper.c"))
    lib = str(tmp_path / "libupper.so")
    sh(block("offload.md", "# upper.c is the C block above")
       .replace("/tmp/libupper.so", lib), str(tmp_path))
    n = start(nginx, workers=1, lib=lib)
    assert call(n, "hello world").body == b"HELLO WORLD"


def test_rust_sample(nginx, tmp_path):
    write(str(tmp_path / "Cargo.toml"),
          block("offload-runtimes.md", "[package]"))
    write(str(tmp_path / "src" / "lib.rs"),
          block("offload-runtimes.md", "use std::collections::HashMap;"))
    sh(block("offload-runtimes.md", "# run in the directory of Cargo.toml"),
       str(tmp_path))
    lib = str(tmp_path / "target" / "release" / "libmyrt.so")
    n = start(nginx, workers=1, lib=lib, config="rounds=7")
    want = fnv_rounds(b"abc", 7)
    assert call(n, "abc").body == want
    assert call(n, "abc").body == want      # from the cache


def test_go_sample(nginx, tmp_path):
    write(str(tmp_path / "go.mod"), block("offload-runtimes.md", "module myrt"))
    write(str(tmp_path / "main.go"),
          block("offload-runtimes.md", "package main"))
    sh(block("offload-runtimes.md", "# run in the directory of go.mod"),
       str(tmp_path))
    n = start(nginx, workers=1, lib=str(tmp_path / "libmyrt.so"))
    assert [call(n, "ab").body for _ in range(3)] == [b"AB1", b"AB2", b"AB3"]


def test_python_sample(nginx, tmp_path):
    write(str(tmp_path / "handlers.py"),
          block("offload-runtimes.md", "# handlers.py"))
    lib = os.path.join(ROOT, "runtimes/python/build/libloom_rt_python.so")
    if not os.path.exists(lib):
        subprocess.run(["make", "-s", "-C", os.path.dirname(
            os.path.dirname(lib))], check=True)
    n = start(nginx, workers=1, lib=lib,
              config="path=%s module=handlers" % tmp_path)
    h = b"x"
    for _ in range(10000):
        h = hashlib.sha256(h).digest()
    assert json.loads(call(n, "x").body) == {"sha256": h.hex(),
                                             "rounds": 10000}
