"""Once-per-cluster timers: 3 real nginx nodes (2 workers each) share one
timer through a Redis lease with a fencing epoch."""

import collections
import email.utils
import os
import signal
import socket
import threading
import time

from loomtest.nginx import close_listener
from clusterconf import (need_redis, redis_factory,  # noqa: F401
                         start_node, runs, need_faketime, FAKETIME,
                         PEER_GONE)

pytestmark = need_redis

INTERVAL = 0.2
TTL = 0.6


def node_of(nodes, pid):
    for n in nodes:
        if pid in n.worker_pids():
            return n
    return None


def test_each_period_runs_once_and_the_holder_is_replaced(redis_factory,
                                                          nginx):
    r = redis_factory()
    nodes = [start_node(nginx, {"host": "127.0.0.1", "port": r.port},
                        "n%d" % i, timer=(INTERVAL, TTL, 0))
             for i in range(3)]
    deadline = time.time() + 40
    while len(runs(nodes)) < 62 and time.time() < deadline:
        time.sleep(0.1)
    got = runs(nodes)[:62]
    periods = collections.Counter(p for _, p, _, _ in got)
    first, last = min(periods), max(periods)
    # 62 runs in a row: every period from the first to the last ran, once
    assert len(got) == 62
    assert [k for k, v in periods.items() if v > 1] == []
    assert sorted(periods) == list(range(first, last + 1)), periods
    # kill the whole node holding the lease
    holder_pid = got[-1][3]
    holder = node_of(nodes, holder_pid)
    assert holder is not None
    before = len(runs(nodes))
    for p in [holder.master_pid] + holder.worker_pids():
        os.kill(p, signal.SIGKILL)
    holder.master_pid = None
    killed_at = time.time()
    deadline = killed_at + 10
    others = [n for n in nodes if n is not holder]
    while time.time() < deadline:
        later = [x for x in runs(others)[0:]
                 if x[3] != holder_pid and x[1] > got[-1][1]]
        if later:
            break
        time.sleep(0.01)
    took = time.time() - killed_at
    print("holder %d killed; next run elsewhere after %.2f s (ttl %.1f)"
          % (holder_pid, took, TTL))
    assert later, "no run after the holder was killed"
    assert took < 2 * TTL + 0.2   # + this loop's polling and file reads
    all_runs = runs(nodes)
    periods = collections.Counter(p for _, p, _, _ in all_runs)
    assert [k for k, v in periods.items() if v > 1] == [], all_runs[before:]
    epochs = [e for _, _, e, _ in all_runs]
    assert epochs == sorted(epochs)      # epochs only grow


def test_paused_holder_sees_its_epoch_rejected(redis_factory, nginx):
    r = redis_factory()
    nodes = [start_node(nginx, {"host": "127.0.0.1", "port": r.port},
                        "n%d" % i, timer=(1, TTL, 0.4)) for i in range(3)]
    # wait for a run that has not reached its fence check yet: stop it
    deadline = time.time() + 20
    victim = None
    while time.time() < deadline and victim is None:
        rs = runs(nodes)
        fenced = {(x[1], x[3]) for x in rs if x[0] == "fence"}
        for x in rs:
            if x[0] == "run" and (x[1], x[3]) not in fenced \
                    and len([y for y in rs if y[0] == "fence"]) >= 1:
                victim = x
                break
        if victim is None:
            time.sleep(0.005)
    assert victim is not None
    os.kill(victim[3], signal.SIGSTOP)
    for n in nodes:   # the bus dropped the frozen worker's connection;
        # the peer of a write it makes on resuming gets a reset
        n.allow_log(PEER_GONE)
    try:
        time.sleep(3 * TTL + 1)    # lease expired, another took it
    finally:
        os.kill(victim[3], signal.SIGCONT)
    deadline = time.time() + 5
    mine = None
    while time.time() < deadline and not mine:
        mine = [x for x in runs(nodes) if x[0] == "fence"
                and x[1] == victim[1] and x[3] == victim[3]]
        time.sleep(0.05)
    newer = [x for x in runs(nodes) if x[0] == "run" and x[2] > victim[2]]
    print("paused:", victim, "fence:", mine, "newer runs:", newer[:2])
    assert newer, "nobody took over while the holder was paused"
    assert mine and mine[0][4] == "stale", mine
    # runs that were not paused passed their fence check
    ok = [x for x in runs(nodes) if x[0] == "fence" and x[4] == "true"]
    assert ok


