"""Runs of events to "all" and "others" in the publishers' rings: publish
order kept with what goes on the socket, a full ring falls back to the
socket, kill -9 of a subscriber and of the broker, no rings when the module
is first loaded in a worker."""

import os
import re
import signal
import time

import pytest

import eventsconf as ec

# worker 2's handler of source "block" holds its handler loop 3 s
BLOCKER = """
    if ngx.worker.id() == 2 then
        require("resty.loom.events").get():subscribe("block", "e",
            function() ngx.sleep(3) end)
    end
"""


def start(nginx, workers=3, opts="", extra_worker=""):
    n = nginx(workers=workers, http=ec.http(opts, extra_worker=extra_worker),
              server=ec.SERVER)
    ec.wait_ready(n)
    return n


def pub_from(n, wid, query, within=30):
    deadline = time.time() + within
    while time.time() < deadline:
        r = n.get("/ev/pub?only=%d&%s" % (wid, query), timeout=30)
        if r.status != 409:
            return r.json()
    raise AssertionError("no request reached worker %d" % wid)


def wait_traces(n, want, timeout=20):
    deadline = time.time() + timeout
    while True:
        st = ec.states(n)
        if all(len(st[w]["trace"]) >= c for w, c in want.items()):
            return st
        assert time.time() < deadline, {w: len(s["trace"])
                                        for w, s in st.items()}
        time.sleep(0.05)


def ring(st, w):
    return st[w]["stats"]["ring"]


def test_runs_keep_publish_order_with_the_socket_events(nginx):
    """From a worker with a socket and from the broker worker: runs of
    "all" events go through the ring, events larger than a write go on the
    socket (and what is queued with them), events to itself stay in the
    worker, and every worker, the publisher included, handles them in
    publish order."""
    n = start(nginx)
    first = 1
    want = {w: [] for w in range(3)}
    parts = [("target=all&n=3000", 3000),
             ("target=all&n=3&size=70000", 3),      # over WRITE_MAX
             ("target=mixself&n=400", 400),         # all, itself, ...
             ("target=all&n=3000", 3000)]
    for pub in (1, 0):
        before = ring(ec.states(n), pub)["events"]
        for query, count in parts:
            # (settle: nothing of the part before is still queued)
            r = pub_from(n, pub, "%s&source=trace&settle=1&start=%d"
                         % (query, first))
            assert r["ok"] == count and r["worker"] == pub
            for i in range(first, first + count):
                for w in want:
                    if "mixself" not in query or i % 2 == 1 or w == pub:
                        want[w].append(i)
            first += count
        wait_traces(n, {w: len(v) for w, v in want.items()})
        time.sleep(0.2)
        st = ec.states(n)
        for w in range(3):
            assert st[w]["trace"] == want[w], w
            s = st[w]["stats"]
            assert s["gaps"] == 0 and s["duplicates"] == 0, s
            assert s["ring"]["overwritten"] == 0, s["ring"]
        # the two runs of 3,000 and the 200 "all" of mixself
        assert ring(st, pub)["events"] - before == 6200


def test_a_full_ring_falls_back_to_the_socket(nginx):
    """A subscriber that does not read holds the runs it has not received
    in the publisher's ring; once the ring is full the publisher sends its
    events on the socket. Nothing is lost or reordered, nothing is read
    after it was written over."""
    # (max_backlog: worker 2 stops reading while its handler is held)
    n = start(nginx, opts="max_backlog = 20, heartbeat = 10, "
              "slow_timeout = 20", extra_worker=BLOCKER)
    r = pub_from(n, 1, "target=all&n=1&source=block")
    assert r["ok"] == 1
    time.sleep(0.2)
    # 1,200 events of 10 KB: 12 MB, more than the 4 MiB ring
    r = pub_from(n, 1, "target=all&n=1200&size=10000&source=trace")
    assert r["ok"] == 1200
    st = wait_traces(n, {0: 1200, 1: 1200, 2: 1200}, timeout=30)
    for w in range(3):
        assert st[w]["trace"] == list(range(1, 1201)), w
        s = st[w]["stats"]
        assert s["gaps"] == 0 and s["duplicates"] == 0, s
        assert s["ring"]["overwritten"] == 0
        assert s["dropped"] == {}, s
    assert st[0]["stats"]["broker"]["dropped"] == {}
    sent = ring(st, 1)["events"]
    assert 0 < sent < 1201, sent
    assert ring(st, 1)["full"] > 0
    # and the ring is used again once the subscriber has caught up
    r = pub_from(n, 1, "target=all&n=100&source=again")
    assert r["ok"] == 100
    ec.wait_totals(n, {w: 1301 for w in range(3)})
    assert ring(ec.states(n), 1)["events"] >= sent + 100


