"""resty.loom.cluster through Redis Sentinel: 1 master, 1 replica, 3
Sentinels (real processes); the master is killed mid-stream."""

import signal
import threading
import time

from clusterconf import (need_sentinel, redis_factory,  # noqa: F401
                         start_node, wait_readers, publish, tally, stats)

pytestmark = need_sentinel


def test_failover_mid_stream(redis_factory, nginx):
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
    # the Sentinels promote the replica
    while "role:master" not in replica.cli("INFO", "replication"):
        assert time.time() < killed_at + 30, "no failover"
        time.sleep(0.1)
    promoted = time.time() - killed_at
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
        n.allow_log(r"recv\(\) failed \(104: Connection reset by peer\)")