class CuttingProxy:
    """A TCP proxy to Redis that, once armed, cuts the connection that
    carries the next command containing `needle` sent after the time
    `armed` (a time.time()): the command reaches Redis, its reply never
    comes back."""

    def __init__(self, upstream_port, needle):
        self.upstream = upstream_port
        self.needle = needle
        self.armed = None
        self.cuts = 0
        self.srv = socket.socket()
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(64)
        self.port = self.srv.getsockname()[1]
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            try:
                u = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                c.close()
                continue
            state = {"cut": False}
            threading.Thread(target=self.up, args=(c, u, state),
                             daemon=True).start()
            threading.Thread(target=self.down, args=(u, c, state),
                             daemon=True).start()

    def up(self, c, u, state):
        try:
            while True:
                data = c.recv(65536)
                if not data:
                    break
                if self.armed and time.time() >= self.armed \
                        and self.needle in data:
                    self.armed = None
                    state["cut"] = True     # before Redis can answer
                    u.sendall(data)
                    time.sleep(0.05)        # Redis runs it
                    self.cuts += 1
                    break
                u.sendall(data)
        except OSError:
            pass
        for s in (c, u):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def down(self, u, c, state):
        try:
            while True:
                data = u.recv(65536)
                if not data or state["cut"]:
                    break
                c.sendall(data)
        except OSError:
            pass

    def close(self):
        close_listener(self.srv)


def test_a_period_whose_reply_was_lost_still_runs(redis_factory, nginx):
    """The connection is cut after Redis gave the holder a period and
    before the answer came back: the holder asks again and runs it."""
    r = redis_factory()
    proxy = CuttingProxy(r.port, b"redis.call('TIME')")
    try:
        n = start_node(nginx, {"host": "127.0.0.1", "port": proxy.port},
                       "n0", timer=(0.5, 1.5, 0))
        deadline = time.time() + 20
        while len(runs([n])) < 3:
            assert time.time() < deadline, "the timer never ran"
            time.sleep(0.05)
        # the first check of a period is the one that takes it
        cut_at = int(time.time() / 0.5) + 2
        proxy.armed = cut_at * 0.5
        while proxy.cuts == 0:
            assert time.time() < deadline, "no period check went through"
            time.sleep(0.05)
        while max(p for _, p, _, _ in runs([n])) < cut_at + 3:
            assert time.time() < deadline + 10, runs([n])
            time.sleep(0.05)
    finally:
        proxy.close()
    periods = collections.Counter(p for _, p, _, _ in runs([n]))
    first, last = min(periods), max(periods)
    print("cut in period %d; ran: %s" % (cut_at, sorted(periods)))
    assert [k for k, v in periods.items() if v > 1] == []
    assert sorted(periods) == list(range(first, last + 1)), periods
    n.allow_log(r"\[loom.cluster(.timer)?\] ")


def connections_received(r):
    for line in r.cli("INFO", "stats").splitlines():
        if line.startswith("total_connections_received:"):
            return int(line.split(":")[1])
    raise AssertionError("no total_connections_received")


def test_a_stalled_redis_gets_one_renewal_per_worker(redis_factory, nginx):
    """Redis stops answering (SIGSTOP) for 2.5 s: each worker's lease
    renewal (every ttl/3 = 0.1 s) waits for its reply (2 s) instead of
    piling up a connection per ttl/3."""
    r = redis_factory()
    n = start_node(nginx, {"host": "127.0.0.1", "port": r.port}, "n0",
                   timer=(1, 0.3, 0))
    deadline = time.time() + 20
    while not runs([n]):
        assert time.time() < deadline, "the timer never ran"
        time.sleep(0.05)
    before = connections_received(r)
    r.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(2.5)
    finally:
        r.proc.send_signal(signal.SIGCONT)
    time.sleep(0.5)
    made = connections_received(r) - before - 1     # less this call's
    print("connections made during a 2.5 s stall by 2 workers:", made)
    # per worker: its renewal and its period check, each timing out once
    # (2 s) and starting again, and the cluster reader's
    assert made <= 12, made
    n.allow_log(r"\[loom.cluster(.timer)?\] ")


def test_redis_down_at_the_period_boundary(redis_factory, nginx):
    """Redis (AOF) stopped just before a period starts and back just
    after: that period runs, late, once. Stopped for a whole period: that
    period never runs, the next one does."""
    r = redis_factory(aof=True)
    nodes = [start_node(nginx, {"host": "127.0.0.1", "port": r.port},
                        "n%d" % i, timer=(1, 3, 0)) for i in range(2)]
    deadline = time.time() + 20
    while len(runs(nodes)) < 2:
        assert time.time() < deadline, "the timer never ran"
        time.sleep(0.05)

    def outage(start, end):
        time.sleep(max(0, start - time.time()))
        r.stop()
        time.sleep(max(0, end - time.time()))
        r.start()
        return time.time()

    brief = int(time.time()) + 2            # a period start
    back = outage(brief - 0.2, brief + 0.3)
    assert back < brief + 0.9, "Redis took too long to come back"
    whole = brief + 3
    back = outage(whole - 0.2, whole + 1.2)
    assert whole + 1 < back < whole + 1.9, back
    deadline = time.time() + 10
    while max(p for _, p, _, _ in runs(nodes)) < whole + 3:
        assert time.time() < deadline, runs(nodes)
        time.sleep(0.05)
    got = runs(nodes)
    periods = collections.Counter(p for _, p, _, _ in got)
    print("outages at %d (0.5 s) and %d (1.4 s); ran: %s"
          % (brief, whole, sorted(periods)))
    assert [k for k, v in periods.items() if v > 1] == [], got
    first, last = min(periods), max(periods)
    assert sorted(periods) == [p for p in range(first, last + 1)
                               if p != whole], periods
    for n in nodes:
        n.allow_log(r"\[loom.cluster(.timer)?\] ")
        n.allow_log(PEER_GONE)