def test_a_subscriber_too_slow_keeps_its_runs(nginx):
    """A subscriber the broker finds too slow no longer holds anybody's
    acknowledgements, and events for it may be dropped (counted); the runs
    it has not received still stay in the ring until it has them, so it
    never reads one that was written over."""
    n = start(nginx, opts="max_backlog = 20, slow_timeout = 0.5",
              extra_worker=BLOCKER)
    n.allow_log(r"dropping events for worker 2")
    r = pub_from(n, 1, "target=all&n=1&source=block")
    assert r["ok"] == 1
    time.sleep(0.2)
    r = pub_from(n, 1, "target=all&n=1200&size=10000&source=trace")
    assert r["ok"] == 1200
    st = wait_traces(n, {0: 1200, 1: 1200}, timeout=30)
    deadline = time.time() + 30
    while True:
        st = ec.states(n)
        got = len(st[2]["trace"])
        lost = st[0]["stats"]["broker"]["queues"]["2"]["dropped"]
        if got + lost >= 1200 or time.time() > deadline:
            break
        time.sleep(0.1)
    # every event reached worker 2 or was counted as dropped for it
    assert got + lost == 1200, (got, lost)
    trace = st[2]["trace"]
    assert trace == sorted(trace) and len(set(trace)) == got
    assert st[2]["stats"]["ring"]["overwritten"] == 0
    for w in (0, 1):
        assert st[w]["trace"] == list(range(1, 1201)), w


def test_a_plain_event_now_and_then_keeps_the_runs_going(nginx):
    """An event that cannot travel in a ring (here one to worker 0 every
    50 events) goes on the socket in its place in the order; the runs
    around it still go through the ring."""
    n = start(nginx)
    r = pub_from(n, 1, "target=mixrare&n=5000&source=trace")
    assert r["ok"] == 5000
    want = [i for i in range(1, 5001) if i % 50 != 0]
    st = wait_traces(n, {0: 5000, 1: len(want), 2: len(want)})
    assert st[1]["trace"] == want and st[2]["trace"] == want
    assert st[0]["trace"] == list(range(1, 5001))
    # runs end at each of the 100 plain events, or at 64 KiB
    assert ring(st, 1)["events"] >= 0.9 * len(want), ring(st, 1)


BLOCK5 = """
    if ngx.worker.id() == 2 then
        require("resty.loom.events").get():subscribe("block", "e",
            function() ngx.sleep(5) end)
    end
"""


