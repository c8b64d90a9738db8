"""resty.loom.cluster through Redis Sentinel: 1 master, 1 replica, 3
Sentinels (real processes); the master is killed mid-stream, or while
cluster timers run."""

import collections
import signal
import subprocess
import threading
import time

from clusterconf import (need_sentinel, redis_factory,  # noqa: F401
                         start_node, wait_readers, publish, tally, stats,
                         runs, wait_tally, PEER_GONE)

pytestmark = need_sentinel

INTERVAL = 0.2
TTL = 0.6


def sentinel_setup(redis_factory):
    """master, replica (synced), 3 Sentinels and the cluster's redis opts"""
    master = redis_factory(aof=True)
    replica = redis_factory(aof=True, replica_of=master)
    sentinels = [redis_factory(sentinel_of=master) for _ in range(3)]
    deadline = time.time() + 15
    while "master_link_status:up" not in replica.cli("INFO",
                                                     "replication"):
        assert time.time() < deadline, "replica never synced"
        time.sleep(0.1)
    conf = {"sentinels": [{"host": "127.0.0.1", "port": s.port}
                          for s in sentinels],
            "master_name": "m", "connect_timeout": 0.2}
    return master, replica, sentinels, conf


def sentinel_lookups(sentinels, since=None):
    """Connections the Sentinels accepted: a master lookup is one
    (Sentinel has no commandstats). With since (an earlier result): those
    made since then, less the one each of these calls made."""
    total = 0
    for s in sentinels:
        for line in s.cli("INFO", "stats").splitlines():
            if line.startswith("total_connections_received:"):
                total += int(line.split(":")[1])
    return total if since is None else total - since - len(sentinels)


def wait_sentinels_agree(sentinels, master, timeout=20):
    """Until every Sentinel names `master` and knows the 2 others (they
    connect to each other again after a failover, which the lookup count
    would see)"""
    deadline = time.time() + timeout
    while True:
        ok = True
        for s in sentinels:
            addr = s.cli("SENTINEL", "get-master-addr-by-name", "m").split()
            info = s.cli("SENTINEL", "master", "m").split("\n")
            others = info[info.index("num-other-sentinels") + 1]
            ok = ok and addr[1:2] == [str(master.port)] and others == "2"
        if ok:
            return
        assert time.time() < deadline, "the Sentinels do not agree"
        time.sleep(0.2)


def replication(r):
    """INFO replication, or "" when the server closed the connection: a
    Redis that changes its role drops its clients, this one included."""
    try:
        return r.cli("INFO", "replication")
    except subprocess.CalledProcessError:
        return ""


def wait_failover(replica, since):
    while "role:master" not in replication(replica):
        assert time.time() < since + 30, "no failover"
        time.sleep(0.1)
    return time.time() - since


def test_failover_mid_stream(redis_factory, nginx):
    master, replica, sentinels, conf = sentinel_setup(redis_factory)
    nodes = [start_node(nginx, conf, "n%d" % i, when_down="queue")
             for i in range(3)]
    wait_readers(nodes)
    out = []
    t = threading.Thread(target=lambda: out.append(
        publish(nodes[0], 10000, "f", rate=1000)))
    t.start()
    time.sleep(2)
    master.stop(signal.SIGKILL)
    killed_at = time.time()
    promoted = wait_failover(replica, killed_at)   # the replica promoted
    t.join()
    assert out[0]["ok"] == 10000, out
    expect = {("f", s) for s in range(1, 10001)}
    deadline = time.time() + 60
    while True:
        res, lost, dups = tally(nodes, expect)
        # the last 3,000 events were published after the promotion: all of
        # them must arrive; earlier losses are what async replication lost
        late = {("f", s) for s in range(7001, 10001)}
        res_late, lost_late, _ = tally(nodes, late)
        if lost_late == 0 and lost == 0 or time.time() > deadline:
            break
        time.sleep(0.5)
    per_event = lost / 6
    print("failover after %.1f s; lost %d handlings (%.0f events x 6 "
          "workers), duplicates %d: %s" % (promoted, lost, per_event, dups,
                                           res))
    assert lost_late == 0, res_late
    assert dups == 0, res
    # losses, if any, are events acknowledged by the old master that had
    # not reached the replica: at most the last second or so before the kill
    assert lost <= 6 * 1000 * 3, res
    for n in nodes:
        st = stats(n)
        assert st["read_errors"] >= 1 or st["send_errors"] >= 1, st
        n.allow_log(r"\[loom.cluster\] (reader|failed to send)")
        # nginx's own line for the killed master's connection
        n.allow_log(PEER_GONE)


def command_calls(r, cmd):
    """times the server ran cmd (refused ones are counted apart)"""
    for line in r.cli("INFO", "commandstats").splitlines():
        if line.startswith("cmdstat_%s:" % cmd):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


