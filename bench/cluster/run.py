#!/usr/bin/env python3
"""Benchmark of resty.loom.cluster (bench-cluster).

Two nginx nodes (2 workers each) and one local redis-server, on this
machine. Node A publishes BENCH_RATE (10,000) small events/s for
BENCH_SECS (10) s to the whole cluster; node B's workers record the
publish-to-handler latency (gettimeofday in the event against the clock in
B's handler: cross-node, through Redis). Three ways, each with fresh
processes, alternated A B C A B C for REPEAT (2) rounds, medians reported:

* stream: resty.loom.cluster (XADD pipelined per worker, one XREADGROUP
  BLOCK reader per node, fan-out over resty.loom.events, XACK);
* poll1 / poll5: the baseline shaped like Kong's cluster_events: one
  ZADD per event into a sorted set scored by time (Kong's INSERT with
  `at`), rows older than 60 s removed every 10 ms tick, and on each node
  one worker reading the rows newer than its last poll every 1 s / 5 s
  (Kong's default db_update_frequency), looking back 1 s and skipping the
  rows it marked as run in a shared dict (as Kong does), and broadcasting
  them to the node's workers over the same bus in pages of 1,000.

Per run: latency p50/p99 on B (all of B's workers, 0.1 ms buckets), events
received on B against 2 x sent, Redis commands per event (INFO
commandstats delta), CPU per event (utime+stime of both nodes' workers and
redis-server over the run, per event published), and node B's requests/s
(`wrk -t1 -c50 -d5s` on a hello location) with no events against events
flowing, run in the same nginx, alternating none / events.
Results: bench/results/cluster.json (BENCH_OUT).
"""

import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import benchcli  # noqa: E402

from loomtest.nginx import Nginx  # noqa: E402
from clusterconf import Redis, lua_table  # noqa: E402

RATE = int(os.environ.get("BENCH_RATE", "10000"))
SECS = int(os.environ.get("BENCH_SECS", "10"))
REPEAT = int(os.environ.get("REPEAT", "2"))
WRK_SECS = int(os.environ.get("BENCH_WRK_SECS", "5"))
MODES = os.environ.get("BENCH_MODES", "stream,poll1,poll5").split(",")
OUT = os.environ.get("BENCH_OUT", os.path.join(ROOT, "bench", "results",
                                               "cluster.json"))


def conf(redis_port, node_id, mode):
    poll = {"stream": "nil", "poll1": "1", "poll5": "5"}[mode]
    opts = {"redis": {"host": "127.0.0.1", "port": redis_port},
            "node_id": node_id, "shm": "cluster", "max_buffer": 100000}
    return dict(http="""
    lua_shared_dict cluster 64m;
    lua_shared_dict bench 64m;
    init_by_lua_block {
        package.path = "%s/bench/cluster/lua/?.lua;" .. package.path
        require("bench_cluster").init(%s, %s, "%s")
    }
    init_worker_by_lua_block { require("bench_cluster").init_worker() }
    server {
        listen unix:$PREFIX/sock/bus.sock;
        lua_socket_buffer_size 64k;
        location / {
            content_by_lua_block { require("resty.loom.events").get():serve() }
        }
    }
""" % (ROOT, lua_table(opts), poll, mode), server="""
    location /b/ { content_by_lua_block { require("bench_cluster").handle() } }
""")


def node(redis_port, node_id, mode):
    n = Nginx(workers=2, error_log_level="warn",
              **conf(redis_port, node_id, mode))
    os.makedirs(os.path.join(n.prefix, "sock"), mode=0o700, exist_ok=True)
    return n.start()


def cpu(pids):
    total = 0
    for p in pids:
        with open("/proc/%d/stat" % p) as f:
            rest = f.read().rsplit(")", 1)[1].split()
        total += int(rest[11]) + int(rest[12])
    return total / os.sysconf("SC_CLK_TCK")


def commands(r):
    total = 0
    per = {}
    for line in r.cli("INFO", "commandstats").splitlines():
        m = re.match(r"cmdstat_(\S+):calls=(\d+)", line)
        if m and m.group(1) not in ("info",):
            per[m.group(1)] = int(m.group(2))
            total += int(m.group(2))
    return total, per


def percentile(buckets, q):
    items = sorted((float(k), v) for k, v in buckets.items())
    n = sum(v for _, v in items)
    want = q * n
    acc = 0
    for k, v in items:
        acc += v
        if acc >= want:
            return k
    return None


def busy():
    """% of all cores busy over 1 s (the noise other jobs make)."""
    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]
    t0, i0 = snap()
    time.sleep(1)
    t1, i1 = snap()
    return round(100 * (1 - (i1 - i0) / (t1 - t0)), 1)


