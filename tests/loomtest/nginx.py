"""A real nginx master with our module, in a fresh temporary prefix."""

import atexit
import http.client
import json
import os
import random
import re
import shutil
import stat
import signal
import socket
import subprocess
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEBIAN_NGINX = "/usr/sbin/nginx"
NGINX = os.environ.get("LOOM_NGINX", DEBIAN_NGINX)
DEBIAN_MODULE_DIR = "/usr/share/nginx/modules"
MODULE_DIR = os.environ.get("LOOM_NGINX_MODULES", DEBIAN_MODULE_DIR)
# the source tree of LOOM_NGINX, for the tests that build the module
# themselves (make install, luarocks); Debian's nginx-dev by default
NGINX_SRC = os.environ.get("LOOM_NGINX_SRC",
                           "/usr/share/nginx/src" if NGINX == DEBIAN_NGINX
                           else None)
LOOM_MODULE = os.environ.get(
    "LOOM_MODULE", os.path.join(ROOT, "build", "ngx_loom_module.so"))

BAD_LOG = re.compile(r"\[(error|crit|alert|emerg)\]")
_copies = {}


def _not_copied(folder, names):
    """.git, and what copytree cannot copy: sockets and pipes a benchmark
    or a server left in the tree."""
    return [n for n in names if n == ".git" or not (
        stat.S_ISREG(os.lstat(os.path.join(folder, n)).st_mode)
        or stat.S_ISDIR(os.lstat(os.path.join(folder, n)).st_mode)
        or stat.S_ISLNK(os.lstat(os.path.join(folder, n)).st_mode))]


def readable_checkout(root=ROOT):
    """root, or, when we are root and nobody (the user nginx's workers take
    without a `user` line) cannot read it (a clone under /root), a
    world-readable copy of it (without .git), made once: the example
    gateway and the doc examples run from there."""
    events = os.path.join(root, "lib", "resty", "loom", "events.lua")
    if os.geteuid() != 0 or subprocess.run(
            ["setpriv", "--reuid=nobody", "--regid=nogroup",
             "--clear-groups", "test", "-r", events]).returncode == 0:
        return root
    if root not in _copies:
        parent = tempfile.mkdtemp(prefix="loom-checkout-")
        atexit.register(shutil.rmtree, parent, True)
        os.chmod(parent, 0o755)
        copy = os.path.join(parent, "resty-loom")
        shutil.copytree(root, copy, symlinks=True, ignore=_not_copied)
        _copies[root] = copy
    return _copies[root]


def local_modules(conf):
    """conf with its Debian `load_module` lines written the way a user of
    the nginx under test writes them: from LOOM_NGINX_MODULES, and our
    module from LOOM_MODULE."""
    conf = conf.replace("/path/to/resty-loom/build/ngx_loom_module.so",
                        LOOM_MODULE)
    return conf.replace(DEBIAN_MODULE_DIR + "/", MODULE_DIR.rstrip("/") + "/")

CONF = """\
load_module {module_dir}/ndk_http_module.so;
load_module {module_dir}/ngx_http_lua_module.so;
load_module {loom_module};

worker_processes {workers};
{user}
daemon on;
master_process on;
pid {prefix}/logs/nginx.pid;
error_log {prefix}/logs/error.log {error_log_level};
worker_shutdown_timeout {shutdown_timeout};
{env}
{main}

events {{
    worker_connections {worker_connections};
    {events}
}}

http {{
    access_log off;
    client_body_temp_path {prefix}/tmp/body;
    proxy_temp_path {prefix}/tmp/proxy;
    fastcgi_temp_path {prefix}/tmp/fastcgi;
    uwsgi_temp_path {prefix}/tmp/uwsgi;
    scgi_temp_path {prefix}/tmp/scgi;
    client_body_buffer_size 1m;
    client_max_body_size 64m;
    lua_package_path "{root}/lib/?.lua;{root}/tests/lua/?.lua;;";
    lua_socket_log_errors off;

    {http}

    server {{
        listen 127.0.0.1:{port};
        server_name localhost;

        {server}
    }}

    {servers}
}}
"""


