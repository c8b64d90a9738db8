"""The example gateway (examples/gateway), started the way `make run` does
but on a free port and in a temporary prefix."""

import os
import re
import signal
import socket
import subprocess
import tempfile
import time

from .nginx import (NGINX, ROOT, Response, free_port, _children, _cmdline,
                    readable_checkout)
import http.client

BAD = re.compile(r"\[(error|crit|alert|emerg)\]")
class Gateway:
    def __init__(self, env=None, root=ROOT):
        self.root = readable_checkout(root)
        self.prefix = tempfile.mkdtemp(prefix="loom-gateway-")
        os.chmod(self.prefix, 0o755)
        self.port = free_port()
        self.env = dict(os.environ)
        self.env.update(env or {})
        self.env["LOOM_GATEWAY_PREFIX"] = self.prefix
        self.env["LOOM_GATEWAY_LISTEN"] = "127.0.0.1:%d" % self.port
        self.allowed = []
        self.proc = None
        self.log_path = os.path.join(self.prefix, "stderr.log")

    def start(self, timeout=20):
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [os.path.join(self.root, "examples", "gateway", "run.sh")],
            env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("gateway exited:\n" + self.output())
            try:
                socket.create_connection(("127.0.0.1", self.port), 1).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("gateway did not listen:\n" + self.output())

    def output(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def worker_pids(self):
        return [p for p in _children(self.proc.pid)
                if "worker process" in _cmdline(p)]

    def request(self, method, path, body=None, headers=None, timeout=10):
        conn = http.client.HTTPConnection("127.0.0.1", self.port,
                                          timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return Response(r.status, dict(r.getheaders()), r.read())
        finally:
            conn.close()

    def get(self, path, **kw):
        return self.request("GET", path, **kw)

    def allow_log(self, pattern):
        self.allowed.append(re.compile(pattern))

    def stop(self, timeout=20):
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGQUIT)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise RuntimeError("gateway did not quit in %ss" % timeout)
        finally:
            self.log.close()

    def bad_log_lines(self):
        return [line for line in self.output().splitlines()
                if BAD.search(line)
                and not any(a.search(line) for a in self.allowed)]
