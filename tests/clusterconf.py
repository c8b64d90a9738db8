"""Real Redis servers, Sentinels and nginx nodes for the cluster tests."""

import atexit
import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

REDIS = shutil.which("redis-server")
SENTINEL = shutil.which("redis-sentinel")
CLI = shutil.which("redis-cli")

need_redis = pytest.mark.skipif(
    not (REDIS and CLI),
    reason="redis-server/redis-cli missing (Debian package redis-server)")
FAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"
need_faketime = pytest.mark.skipif(
    not os.path.exists(FAKETIME),
    reason="libfaketime missing (Debian package libfaketime)")
need_sentinel = pytest.mark.skipif(
    not (REDIS and CLI and SENTINEL),
    reason="redis-sentinel missing (Debian package redis-sentinel)")


# nginx's own lines when the peer of a connection (Redis, a Sentinel's
# demoted or killed master, a killed worker at the other end of a bus
# socket) goes away under it, whatever lua_socket_log_errors says
PEER_GONE = r"\((104: Connection reset by peer|32: Broken pipe)\)"

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Redis:
    """One redis-server (or redis-sentinel with sentinel=...) on a free
    loopback port with its own directory."""

    def __init__(self, aof=False, replica_of=None, sentinel_of=None):
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="loom-redis-")
        self.aof = aof
        self.replica_of = replica_of
        self.sentinel_of = sentinel_of
        self.proc = None

    def start(self):
        if self.sentinel_of:
            conf = os.path.join(self.dir, "sentinel.conf")
            with open(conf, "w") as f:
                f.write("port %d\nbind 127.0.0.1\ndir %s\n"
                        "sentinel monitor m 127.0.0.1 %d 2\n"
                        "sentinel down-after-milliseconds m 1000\n"
                        "sentinel failover-timeout m 5000\n"
                        "sentinel parallel-syncs m 1\n"
                        % (self.port, self.dir, self.sentinel_of.port))
            cmd = [SENTINEL, conf]
        else:
            cmd = [REDIS, "--port", str(self.port), "--bind", "127.0.0.1",
                   "--dir", self.dir, "--daemonize", "no",
                   "--appendonly", "yes" if self.aof else "no",
                   "--appendfsync", "everysec",
                   "--save", "" if self.aof else "3600 1",
                   "--logfile", os.path.join(self.dir, "redis.log")]
            if self.replica_of:
                cmd += ["--replicaof", "127.0.0.1",
                        str(self.replica_of.port)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        # whatever happens to the caller, no server outlives this process
        atexit.register(self.proc.kill)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                if self.cli("PING").strip() == "PONG":
                    return self
            except subprocess.CalledProcessError:
                pass
            time.sleep(0.05)
        raise RuntimeError("redis on %d did not start" % self.port)

    def cli(self, *args):
        return subprocess.run([CLI, "-p", str(self.port)] + list(args),
                              capture_output=True, text=True, check=True,
                              timeout=10).stdout

    def stop(self, sig=signal.SIGTERM):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def cleanup(self):
        self.stop(signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def redis_factory():
    made = []

    def factory(**kw):
        r = Redis(**kw)
        made.append(r)
        return r.start()

    yield factory
    for r in made:
        r.cleanup()


def lua_table(d):
    """A Python dict as a Lua table constructor (strings, numbers, lists)."""
    def val(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "{" + ", ".join(val(x) for x in v) + "}"
        return lua_table(v)
    return "{" + ", ".join("%s = %s" % (k, val(v)) for k, v in d.items()) \
        + "}"


def node_conf(opts, worker_first="", worker_extra=""):
    return {
        "http": """
    lua_shared_dict cluster 32m;
    init_by_lua_block {
        require("cluster_helper").init(%s)
    }
    init_worker_by_lua_block {
        %s
        require("cluster_helper").init_worker()
        %s
    }
    server {
        listen unix:$PREFIX/sock/bus.sock;
        lua_socket_buffer_size 64k;
        location / {
            content_by_lua_block { require("resty.loom.events").get():serve() }
        }
    }
""" % (lua_table(opts), worker_first, worker_extra),
        "server": """
    location /cl/ { content_by_lua_block { require("cluster_helper").handle() } }
""",
    }


def start_node(nginx, redis_opts, node_id, workers=2, prefix=None,
               port=None, timer=None, env=None, init_worker="", **extra):
    """init_worker: Lua run in init_worker_by_lua before anything else."""
    opts = {"redis": redis_opts, "node_id": node_id, "lease_ttl": 1,
            "block": 0.5, "ack_timeout": 2, "claim_idle": 5,
            "backoff_max": 1}
    opts.update(extra)
    n = nginx(workers=workers, start=False, prefix=prefix, port=port,
              env=env,
              **node_conf(opts, init_worker, timer and
                          'require("cluster_helper").start_timer(%r, %r, %r)'
                          % timer or ""))
    os.makedirs(os.path.join(n.prefix, "sock"), mode=0o700, exist_ok=True)
    try:    # left by a node killed with SIGKILL
        os.unlink(os.path.join(n.prefix, "sock", "bus.sock"))
    except OSError:
        pass
    n.start()
    n.node_id = node_id
    return n


def stats(n):
    return n.get("/cl/stats").json()


def reader_pid(n, timeout=10):
    """The pid of the node's elected reader (asks until it answers)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = stats(n)
        if st["reader"]:
            return st["pid"]
        time.sleep(0.01)
    raise AssertionError("no reader found on %s" % n.node_id)


def cpu_seconds(pids):
    """utime + stime of these processes, in seconds."""
    total = 0
    for p in pids:
        with open("/proc/%d/stat" % p) as f:
            rest = f.read().rsplit(")", 1)[1].split()
        total += int(rest[11]) + int(rest[12])
    return total / os.sysconf("SC_CLK_TCK")


def wait_readers(nodes, timeout=15):
    """Waits until every node has a reader that joined its group."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(stats(n)["reader_elections"] >= 1 for n in nodes):
            time.sleep(0.3)   # the groups are created just after
            return
        time.sleep(0.05)
    raise AssertionError("no reader on some node")


def publish(n, count, tag, target="cluster", rate=0, start=1, event="ev",
            **kw):
    q = "/cl/pub?n=%d&tag=%s&target=%s&rate=%d&from=%d&event=%s" % (
        count, tag, target, rate, start, event)
    for k, v in kw.items():
        q += "&%s=%s" % (k, v)
    return n.get(q, timeout=300).json()


def handled(n):
    """{worker id: Counter((tag, seq) -> times)} from the node's files."""
    out = {}
    logs = os.path.join(n.prefix, "logs")
    for name in os.listdir(logs):
        if name.startswith("h-") and name.endswith(".log"):
            wid = int(name[2:-4])
            c = collections.Counter()
            with open(os.path.join(logs, name)) as f:
                for line in f:
                    parts = line.split()
                    if len(parts) == 3:
                        c[(parts[0], int(parts[1]))] += 1
            out[wid] = c
    return out


def tally(nodes, expect, workers=2):
    """expect: set of (tag, seq) every worker of every node must handle.
    Returns {node: {wid: (lost, dups)}} and the overall sums."""
    res = {}
    lost = dups = 0
    for n in nodes:
        h = handled(n)
        per = {}
        for wid in range(workers):
            c = h.get(wid, collections.Counter())
            got = {k for k in c if k in expect}
            lo = len(expect - got)
            du = sum(v - 1 for k, v in c.items() if k in expect and v > 1)
            per[wid] = (lo, du)
            lost += lo
            dups += du
        res[n.node_id] = per
    return res, lost, dups


def last_handled(n, pids):
    """{(worker id, (tag, seq))}: the last event each of `pids` recorded in
    the node's files (its handler ran; a SIGKILL right after it can stop
    the mark that would have kept it from running again)."""
    last = {}
    logs = os.path.join(n.prefix, "logs")
    for name in os.listdir(logs):
        if name.startswith("h-") and name.endswith(".log"):
            wid = int(name[2:-4])
            with open(os.path.join(logs, name)) as f:
                for line in f:
                    parts = line.split()
                    if len(parts) == 3 and int(parts[2]) in pids:
                        last[int(parts[2])] = (wid, (parts[0], int(parts[1])))
    return set(last.values())


def unexplained_dups(nodes, expect, victim, killed_pids, workers=2):
    """The duplicates a SIGKILL does not explain: all but a second run, in
    the victim node's worker slot, of the last event a killed worker of
    that slot recorded (the window between an event's handlers and its
    mark, docs/cluster.md)."""
    window = last_handled(victim, set(killed_pids))
    out = []
    for n in nodes:
        for wid, c in handled(n).items():
            if wid >= workers:
                continue
            for k, v in c.items():
                if k in expect and v > 1 and not (
                        n is victim and v == 2 and (wid, k) in window):
                    out.append((n.node_id, wid, k, v))
    return out


def wait_tally(nodes, expect, timeout=60, workers=2):
    deadline = time.time() + timeout
    while True:
        res, lost, dups = tally(nodes, expect, workers)
        if lost == 0 or time.time() > deadline:
            return res, lost, dups
        time.sleep(0.2)


def runs(nodes):
    """[(what, period, epoch, pid, rest...)] from every node's timer.log
    (cluster_helper.start_timer)"""
    out = []
    for n in nodes:
        try:
            with open(os.path.join(n.prefix, "logs", "timer.log")) as f:
                for line in f:
                    p = line.split()
                    if len(p) >= 4:
                        out.append((p[0], int(p[1]), int(p[2]), int(p[3]))
                                   + tuple(p[4:]))
        except OSError:
            pass
    return out