def close_listener(sock):
    """Closes a listening socket that a thread may be blocked in accept()
    on: close() alone leaves it listening (the blocked accept() holds it)
    and accepting connections for the rest of the session; shutdown()
    wakes the accept() with an error first."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


# free_port() hands out ports below the kernel's ephemeral range (32768 and
# up here), which outgoing connections take their source ports from: a
# port found free there could be taken by a connection before the server
# it was meant for binds it. Each pytest-xdist worker has its own slice,
# entered at a random place so that concurrent sessions rarely meet.
PORT_FIRST, PORT_SLICE = 10000, 2500
_worker = int(re.sub(r"\D", "", os.environ.get("PYTEST_XDIST_WORKER",
                                               "")) or 8)
_next_port = [PORT_FIRST + _worker % 9 * PORT_SLICE
              + random.randrange(PORT_SLICE)]


def free_port():
    """A TCP port of 127.0.0.1 that nobody listens on or is connected
    from, from this process's slice."""
    base = PORT_FIRST + _worker % 9 * PORT_SLICE
    for _ in range(PORT_SLICE):
        port = _next_port[0]
        _next_port[0] = base + (port + 1 - base) % PORT_SLICE
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in %d-%d" % (base,
                                                 base + PORT_SLICE - 1))


class Response:
    def __init__(self, status, headers, body):
        self.status = status
        self.headers = headers
        self.body = body

    @property
    def text(self):
        return self.body.decode("utf-8", "replace")

    def json(self):
        return json.loads(self.body)

    def __repr__(self):
        return "<Response %d %r>" % (self.status, self.body[:200])


