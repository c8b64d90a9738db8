"""The Go and Rust runtimes build and pass with Debian's own toolchains
(golang-go 1.19, cargo with rustc 1.63), whatever newer Go or Rust comes
first on PATH: each is built in a copy of its folder with the Debian
toolchain alone on PATH, runs its own tests against the mock host, then
serves calls in nginx (results, state, errors and panics)."""

import os
import shutil
import subprocess

import pytest

import test_offload_go
import test_offload_rust
from loomtest.nginx import ROOT

DEBIAN_GO = "/usr/lib/go-1.19/bin"
DEBIAN_CARGO = "/usr/bin/cargo"
DEBIAN_RUSTC = "/usr/bin/rustc"


def copy_runtime(tmp_path, name):
    """runtimes/<name> with what its Makefile reaches (../common,
    ../../include), without its build output."""
    dst = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "include"), dst / "include")
    shutil.copytree(os.path.join(ROOT, "runtimes", "common"),
                    dst / "runtimes" / "common")
    shutil.copytree(os.path.join(ROOT, "runtimes", name),
                    dst / "runtimes" / name,
                    ignore=shutil.ignore_patterns("build", "target"))
    return str(dst / "runtimes" / name)


def make(folder, env, *targets):
    res = subprocess.run(["make", "-s", "-C", folder] + list(targets),
                         env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout + res.stderr


def version(cmd, env):
    return subprocess.run(cmd, env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def debian_env(first):
    # Debian's toolchain first and nothing of go.dev's or rustup's: the
    # Makefile appends /usr/local/go/bin and ~/.cargo/bin after PATH
    return dict(os.environ, PATH=first + ":/usr/sbin:/usr/bin:/sbin:/bin",
                HOME=os.environ.get("HOME", "/root"))


def serve(suite, lib, nginx):
    suite.LIB = lib
    suite.test_results_and_state(nginx)
    suite.test_error_and_panic_keep_the_worker(nginx)


def test_go_runtime_with_debian_go(tmp_path, nginx):
    if not os.access(os.path.join(DEBIAN_GO, "go"), os.X_OK):
        pytest.skip("Debian's Go not installed (package golang-go)")
    env = debian_env(DEBIAN_GO)
    assert version(["go", "version"], env).startswith("go version go1.19")
    folder = copy_runtime(tmp_path, "go")
    make(folder, env, "all", "test")
    serve(test_offload_go.TestGo(),
          os.path.join(folder, "build", "libloom_rt_go_example.so"), nginx)


def test_rust_runtime_with_debian_cargo(tmp_path, nginx):
    if not (os.access(DEBIAN_CARGO, os.X_OK)
            and os.access(DEBIAN_RUSTC, os.X_OK)):
        pytest.skip("Debian's Rust not installed (package cargo)")
    env = debian_env("/usr/bin")
    env.update(CARGO=DEBIAN_CARGO, RUSTC=DEBIAN_RUSTC,
               CARGO_HOME=str(tmp_path / "cargo-home"))
    assert version([DEBIAN_RUSTC, "--version"], env).startswith(
        "rustc 1.63.")
    folder = copy_runtime(tmp_path, "rust")
    make(folder, env, "CARGO=" + DEBIAN_CARGO, "all", "test")
    serve(test_offload_rust.TestRust(),
          os.path.join(folder, "build", "libloom_rt_rust_example.so"), nginx)