@need_faketime
def test_node_clocks_an_hour_apart(redis_factory, nginx):
    """Node clocks 1 h ahead and 1 h behind (libfaketime): the periods
    come from Redis's clock, so the lease moving from one to the other
    neither repeats nor stalls a period."""
    r = redis_factory()
    nodes = [start_node(nginx, {"host": "127.0.0.1", "port": r.port},
                        "n%d" % i, timer=(INTERVAL, TTL, 0),
                        env={"LD_PRELOAD": FAKETIME, "FAKETIME": skew})
             for i, skew in enumerate(["+3600", "-3600"])]
    for n, skew in zip(nodes, [3600, -3600]):     # nginx's own clock
        date = n.get("/cl/stats").headers["Date"]
        seen = email.utils.parsedate_to_datetime(date).timestamp()
        assert abs(seen - time.time() - skew) < 60, (date, skew)
    deadline = time.time() + 30
    while len(runs(nodes)) < 10:
        assert time.time() < deadline, "the timer never ran"
        time.sleep(0.05)
    holder = node_of(nodes, runs(nodes)[-1][3])
    other = [n for n in nodes if n is not holder][0]
    before = len(runs(nodes))
    for p in [holder.master_pid] + holder.worker_pids():
        os.kill(p, signal.SIGKILL)
    holder.master_pid = None
    killed_period = max(p for _, p, _, _ in runs(nodes))
    while len([x for x in runs([other]) if x[1] > killed_period]) < 10:
        assert time.time() < deadline + 10, runs(nodes)[before:]
        time.sleep(0.05)
    got = runs(nodes)
    periods = collections.Counter(p for _, p, _, _ in got)
    after = sorted(x[1] for x in runs([other]) if x[1] > killed_period)
    print("holder killed at period %d; the node an hour apart ran: %s"
          % (killed_period, after))
    assert [k for k, v in periods.items() if v > 1] == [], got
    # from the other node's first run on, every period, in Redis's time
    assert after == list(range(after[0], after[0] + len(after)))
    assert after[0] - killed_period <= 2 * TTL / INTERVAL + 1
    assert abs(after[-1] - time.time() / INTERVAL) < 5


def test_lease_lost_to_a_redis_outage_while_the_callback_runs(
        redis_factory, nginx):
    """Redis (AOF) goes away for 1.2 s (2 x ttl) while a run's callback
    is busy: its lease expires, and when it checks its epoch after Redis
    is back, it is told it is stale; no period runs twice."""
    r = redis_factory(aof=True)
    nodes = [start_node(nginx, {"host": "127.0.0.1", "port": r.port},
                        "n%d" % i, timer=(1, TTL, 2.5)) for i in range(2)]
    deadline = time.time() + 20
    victim = None
    while victim is None:
        assert time.time() < deadline, "the timer never ran"
        rs = runs(nodes)
        fenced = {(x[1], x[3]) for x in rs if x[0] == "fence"}
        busy = [x for x in rs if x[0] == "run" and (x[1], x[3]) not in fenced]
        victim = busy[0] if busy else None
        time.sleep(0.01)
    r.stop()
    time.sleep(1.2)
    r.start()
    deadline = time.time() + 10
    mine = []
    while not mine:
        assert time.time() < deadline, runs(nodes)
        mine = [x for x in runs(nodes) if x[0] == "fence"
                and x[1:4] == victim[1:4]]
        time.sleep(0.05)
    deadline = time.time() + 10
    while not [x for x in runs(nodes) if x[0] == "run" and x[2] > victim[2]]:
        assert time.time() < deadline, runs(nodes)
        time.sleep(0.05)
    got = runs(nodes)
    print("busy:", victim, "fence:", mine, "runs:", got)
    assert mine[0][4] == "stale", mine
    periods = collections.Counter(x[1] for x in got if x[0] == "run")
    assert [k for k, v in periods.items() if v > 1] == [], got
    for n in nodes:
        n.allow_log(r"\[loom.cluster(.timer)?\] ")
        n.allow_log(PEER_GONE)