def test_runs_not_acknowledged_stay_for_a_re_send(nginx):
    """A publisher whose reader is held (its inbox full) reads no
    acknowledgements, while the broker frees its runs: its ring must not
    write over them, as a reconnect re-sends them. Then the broker is
    killed: its events, and what it publishes after, reach everyone."""
    n = start(nginx, opts="max_backlog = 20, ring_bytes = 262144",
              extra_worker=BLOCK5)
    n.allow_log(r"exited on signal 9")
    n.allow_log(r"\((104: Connection reset by peer|32: Broken pipe)\)")
    assert pub_from(n, 1, "target=2&n=1&source=block")["ok"] == 1
    time.sleep(0.3)
    assert pub_from(n, 1, "target=2&n=25&source=fill")["ok"] == 25
    time.sleep(0.3)
    # 2 MB from worker 2, 8 times its ring, while it reads nothing
    r = pub_from(n, 2, "target=all&n=200&size=10000&source=big")
    assert r["ok"] == 200
    time.sleep(1)
    st = ec.states(n)
    assert st[2]["stats"]["queue"]["unacked"] > 0
    pid = st[0]["pid"]
    n.kill(pid, signal.SIGKILL)
    n.wait_workers(3, exclude=[pid])
    st = wait_received(n, {1: {"2:big:e": 200}}, timeout=20)
    assert pub_from(n, 2, "target=all&n=10&source=after")["ok"] == 10
    st = wait_received(n, {w: {"2:after:e": 10} for w in (0, 1)})
    assert st[2]["stats"]["dropped"].get("ring") is None
    for w in range(3):
        assert st[w]["stats"]["ring"]["overwritten"] == 0, w


# (pings every 0.1 s: worker 2's writer fails on the dead broker long
# before its reader gets to what it holds)
GATE = ("max_backlog = 20, slow_timeout = 0.5, heartbeat = 0.2, "
        "ring_bytes = 262144")


def close_the_gate(n):
    """Worker 2 sleeps in a handler (its inbox full) holding SHM frames
    from the broker, which is then killed; worker 1 publishes 8 rings'
    worth. Returns (states, the killed broker's pid, worker 2's pid)."""
    n.allow_log(r"exited on signal 9")
    n.allow_log(r"\((104: Connection reset by peer|32: Broken pipe)\)")
    n.allow_log(r"dropping events for worker 2")
    assert pub_from(n, 1, "target=all&n=1&source=block")["ok"] == 1
    time.sleep(0.3)
    # about a ring's worth of runs of ~21 events: worker 2 copies the
    # first into its inbox (then full) and holds the others' frames
    r = pub_from(n, 1, "target=all&n=80&size=3000&source=a")
    assert r["ok"] == 80
    wait_received(n, {0: {"1:a:e": 80}})
    st = ec.states(n)
    assert ring(st, 1)["events"] >= 60
    # (worker 2 still sleeps in its handler: else this tests nothing)
    assert st[2]["received"].get("1:a:e", 0) == 0, st[2]["received"]
    held_by = st[2]["pid"]
    broker = st[0]["pid"]
    n.kill(broker, signal.SIGKILL)
    n.wait_workers(3, exclude=[broker])
    r = pub_from(n, 1, "target=all&n=200&size=10000&source=b")
    assert r["ok"] == 200
    st = wait_received(n, {w: {"1:b:e": 200} for w in (0, 1)}, timeout=30)
    # the new broker freed none of worker 1's runs: "b" took the socket
    assert ring(st, 1)["full"] > 0, ring(st, 1)
    return st, broker, held_by


def wait_worker2_connected(n, timeout=30):
    deadline = time.time() + timeout
    while True:
        st = ec.states(n)
        q2 = st[0]["stats"]["broker"]["queues"].get("2")
        if q2 and q2["connected"]:
            return st
        assert time.time() < deadline, q2
        time.sleep(0.1)


def held_runs_read_whole(n, st, held_by):
    """Worker 2 handled what it held (80 in the runs seen; what the dead
    broker had not sent it, and what the new one dropped for it while it
    slept, are gone), though its write to the dead broker failed first."""
    assert st[2]["received"].get("1:a:e", 0) >= 60, st[2]["received"]
    assert re.search(r" %d#\d+: .*lost the broker: failed to send" % held_by,
                     n.error_log()), "worker 2's write did not fail first"
    assert st[2]["stats"]["ring"]["overwritten"] == 0, st[2]["stats"]["ring"]
    assert st[2]["order_errors"] == 0


def rings_free_again(n, st, source="c"):
    before = ring(st, 1)["events"]
    assert pub_from(n, 1, "target=all&n=100&source=" + source)["ok"] == 100
    st = wait_received(n, {w: {"1:%s:e" % source: 100} for w in range(3)})
    assert ring(st, 1)["events"] - before >= 90, ring(st, 1)