def test_manual_failover_mid_stream_loses_nothing(redis_factory, nginx):
    """SENTINEL FAILOVER while 1,000 events/s flow: the old master is
    still up and a master until it is demoted; events written there after
    the promotion would be lost for every node that had not read them. The
    workers stop writing when the failover starts (events queue meanwhile)
    and go on with the new master: no XADD on the old master after the
    promotion, every worker handles every event once."""
    master, replica, sentinels, conf = sentinel_setup(redis_factory)
    nodes = [start_node(nginx, conf, "n%d" % i, when_down="queue")
             for i in range(3)]
    wait_readers(nodes)
    wait_sentinels_agree(sentinels, master)
    out = []
    t = threading.Thread(target=lambda: out.append(
        publish(nodes[0], 6000, "m", rate=1000)))
    t.start()
    time.sleep(2)
    sentinels[0].cli("SENTINEL", "FAILOVER", "m")
    wait_failover(replica, time.time())
    xadds = command_calls(master, "xadd")
    t.join()
    assert out[0]["ok"] == 6000, out
    expect = {("m", s) for s in range(1, 6001)}
    res, lost, dups = wait_tally(nodes, expect, timeout=30)
    late = command_calls(master, "xadd") - xadds
    print("XADDs on the old master after the promotion: %d; lost %d, "
          "duplicates %d: %s" % (late, lost, dups, res))
    assert late == 0
    assert (lost, dups) == (0, 0), res
    for n in nodes:
        # a failover is an expected state: notices only, no [error] of ours
        n.allow_log(PEER_GONE)


def timer_nodes(nginx, conf):
    """2 nodes running the cluster timer, once it has run 5 periods"""
    nodes = [start_node(nginx, conf, "n%d" % i, timer=(INTERVAL, TTL, 0))
             for i in range(2)]
    deadline = time.time() + 20
    while len(runs(nodes)) < 5:
        assert time.time() < deadline, "the timer never ran"
        time.sleep(0.1)
    return nodes


def test_timers_ask_the_sentinels_only_when_the_master_fails(
        redis_factory, nginx):
    """Cluster timers on 2 nodes x 2 workers (each worker renews or checks
    its lease every ttl/3): the master's address is asked once per worker,
    not per Redis call; a failover is followed, each period runs once."""
    master, replica, sentinels, conf = sentinel_setup(redis_factory)
    nodes = timer_nodes(nginx, conf)
    # over 20 periods, with every worker connected already
    wait_sentinels_agree(sentinels, master)
    time.sleep(1)
    before, first = sentinel_lookups(sentinels), len(runs(nodes))
    time.sleep(20 * INTERVAL)
    steady = sentinel_lookups(sentinels, before)
    ran = len(runs(nodes)) - first
    print("Sentinel lookups over %d runs: %d" % (ran, steady))
    assert ran >= 10
    assert steady == 0

    master.stop(signal.SIGKILL)
    killed_at = time.time()
    promoted = wait_failover(replica, killed_at)
    # runs on the new master: 20 periods after the failover
    after_at = time.time()
    wait_sentinels_agree(sentinels, replica)
    time.sleep(1)
    mark = sentinel_lookups(sentinels)
    time.sleep(20 * INTERVAL)
    settled = sentinel_lookups(sentinels, mark)
    all_runs = runs(nodes)
    periods = collections.Counter(p for _, p, _, _ in all_runs)
    late = sorted(p for p in periods
                  if p >= int((after_at + 1) / INTERVAL))
    print("failover after %.1f s; runs after it: %d; Sentinel lookups "
          "in the 20 periods after: %d" % (promoted, len(late), settled))
    assert [k for k, v in periods.items() if v > 1] == [], all_runs
    assert len(late) >= 15 and late == list(range(late[0], late[-1] + 1)), \
        late
    assert settled == 0
    for n in nodes:
        # the killed master's connections, and the reader's retry
        n.allow_log(r"\[loom.cluster(.timer)?\] ")
        n.allow_log(PEER_GONE)


def test_timers_never_write_to_a_demoted_master(redis_factory, nginx):
    """SENTINEL FAILOVER: the old master stays a master until the
    Sentinels demote it (about 10 s later), and what is written there after
    the promotion of the replica is lost then: a lease renewed and a period
    recorded there only made a worker of the other generation run that
    period again (seen: one period twice, epochs 1 and 2). The workers
    follow the failover and write nothing anywhere from its start until
    they know the new master: 0 EVALs on the old master after the
    promotion, no period twice, the periods after go on."""
    master, replica, sentinels, conf = sentinel_setup(redis_factory)
    nodes = timer_nodes(nginx, conf)
    wait_sentinels_agree(sentinels, master)
    sentinels[0].cli("SENTINEL", "FAILOVER", "m")
    since = time.time()
    wait_failover(replica, since)
    promoted_at = time.time()
    at_promotion = command_calls(master, "eval")
    while "role:slave" not in replication(master):
        assert time.time() < since + 30, "the master was not demoted"
        time.sleep(0.05)
    demoted_at = time.time()
    until_demotion = command_calls(master, "eval") - at_promotion
    ran_on_old = command_calls(master, "eval")
    time.sleep(1 + 20 * INTERVAL)
    after = command_calls(master, "eval") - ran_on_old
    all_runs = runs(nodes)
    periods = collections.Counter(p for _, p, _, _ in all_runs)
    late = sorted(p for p in periods if p >= int((demoted_at + 1)
                                                 / INTERVAL))
    print("promoted after %.1f s, old master demoted after %.1f s; EVALs "
          "on it between: %d, since: %d; runs after: %d"
          % (promoted_at - since, demoted_at - since, until_demotion, after,
             len(late)))
    assert until_demotion == 0
    assert after == 0
    assert [k for k, v in periods.items() if v > 1] == [], all_runs
    assert len(late) >= 15 and late == list(range(late[0], late[-1] + 1)), \
        late
    for n in nodes:
        # connections closed on the demoted master; a failover is an
        # expected state: notices only, no [error] of ours
        n.allow_log(PEER_GONE)