def wrk(n):
    out = subprocess.run(["wrk", "-t1", "-c50", "-d%ds" % WRK_SECS,
                          n.url("/b/hello")], capture_output=True,
                         text=True).stdout
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    return float(m.group(1)) if m else 0.0


def run_mode(mode):
    r = Redis().start()
    a = node(r.port, "a", mode)
    b = node(r.port, "b", mode)
    res = {"mode": mode, "busy_before_pct": busy()}
    try:
        time.sleep(1.5)      # readers elected, groups made
        groups = {"a": a.worker_pids(), "b": b.worker_pids(),
                  "redis": [r.proc.pid]}
        pids = sum(groups.values(), [])
        g0 = {k: cpu(v) for k, v in groups.items()}
        c0, (k0, per0) = cpu(pids), commands(r)
        a.get("/b/pub?mode=%s&rate=%d&secs=%d"
              % ("poll" if mode != "stream" else "stream", RATE, SECS))
        wait = SECS + {"stream": 2, "poll1": 3, "poll5": 7}[mode]
        deadline = time.time() + wait + 30
        time.sleep(wait)
        expect = None
        while time.time() < deadline:
            lat = b.get("/b/lat?mode=%s" % mode).json()
            # lat clears what it returns: accumulate
            res.setdefault("buckets", {})
            for k, v in lat["buckets"].items():
                res["buckets"][k] = res["buckets"].get(k, 0) + v
            res["received"] = res.get("received", 0) + lat["n"]
            pub = a.get("/b/lat?mode=none").json()
            if pub.get("done"):
                expect = 2 * pub["sent"]
                res["sent"] = pub["sent"]
                res["failed"] = pub["failed"]
                if res["received"] >= expect:
                    break
            time.sleep(1)
        c1, (k1, per1) = cpu(pids), commands(r)
        g1 = {k: cpu(v) for k, v in groups.items()}
        sent = res.get("sent") or 1
        res["p50_ms"] = percentile(res["buckets"], 0.5)
        res["p99_ms"] = percentile(res["buckets"], 0.99)
        res["received_of_expected"] = "%d/%s" % (res["received"], expect)
        res["redis_commands_per_event"] = round((k1 - k0) / sent, 3)
        res["commands"] = {k: per1[k] - per0.get(k, 0) for k in per1
                           if per1[k] - per0.get(k, 0) > 0}
        res["cpu_us_per_event"] = round(1e6 * (c1 - c0) / sent, 2)
        res["cpu_us_per_event_by"] = {k: round(1e6 * (g1[k] - g0[k]) / sent,
                                               2) for k in groups}
        del res["buckets"]
        # gateway throughput on B: none / events, alternated
        rps = {"none": [], "events": []}
        for _ in range(2):
            rps["none"].append(wrk(b))
            a.get("/b/pub?mode=%s&rate=%d&secs=%d"
                  % ("poll" if mode != "stream" else "stream", RATE,
                     WRK_SECS + 2))
            time.sleep(1)
            rps["events"].append(wrk(b))
            time.sleep(2)
        res["rps_none"] = statistics.median(rps["none"])
        res["rps_events"] = statistics.median(rps["events"])
        res["rps_kept_pct"] = round(100 * res["rps_events"]
                                    / max(res["rps_none"], 1), 1)
        res["busy_after_pct"] = busy()
    finally:
        for n in (a, b):
            bad = n.bad_log_lines()
            if bad:
                print("node log:", "\n".join(bad[:5]), file=sys.stderr)
            try:
                n.stop()
            except RuntimeError:
                pass
            n.cleanup()
        r.cleanup()
    return res


def main():
    benchcli.parser(__doc__).parse_args()
    # per run: start-up, the events, two wrk cells and the settling
    benchcli.announce(__doc__, REPEAT * len(MODES)
                      * (SECS + 2 * WRK_SECS + 15), OUT)
    started = datetime.datetime.utcnow().isoformat() + "Z"
    runs = []
    for _ in range(REPEAT):
        for mode in MODES:
            res = run_mode(mode)
            print(json.dumps(res), flush=True)
            runs.append(res)
    summary = {}
    for mode in MODES:
        rs = [x for x in runs if x["mode"] == mode]
        summary[mode] = {k: statistics.median([x[k] for x in rs])
                         for k in ("p50_ms", "p99_ms",
                                   "redis_commands_per_event",
                                   "cpu_us_per_event", "rps_none",
                                   "rps_events", "rps_kept_pct")
                         if all(x.get(k) is not None for x in rs)}
    out = {"started": started, "rate": RATE, "secs": SECS,
           "repeat": REPEAT, "host": os.uname().nodename,
           "cores": os.cpu_count(), "note": "2 shared cores; other jobs "
           "ran at the same time (busy_*_pct: all cores, 1 s before and "
           "after each run)", "summary": summary, "runs": runs}
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