def _children(pid):
    """Pids whose parent is pid (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2:].split()
        if int(rest[1]) == pid:
            out.append(int(d))
    return sorted(out)


def _cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


class Nginx:
    def __init__(self, workers=2, http="", server="", main="", events="",
                 servers="", env=None, error_log_level="info", user=None,
                 worker_connections=1024, shutdown_timeout="10s",
                 prefix=None, port=None):
        self.workers = workers
        self.prefix = prefix or tempfile.mkdtemp(prefix="loom-nginx-")
        os.chmod(self.prefix, 0o755)
        for d in ("logs", "tmp", "conf", "html"):
            os.makedirs(os.path.join(self.prefix, d), exist_ok=True)
        self.port = port or free_port()
        self.env = dict(env or {})
        self.allowed = []
        self.master_pid = None
        self.quit_sent = False
        self.conf_path = os.path.join(self.prefix, "conf", "nginx.conf")
        self.log_path = os.path.join(self.prefix, "logs", "error.log")
        self.render(http=http, server=server, main=main, events=events,
                    servers=servers, error_log_level=error_log_level,
                    user=user, worker_connections=worker_connections,
                    shutdown_timeout=shutdown_timeout)

    def render(self, http="", server="", main="", events="", servers="",
               error_log_level="info", user=None, worker_connections=1024,
               shutdown_timeout="10s"):
        if user is None:
            user = "root" if os.geteuid() == 0 else None
        env_lines = "\n".join("env %s;" % k for k in self.env)
        conf = CONF.format(
            module_dir=MODULE_DIR, loom_module=LOOM_MODULE,
            workers=self.workers, prefix=self.prefix, root=ROOT,
            user=("user %s;" % user) if user else "",
            error_log_level=error_log_level, env=env_lines, main=main,
            events=events, http=http, server=server, servers=servers,
            port=self.port, worker_connections=worker_connections,
            shutdown_timeout=shutdown_timeout)
        conf = conf.replace("$PREFIX", self.prefix)
        with open(self.conf_path, "w") as f:
            f.write(conf)
        self.conf = conf

    # -- process control ----------------------------------------------------

    def _run(self, *args):
        env = dict(os.environ)
        env.update(self.env)
        return subprocess.run(
            [NGINX, "-p", self.prefix, "-c", self.conf_path] + list(args),
            env=env, capture_output=True, text=True, timeout=60)

    def start(self, wait=True):
        res = self._run()
        if res.returncode != 0:
            raise RuntimeError("nginx failed to start: %s\n%s" %
                               (res.stderr, self.error_log()))
        pidfile = os.path.join(self.prefix, "logs", "nginx.pid")
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                with open(pidfile) as f:
                    self.master_pid = int(f.read().strip())
                break
            except (OSError, ValueError):
                time.sleep(0.02)
        if self.master_pid is None:
            raise RuntimeError("nginx wrote no pid file")
        # whatever happens to the caller, no nginx outlives this process
        atexit.register(self._kill_leftovers)
        if wait:
            self.wait_workers(self.workers)
            self.wait_ready()
        return self

    def wait_ready(self, timeout=10):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 1).close()
                return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("nginx does not listen on %d" % self.port)

    def worker_pids(self):
        """Live worker pids, sorted."""
        if self.master_pid is None:
            return []
        return [p for p in _children(self.master_pid)
                if "worker process" in _cmdline(p) and _alive(p)]

    def helper_pids(self):
        return [p for p in _children(self.master_pid)
                if "worker process" not in _cmdline(p) and _alive(p)]

    def wait_workers(self, count, timeout=15, exclude=()):
        deadline = time.time() + timeout
        while time.time() < deadline:
            pids = [p for p in self.worker_pids() if p not in exclude]
            if len(pids) == count:
                return pids
            time.sleep(0.02)
        raise RuntimeError("expected %d workers, have %r" %
                           (count, self.worker_pids()))

    def kill(self, pid, sig=signal.SIGKILL):
        os.kill(pid, sig)

    def signal(self, sig):
        os.kill(self.master_pid, sig)

    def reload(self, timeout=20):
        """HUP the master; returns once a new generation serves."""
        old = set(self.worker_pids())
        log_before = len(self.error_log())
        self.signal(signal.SIGHUP)
        deadline = time.time() + timeout
        while time.time() < deadline:
            new = [p for p in self.worker_pids() if p not in old]
            if len(new) >= self.workers:
                break
            time.sleep(0.02)
        else:
            raise RuntimeError("no new generation after HUP:\n" +
                               self.error_log()[log_before:])
        self.wait_ready()
        return new

    def wait_gone(self, pids, timeout=20):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if not any(_alive(p) for p in pids):
                return True
            time.sleep(0.02)
        return False

    def send_quit(self):
        """QUIT without waiting: the fixture tells every instance first, so
        that their graceful exits (about 1 s with the event bus) overlap."""
        if self.master_pid is not None and _alive(self.master_pid):
            self.signal(signal.SIGQUIT)
            self.quit_sent = True

    def quit(self, timeout=30):
        """Graceful shutdown (QUIT); waits for the master to exit."""
        if self.master_pid is None or not _alive(self.master_pid):
            return
        if not self.quit_sent:
            self.signal(signal.SIGQUIT)
        self.quit_sent = False
        if not self.wait_gone([self.master_pid], timeout):
            raise RuntimeError("nginx did not quit within %ss" % timeout)
        self.master_pid = None

    def _kill_leftovers(self):
        if self.master_pid is None or not _alive(self.master_pid):
            return
        for p in [self.master_pid] + _children(self.master_pid):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass

    def stop(self):
        if self.master_pid is None:
            return
        pids = [self.master_pid] + _children(self.master_pid)
        try:
            self.quit(timeout=15)
        except RuntimeError:
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
            raise
        finally:
            self.master_pid = None

    # -- logs ---------------------------------------------------------------

    def error_log(self):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def wait_log(self, pattern, timeout=5, count=1):
        rx = re.compile(pattern)
        deadline = time.time() + timeout
        while True:
            found = rx.findall(self.error_log())
            if len(found) >= count:
                return found
            if time.time() > deadline:
                raise AssertionError("log never matched %r (%d/%d)\n%s" % (
                    pattern, len(found), count, self.error_log()[-4000:]))
            time.sleep(0.05)

    def allow_log(self, pattern):
        self.allowed.append(re.compile(pattern))

    def bad_log_lines(self):
        bad = []
        for line in self.error_log().splitlines():
            if BAD_LOG.search(line) and not any(
                    a.search(line) for a in self.allowed):
                bad.append(line)
        return bad

    # -- HTTP ---------------------------------------------------------------

    def url(self, path):
        return "http://127.0.0.1:%d%s" % (self.port, path)

    def request(self, method, path, body=None, headers=None, timeout=10):
        conn = http.client.HTTPConnection("127.0.0.1", self.port,
                                          timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            data = r.read()
            return Response(r.status, dict(r.getheaders()), data)
        finally:
            conn.close()

    def get(self, path, **kw):
        return self.request("GET", path, **kw)

    def post(self, path, body=b"", **kw):
        return self.request("POST", path, body=body, **kw)

    def put(self, path, body=b"", **kw):
        return self.request("PUT", path, body=body, **kw)

    def cleanup(self, keep=False):
        if not keep:
            shutil.rmtree(self.prefix, ignore_errors=True)
