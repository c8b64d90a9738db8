"""Setting the example gateway up on a stock machine (issue 19, section 1):
the rendered config passes `nginx -t`, `make run` builds no Go or Rust,
workers leave root, a taken port and missing packages each print one line
saying what to do, and an idle gateway logs nothing."""

import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

from loomtest.gateway import Gateway
from loomtest.nginx import NGINX, ROOT, free_port, readable_checkout

RUN_SH = os.path.join(ROOT, "examples", "gateway", "run.sh")


def render(prefix):
    env = dict(os.environ, LOOM_GATEWAY_PREFIX=prefix,
               LOOM_GATEWAY_LISTEN="127.0.0.1:%d" % free_port(),
               LOOM_GATEWAY_RENDER_ONLY="1")
    subprocess.run([RUN_SH], env=env, check=True, timeout=30)


def test_rendered_config_passes_nginx_t(tmp_path):
    prefix = str(tmp_path)
    render(prefix)
    res = subprocess.run(
        [NGINX, "-t", "-p", prefix, "-c", prefix + "/conf/nginx.conf",
         "-e", prefix + "/logs/error.log"],
        capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "test is successful" in res.stderr


def test_make_run_builds_no_go_or_rust():
    # -B: every target out of date, -n: print the recipes without running
    res = subprocess.run(["make", "-C", ROOT, "-n", "-B", "run"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    recipes = res.stdout
    assert "ngx_loom_module.so" in recipes and "runtimes/c" in recipes
    for other in ("runtimes/rust", "runtimes/go", "runtimes/python",
                  "cargo", "go build"):
        assert other not in recipes, other


@pytest.mark.skipif(os.geteuid() != 0, reason="needs to start as root")
def test_workers_leave_root(gateway):
    deadline = time.time() + 10
    while len(gateway.worker_pids()) < 2 and time.time() < deadline:
        time.sleep(0.05)
    pids = gateway.worker_pids()
    assert len(pids) == 2
    for pid in pids:
        with open("/proc/%d/status" % pid) as f:
            uid = re.search(r"^Uid:\s+(\d+)", f.read(), re.M).group(1)
        assert uid != "0", "worker %d runs as root" % pid
    # and the gateway still works as nobody: the bus, config and offload
    r = gateway.request("PUT", "/config/k", body=b"v")
    assert r.status == 200, r.text
    assert gateway.get("/offload/hash?data=x&rounds=1").status == 200


def test_address_in_use_says_what_to_do(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        listen = "127.0.0.1:%d" % s.getsockname()[1]
        env = dict(os.environ, LOOM_GATEWAY_PREFIX=str(tmp_path),
                   LOOM_GATEWAY_LISTEN=listen)
        res = subprocess.run([RUN_SH], env=env, capture_output=True,
                             text=True, timeout=30)
    assert res.returncode == 1
    lines = res.stderr.strip().split("\n")
    assert len(lines) == 1, res.stderr
    assert listen + " is already in use" in lines[0]
    assert "LOOM_GATEWAY_LISTEN=" in lines[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become nobody")
def test_missing_packages_as_non_root_say_what_to_run():
    with tempfile.NamedTemporaryFile("w", suffix=".txt", dir="/tmp") as f:
        f.write("# a list\nnginx\nloom-no-such-package\n")
        f.flush()
        os.chmod(f.name, 0o644)
        res = subprocess.run(
            ["setpriv", "--reuid=nobody", "--regid=nogroup",
             "--clear-groups", "make", "-s", "-C", readable_checkout(),
             "deps-run",
             "RUN_PACKAGES=" + f.name, "BUILD_DIR=/tmp/loom-none"],
            capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    out = res.stdout.strip().split("\n")
    assert out == ["missing Debian packages; run: sudo apt-get install "
                   "loom-no-such-package"], res.stdout + res.stderr


def test_idle_gateway_logs_nothing():
    g = Gateway().start()
    try:
        assert g.get("/").status == 200
        time.sleep(0.5)
        before = g.output()
        time.sleep(3)
        after = g.output()
    finally:
        g.stop()
    assert after == before, "an idle gateway logged:\n" + after[len(before):]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become nobody")
def test_gateway_runs_as_a_non_root_user():
    # not under pytest's tmp_path: its parent is root's alone
    tmp_path = pathlib.Path(tempfile.mkdtemp(prefix="loom-nonroot-"))
    os.chmod(tmp_path, 0o755)
    prefix = tmp_path / "prefix"
    prefix.mkdir()
    os.chown(prefix, 65534, 65534)
    port = free_port()
    env = dict(os.environ, LOOM_GATEWAY_PREFIX=str(prefix),
               LOOM_GATEWAY_LISTEN="127.0.0.1:%d" % port)
    out = tmp_path / "out.log"
    with open(out, "w") as log:
        proc = subprocess.Popen(
            ["setpriv", "--reuid=nobody", "--regid=nogroup",
             "--clear-groups", os.path.join(readable_checkout(), "examples",
                                            "gateway", "run.sh")],
            env=env, cwd="/",
            stdout=log, stderr=subprocess.STDOUT)
    try:
        g = Gateway()
        g.port = port
        deadline = time.time() + 20
        while True:
            assert proc.poll() is None, out.read_text()
            try:
                r = g.get("/")
                break
            except OSError:
                assert time.time() < deadline, out.read_text()
                time.sleep(0.1)
        assert r.status == 200
        # every worker on the bus before the PUT: the broker holds an event
        # for a worker not connected yet, and a QUIT then (nginx removes
        # the bus's socket at once) leaves it lost and reported
        while True:
            workers = g.get("/loom/events").json()["workers"]
            if ([w["id"] for w in workers] == [0, 1]
                    and all(w["events"]["connected"] for w in workers)):
                break
            assert time.time() < deadline, out.read_text()
            time.sleep(0.05)
        r = g.request("PUT", "/config/k", body=b"v")
        assert r.status == 200, r.text
        assert g.get("/offload/hash?data=x&rounds=1").status == 200
    finally:
        proc.send_signal(signal.SIGQUIT)
        proc.wait(20)
    log = out.read_text()
    shutil.rmtree(tmp_path)
    assert not re.search(r"\[(warn|error|crit|alert|emerg)\]", log), log


@pytest.mark.skipif(os.geteuid() != 0, reason="needs to start as root")
def test_checkout_the_workers_cannot_read_says_what_to_do():
    # a checkout under a directory private to root (a clone in /root): the
    # workers (nobody) could not load Lua modules, reach the bus socket or
    # write temporary files; the gateway must not start half-broken
    private = pathlib.Path(tempfile.mkdtemp(prefix="loom-private-"))
    try:
        os.chmod(private, 0o700)
        os.symlink(ROOT, private / "checkout")
        port = free_port()
        env = dict(os.environ, LOOM_GATEWAY_PREFIX=str(private / "prefix"),
                   LOOM_GATEWAY_LISTEN="127.0.0.1:%d" % port)
        env.pop("LOOM_GATEWAY_USER", None)
        proc = subprocess.Popen(
            [str(private / "checkout" / "examples" / "gateway" / "run.sh")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGQUIT)
            out, err = proc.communicate(timeout=20)
            pytest.fail("started with workers that cannot read %s:\n%s"
                        % (private, err))
    finally:
        shutil.rmtree(private)
    assert proc.returncode == 1
    lines = err.strip().split("\n")
    assert len(lines) == 1, err
    assert "nobody" in lines[0] and str(private) in lines[0], lines[0]
    assert "LOOM_GATEWAY_USER=" in lines[0], lines[0]


def test_every_listed_package_comes_from_the_archive():
    # `make deps` installs the lists with apt-get: one package that only a
    # third-party repository has (Google's Pub/Sub emulator) fails the whole
    # install, and with it `make test`, on a stock machine
    pkgs = {}
    for name in ("apt-packages.txt", "apt-packages-run.txt"):
        with open(os.path.join(ROOT, "deps", name)) as f:
            for line in f:
                if line.strip() and not line.startswith("#"):
                    pkgs.setdefault(line.strip(), name)
    out = subprocess.run(["apt-cache", "policy", "nginx"] + sorted(pkgs),
                         capture_output=True, text=True).stdout
    # one block per package: "name:" then its version table, whose lines
    # name where each version comes from
    sources = {}
    for line in out.splitlines():
        if re.match(r"^\S+:$", line):
            pkg = sources.setdefault(line[:-1], [])
        elif re.match(r"^\s+-?\d+ \S", line) and \
                "/var/lib/dpkg/status" not in line:
            pkg.append(line)
    if not sources.get("nginx"):
        pytest.skip("no apt package lists here (apt-get update)")
    missing = ["%s (%s)" % (p, name) for p, name in sorted(pkgs.items())
               if not sources.get(p)]
    assert not missing, "not in the configured archives: %s" % missing


SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
TOOLCHAIN_PROGRAMS = {"go", "gofmt", "cargo", "rustc", "rustdoc"}


def path_without_toolchains(tmp_path):
    """A PATH holding every program of the system's PATH but Go's and
    Rust's (make deps installs Debian's into /usr/bin): a machine without
    them."""
    bare = tmp_path / "bin"
    bare.mkdir()
    for folder in SYSTEM_PATH.split(":"):
        for name in os.listdir(folder):
            if name not in TOOLCHAIN_PROGRAMS and \
                    not os.path.lexists(bare / name):
                os.symlink(os.path.join(folder, name), bare / name)
    return str(bare)


def test_runtimes_without_toolchains_say_what_to_install(tmp_path):
    # a machine without Go or Rust gets one line
    path = path_without_toolchains(tmp_path)
    res = subprocess.run(["make", "-s", "-C", ROOT, "runtimes",
                          "TOOLCHAIN_PATH="],
                         env=dict(os.environ, PATH=path),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert res.stdout.strip().split("\n") == [
        "make runtimes needs go on PATH: make deps installs Debian's "
        "golang-go and cargo"], res.stdout + res.stderr


def test_runtimes_find_toolchains_off_path(tmp_path):
    # sudo's secure_path and a bare CI shell lack /usr/local/go/bin and
    # ~/.cargo/bin, where go.dev's tarball and rustup install: on a machine
    # without Debian's toolchains the Makefile finds those; BUILD= puts
    # every runtime in a scratch directory, so go and cargo do run
    home = os.path.expanduser("~")
    if not (os.path.exists("/usr/local/go/bin/go")
            and os.path.exists(home + "/.cargo/bin/cargo")):
        pytest.skip("no /usr/local/go or ~/.cargo toolchain here")
    path = path_without_toolchains(tmp_path)
    build = tmp_path / "build"
    res = subprocess.run(["make", "-s", "-C", ROOT, "runtimes",
                          "BUILD=%s" % build],
                         env=dict(os.environ, PATH=path, HOME=home),
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    assert os.path.exists(build / "libloom_rt_go_example.so")
    assert os.path.exists(build / "libloom_rt_rust_example.so")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs to start as root")
def test_tests_run_the_gateway_from_a_checkout_private_to_root():
    # CI may clone under /root: the tests' gateway runs from a readable copy
    private = pathlib.Path(tempfile.mkdtemp(prefix="loom-private-"))
    try:
        os.chmod(private, 0o700)
        os.symlink(ROOT, private / "checkout")
        g = Gateway(root=str(private / "checkout"))
        assert not g.root.startswith(str(private))
        g.start()
        try:
            assert g.request("PUT", "/config/k", body=b"v").status == 200
            # a module the workers require on first use
            assert g.get("/loom/timers/flamegraph.svg").status == 200
            assert g.get("/offload/hash?data=x&rounds=1").status == 200
        finally:
            g.stop()
    finally:
        shutil.rmtree(private)
    assert not g.bad_log_lines(), g.output()