def test_a_new_broker_keeps_the_runs_a_worker_still_holds(nginx):
    """Worker 2 holds SHM frames from the broker unread (its inbox full)
    when the broker is killed. The new broker knows nothing of them: it
    keeps every run in the rings until each worker has connected to it
    (which a worker does only after reading its old connection to the
    end), so what the publisher writes meanwhile goes on the socket and
    none of those runs is written over. Then the rings are used again."""
    n = start(nginx, opts=GATE, extra_worker=BLOCK5)
    _, _, held_by = close_the_gate(n)
    st = wait_worker2_connected(n)
    held_runs_read_whole(n, st, held_by)
    rings_free_again(n, st)


def test_a_second_broker_crash_while_the_gate_is_closed(nginx):
    n = start(nginx, opts=GATE, extra_worker=BLOCK5)
    _, first, held_by = close_the_gate(n)
    pid = ec.states(n)[0]["pid"]
    assert pid != first
    n.kill(pid, signal.SIGKILL)
    n.wait_workers(3, exclude=[first, pid])
    r = pub_from(n, 1, "target=all&n=50&size=10000&source=d")
    assert r["ok"] == 50
    wait_received(n, {w: {"1:d:e": 50} for w in (0, 1)}, timeout=30)
    st = wait_worker2_connected(n)
    held_runs_read_whole(n, st, held_by)
    rings_free_again(n, st)


def test_the_holding_worker_killed_while_the_gate_is_closed(nginx):
    n = start(nginx, opts=GATE, extra_worker=BLOCK5)
    _, _, held_by = close_the_gate(n)
    n.kill(held_by, signal.SIGKILL)
    n.wait_workers(3, exclude=[held_by])
    st = wait_worker2_connected(n)
    assert st[2]["pid"] != held_by
    rings_free_again(n, st)


def test_a_reload_while_the_gate_is_closed(nginx):
    n = start(nginx, opts=GATE, extra_worker=BLOCK5)
    close_the_gate(n)
    old = n.worker_pids()
    new = n.reload()
    assert n.wait_gone(old, timeout=30)
    st = ec.wait_ready(n)
    assert all(s["pid"] in new for s in st.values())
    assert pub_from(n, 1, "target=all&n=100&source=c")["ok"] == 100
    st = wait_received(n, {w: {"1:c:e": 100} for w in range(3)})
    assert ring(st, 1)["events"] >= 90, ring(st, 1)


def wait_received(n, want, timeout=20):
    """Until every worker w has received want[w][key] events of each key
    ("publisher:source:event"); a respawned worker counts from 0."""
    deadline = time.time() + timeout
    while True:
        st = ec.states(n)
        got = {w: {k: st[w]["received"].get(k, 0) for k in keys}
               for w, keys in want.items()}
        if got == want:
            return st
        assert time.time() < deadline, (got, want)
        time.sleep(0.05)


def test_kill9_of_a_subscriber_and_of_the_broker(nginx):
    """A subscriber killed with runs for it in the ring, then the broker:
    every worker gets what was published once it was back (the respawned
    one, what its predecessor had not confirmed too), and the rings keep
    being used: nothing left them stuck full."""
    n = start(nginx)
    n.allow_log(r"exited on signal 9")
    n.allow_log(r"\((104: Connection reset by peer|32: Broken pipe)\)")
    for victim in (2, 0):
        before = ring(ec.states(n), 1)["events"]
        a, b = "1:a%d:e" % victim, "1:b%d:e" % victim
        r = pub_from(n, 1, "target=all&n=3000&source=a%d" % victim)
        assert r["ok"] == 3000
        pid = ec.states(n)[victim]["pid"]
        n.kill(pid, signal.SIGKILL)
        n.wait_workers(3, exclude=[pid])
        st = ec.wait_ready(n)
        assert st[victim]["pid"] != pid
        wait_received(n, {w: {a: 3000} for w in range(3) if w != victim})
        r = pub_from(n, 1, "target=all&n=3000&source=b%d" % victim)
        assert r["ok"] == 3000
        st = wait_received(n, {w: {b: 3000} for w in range(3)})
        assert st[victim]["received"].get(a, 0) <= 3000
        assert ring(st, 1)["events"] - before >= 3000
        for w in range(3):
            s = st[w]["stats"]
            assert s["ring"]["overwritten"] == 0, (w, s["ring"])
            # (a re-send after the broker's restart is dropped as a
            # duplicate: a handler that ran twice shows in the counts)
            assert st[w]["order_errors"] == 0
    # the new broker worker's own ring works too
    r = pub_from(n, 0, "target=all&n=1000&source=c")
    assert r["ok"] == 1000
    st = wait_received(n, {w: {"0:c:e": 1000} for w in range(3)})
    assert ring(st, 0)["events"] == 1000


@pytest.mark.parametrize("how", ["ring_bytes = false", "init_worker"])
def test_no_rings(nginx, how):
    """ring_bytes = false, or a bus made in init_worker (the rings are
    mapped before the fork): events go on the socket alone."""
    if how == "init_worker":
        http = ec.http().replace('require("events_helper").init({  })', "")
        assert "events_helper\").init(" not in http
        http = http.replace('require("events_helper").init_worker()',
                            'require("events_helper").init({}) '
                            'require("events_helper").init_worker()')
    else:
        http = ec.http(how)
    n = nginx(workers=2, http=http, server=ec.SERVER, start=False)
    # (events.new() in init_by_lua makes it)
    os.makedirs(os.path.join(n.prefix, "sock"), mode=0o700, exist_ok=True)
    n.start()
    ec.wait_ready(n)
    r = n.get("/ev/pub?target=all&n=2000").json()
    assert r["ok"] == 2000
    st = ec.wait_totals(n, {0: 2000, 1: 2000})
    for w in range(2):
        assert st[w]["stats"]["ring"] is False
        assert st[w]["order_errors"] == 0


def test_a_lone_worker_keeps_its_events_out_of_its_ring(nginx):
    """With one worker, "all" reaches its own handlers alone: nothing goes
    through the ring (it would only copy the events)."""
    n = start(nginx, workers=1)
    r = n.get("/ev/pub?target=all&n=3000&size=10000&source=trace").json()
    assert r["ok"] == 3000
    st = wait_traces(n, {0: 3000})
    assert st[0]["trace"] == list(range(1, 3001))
    assert ring(st, 0) == {"events": 0, "full": 0, "held": 0,
                           "overwritten": 0}


def ring_mappings(pid, size):
    """The process's shared anonymous mappings of that many bytes."""
    with open("/proc/%d/maps" % pid) as f:
        return sum(1 for line in f
                   if line.split()[-1:] != [] and "/dev/zero" in line
                   and (lambda a, b: int(b, 16) - int(a, 16))(
                       *line.split()[0].split("-")) == size)


def test_a_reload_maps_new_rings_and_the_master_lets_the_old_go(nginx):
    """Each reload's generation gets rings of its own; the master unmaps
    the old ones (else the pages the old workers wrote would stay
    allocated for as long as it runs)."""
    n = start(nginx, workers=2)
    size = 2 * (64 + 4 * 1024 * 1024)
    size += -size % 4096
    assert ring_mappings(n.master_pid, size) == 1
    for _ in range(3):
        r = pub_from(n, 1, "target=all&n=2000&size=1000")
        assert r["ok"] == 2000
        old = n.worker_pids()
        n.reload()
        # (until the old workers are gone, a request may still reach them)
        assert n.wait_gone(old)
        ec.wait_ready(n)
        assert ring_mappings(n.master_pid, size) == 1
        st = ec.states(n)
        for w in range(2):
            assert ring_mappings(st[w]["pid"], size) == 1
    r = pub_from(n, 1, "target=all&n=2000")
    assert r["ok"] == 2000
    st = ec.wait_totals(n, {0: 2000, 1: 2000})
    assert ring(st, 1)["events"] == 2000
