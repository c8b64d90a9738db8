#!/usr/bin/env python3
"""Benchmark of resty.loom.events (bench-events).

1. The Kong scenario: nginx with 2 workers answers `ngx.say("hello")` under
   `wrk -t1 -c64 -d10s --latency` while a timer publishes events to "all":
   from worker 0 only ("one") or from every worker ("all"), at: none;
   1,000 every 0.5 s; 10,000 every 0.1 s; 50,000 every 0.1 s. The payload
   is a small Lua table that differs only in a counter. Per run: requests/s,
   p50, p99, worker CPU (utime+stime from /proc over the wrk window),
   publish calls attempted / accepted, events delivered per worker (handler
   counters, after draining until they stop changing), tick times and the
   bus's own publish-to-handler latency. With PEER_WORKER_EVENTS=<checkout
   of lua-resty-worker-events> every cell also runs with that library
   (Kong 2.8 settings), alternating A B / B A. With BENCH_FLOOR=1 every
   cell also runs as "floor": no bus at all, every worker's timer decodes,
   every interval, the events "all" delivery would give it (pre-encoded,
   same payload, one table each) and calls the same handler: what any
   in-process bus must do at least, so the best RPS a bus can reach. And
   as "floor-shm": the least an inter-worker bus must do, each poster
   encoding its events into shared memory (mapped before the fork) every
   interval and every worker decoding them from there, polling every
   millisecond: no socket, no broker, no acknowledgement.
2. The raw bus, no HTTP load: 1 and 4 workers, ~100 B and ~10 KiB payloads;
   worker 0 publishes to "all" as fast as overflow = "wait" lets it, and
   the rate is the events every worker received over the time until the
   last one had them all. Then a fresh nginx publishes at half that rate
   and reports the bus's publish-to-handler latency p50 / p99. The cost of
   one publish call (µs, in the posting worker) is measured before.

Medians of REPEAT repetitions (default 3). Results: bench/results/events.json
(override with BENCH_OUT). Other knobs: BENCH_DURATION (wrk seconds, 10),
BENCH_RAW_DURATION (2), BENCH_PARTS ("kong,raw"), BENCH_CELLS (e.g.
"one:none,one:C"), BENCH_QUIET_PCT (25) and BENCH_QUIET_MAX (60): before
each run the runner waits up to 30 s (60 s in all) for the machine to be
below that % of one core busy. `--markdown` prints the tables of an
existing results file; `--retarget` recomputes its medians and targets.
"""

import datetime
import json
import os
import platform
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HERE = os.path.join(ROOT, "bench", "events")
sys.path.insert(0, os.path.join(ROOT, "tests"))

from loomtest import nginx as loomnginx  # noqa: E402
sys.path.insert(0, os.path.join(ROOT, "bench"))
import benchcli  # noqa: E402
from loomtest.nginx import Nginx  # noqa: E402

REPEAT = int(os.environ.get("REPEAT", "3"))
DURATION = int(os.environ.get("BENCH_DURATION", "10"))
RAW_DURATION = float(os.environ.get("BENCH_RAW_DURATION", "2"))
PARTS = os.environ.get("BENCH_PARTS", "kong,raw").split(",")
PEER = os.environ.get("PEER_WORKER_EVENTS")
OUT = os.environ.get("BENCH_OUT",
                     os.path.join(ROOT, "bench", "results", "events.json"))
WARMUP = 2
LOW_RATE = 1000     # events/s for the "clearly not saturated" latency
CLK_TCK = os.sysconf("SC_CLK_TCK")

SCENARIOS = {
    "none": (0, 0.1, "none"),
    "B": (1000, 0.5, "1,000 every 0.5 s"),
    "C": (10000, 0.1, "10,000 every 0.1 s"),
    "D": (50000, 0.1, "50,000 every 0.1 s"),
}
CELLS = [("one", "none"), ("one", "B"), ("one", "C"), ("one", "D"),
         ("all", "B"), ("all", "C"), ("all", "D")]
RAW = [(1, "100"), (1, "10k"), (4, "100"), (4, "10k")]

PAYLOAD_NAMES = {"100": "~100 B", "10k": "~10 KiB"}
LIB_NAMES = {"loom": "resty.loom.events",
             "worker-events": "lua-resty-worker-events",
             "floor": "floor (decode + handler, no bus)",
             "floor-shm": "floor-shm (encode, shared memory, decode)"}
FLOOR = os.environ.get("BENCH_FLOOR") == "1"


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


# -- machine ---------------------------------------------------------------

def loadavg():
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def machine_busy():
    """(busy jiffies, total jiffies) of the whole machine."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    total = sum(v[:8])
    return total - idle, total


def proc_cpu(pid):
    """utime + stime of a process, in seconds."""
    with open("/proc/%d/stat" % pid) as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / CLK_TCK


def foreign_processes():
    """Other benchmarks or nginx instances on the machine (not ours)."""
    me = os.getpid()
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        cmd = loomnginx._cmdline(int(d))
        if cmd.startswith("wrk ") or "nginx: master" in cmd:
            found.append(cmd.strip()[:80])
    return found


def machine_info():
    info = {"cpus": os.cpu_count(), "kernel": platform.release()}
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        info["mem_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    r = subprocess.run([loomnginx.NGINX, "-v"], capture_output=True,
                       text=True)
    info["nginx"] = r.stderr.strip()
    pkgs = {}
    for p in ("libnginx-mod-http-lua", "libluajit2-5.1-2", "lua-cjson",
              "wrk"):
        r = subprocess.run(["dpkg-query", "-W", "-f=${Version}", p],
                           capture_output=True, text=True)
        if r.returncode == 0:
            pkgs[p] = r.stdout
    info["packages"] = pkgs
    return info


def peer_info():
    if not PEER:
        return None
    info = {"path": PEER}
    src = os.path.join(PEER, "lib", "resty", "worker", "events.lua")
    with open(src) as f:
        m = re.search(r"_VERSION\s*=\s*['\"]([^'\"]+)", f.read())
    info["version"] = m.group(1) if m else None
    r = subprocess.run(["git", "-C", PEER, "rev-parse", "--short", "HEAD"],
                       capture_output=True, text=True)
    if r.returncode == 0:
        info["commit"] = r.stdout.strip()
    return info


QUIET_PCT = float(os.environ.get("BENCH_QUIET_PCT", "25"))
QUIET_BUDGET = [float(os.environ.get("BENCH_QUIET_MAX", "60"))]


def wait_quiet(max_wait=30):
    """Before a run: waits (up to max_wait s, and within the whole run's
    budget BENCH_QUIET_MAX) until the machine is below QUIET_PCT % of one
    core busy over one second, i.e. other developers' jobs paused. Returns
    (seconds waited, busy % of the last sample)."""
    t0 = time.time()
    while True:
        a = machine_busy()
        time.sleep(1)
        b = machine_busy()
        busy = 100 * (b[0] - a[0]) / max(1, b[1] - a[1]) * os.cpu_count()
        waited = time.time() - t0
        if (busy < QUIET_PCT or waited >= max_wait
                or QUIET_BUDGET[0] - waited <= 0):
            QUIET_BUDGET[0] -= max(0, waited - 1)
            return round(waited, 1), round(busy, 1)
        time.sleep(1 + random.random())


# -- nginx -----------------------------------------------------------------

SERVER = """
location / {
    content_by_lua_block { ngx.say("hello") }
}
location = /_bench/stats {
    content_by_lua_block { require("bench_events").stats() }
}
location = /_bench/ctl {
    content_by_lua_block { require("bench_events").ctl() }
}
location = /_bench/status {
    stub_status;
}
"""

BUS_SERVER = """
server {
    listen unix:$PREFIX/sock/bus.sock;
    lua_socket_buffer_size 64k;
    location / {
        content_by_lua_block { require("resty.loom.events").get():serve() }
    }
}
"""


def lua_table(d):
    parts = []
    for k, v in d.items():
        if isinstance(v, bool):
            parts.append("%s = %s" % (k, "true" if v else "false"))
        elif isinstance(v, str):
            parts.append("%s = %s" % (k, json.dumps(v)))
        else:
            parts.append("%s = %r" % (k, v))
    return "{ " + ", ".join(parts) + " }"


def make_nginx(lib, workers, cfg):
    path = [os.path.join(HERE, "lua", "?.lua")]
    if lib == "worker-events":
        path.append(os.path.join(PEER, "lib", "?.lua"))
    cfg = dict(cfg, lib=lib)
    if lib == "loom":
        cfg["socket"] = "$PREFIX/sock/bus.sock"   # rendered by Nginx
    http = """
    lua_shared_dict bench_events 1m;
    %s
    init_by_lua_block {
        package.path = %s .. ";" .. package.path
        require("bench_events").init(%s)
    }
    init_worker_by_lua_block { require("bench_events").init_worker() }
    """ % ("lua_shared_dict process_events 5m;"
           if lib == "worker-events" else "",
           json.dumps(";".join(path)), lua_table(cfg))
    n = Nginx(workers=workers, http=http, server=SERVER,
              servers=BUS_SERVER if lib == "loom" else "",
              error_log_level="warn", worker_connections=4096)
    return n


def get_json(n, path, timeout=120):
    with urllib.request.urlopen(n.url(path), timeout=timeout) as r:
        return json.loads(r.read())


def ctl(n, timeout=120, **kw):
    q = "&".join("%s=%s" % kv for kv in kw.items())
    with urllib.request.urlopen(n.url("/_bench/ctl?" + q),
                                timeout=timeout) as r:
        r.read()


def stats(n, timeout=120):
    return get_json(n, "/_bench/stats", timeout)


def try_stats(n, run, stage, timeout=20):
    """Stats, or None (noted in run["stalled"]) when no worker answers in
    time: a library that blocks both workers must not stall the bench."""
    try:
        return stats(n, timeout)
    except OSError as e:
        run.setdefault("stalled", []).append("%s: %r" % (stage, e))
        return None


def wait_ready(n, timeout=15):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            st = stats(n)
            ws = st["workers"]
            if len(ws) == n.workers and all(
                    w.get("ready") == 1 for w in ws.values()):
                return st
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError("workers not ready:\n" + n.error_log()[-3000:])


def log_counts(n):
    """[error]/[warn] lines and a few distinct samples."""
    counts = {}
    for lvl in ("error", "warn", "crit", "alert"):
        r = subprocess.run(["grep", "-c", r"\[%s\]" % lvl, n.log_path],
                           capture_output=True, text=True)
        counts[lvl] = int(r.stdout.strip() or 0)
    samples = []
    r = subprocess.run(
        "grep -E '\\[(error|warn|crit|alert)\\]' %s | "
        "sed -E 's/^[0-9/: ]+//; s/[0-9]+#[0-9]+: \\*?[0-9]* ?//; "
        "s/[0-9]+/N/g' | sort | uniq -c | sort -rn | head -5"
        % n.log_path, shell=True, capture_output=True, text=True)
    for line in r.stdout.splitlines():
        samples.append(line.strip()[:300])
    return counts, samples


# -- wrk -------------------------------------------------------------------

def parse_ms(s):
    m = re.match(r"([\d.]+)(us|ms|s)", s)
    v = float(m.group(1))
    return {"us": v / 1000, "ms": v, "s": v * 1000}[m.group(2)]


def wrk(n, duration):
    out = subprocess.run(
        ["wrk", "-t1", "-c64", "-d%ds" % duration, "--latency",
         n.url("/")], capture_output=True, text=True,
        timeout=duration + 60).stdout
    res = {}
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    res["rps"] = float(m.group(1)) if m else None
    for q in ("50", "99"):
        m = re.search(r"^\s+%s%%\s+(\S+)" % q, out, re.M)
        res["p%s_ms" % q] = parse_ms(m.group(1)) if m else None
    m = re.search(r"Latency\s+\S+\s+\S+\s+(\S+)", out)
    res["max_ms"] = parse_ms(m.group(1)) if m else None
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    res["non2xx"] = int(m.group(1)) if m else 0
    m = re.search(r"Socket errors: (.*)", out)
    res["socket_errors"] = m.group(1) if m else None
    return res


# -- Kong scenario ---------------------------------------------------------

def totals(st):
    ws = st["workers"]
    att = sum(w.get("attempted") or 0 for w in ws.values())
    acc = sum(w.get("accepted") or 0 for w in ws.values())
    recv = {k: w.get("recv") or 0 for k, w in ws.items()}
    busy = any(w.get("busy") for w in ws.values())
    return att, acc, recv, busy


def drain(n, lib, timeout=60):
    """Waits until every worker got every accepted event, or until the
    counters stop changing. Returns (seconds, final stats)."""
    stable_for = 3.0 if lib == "worker-events" else 1.5
    t0 = time.time()
    last, last_change = None, time.time()
    while True:
        st = stats(n, 30)
        att, acc, recv, busy = totals(st)
        if not busy and all(v == acc for v in recv.values()):
            return time.time() - t0, st
        key = (att, acc, tuple(sorted(recv.items())))
        if key != last:
            last, last_change = key, time.time()
        elif not busy and time.time() - last_change >= stable_for:
            return last_change - t0, st
        if time.time() - t0 > timeout:
            return time.time() - t0, st
        time.sleep(0.2)


def kong_run(lib, posters, scen, rep):
    count, interval, _ = SCENARIOS[scen]
    n = make_nginx(lib, 2, {"mode": "kong", "n": count,
                            "interval": interval, "posters": posters})
    waited, busy = wait_quiet()
    run = {"lib": lib, "posters": posters, "scenario": scen, "rep": rep,
           "quiet_wait_s": waited, "busy_before_pct": busy,
           "foreign_before": foreign_processes(), "loadavg_before":
           loadavg()}
    try:
        n.start()
        wait_ready(n)
        pids = n.worker_pids()
        wrk(n, WARMUP)
        ctl(n, posting=1)
        time.sleep(1)
        s0 = try_stats(n, run, "before wrk")
        cpu0 = [proc_cpu(p) for p in pids]
        m0 = machine_busy()
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.time()
        w = wrk(n, DURATION)
        elapsed = time.time() - t0
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        m1 = machine_busy()
        cpu1 = [proc_cpu(p) for p in pids]
        s1 = try_stats(n, run, "after wrk")
        try:
            ctl(n, posting=0, timeout=20)
        except OSError as e:
            run.setdefault("stalled", []).append("stop posting: %r" % e)
        run.update(w)
        run["worker_cpu_pct"] = [round(100 * (b - a) / elapsed, 1)
                                 for a, b in zip(cpu0, cpu1)]
        run["workers_cpu_pct"] = round(sum(run["worker_cpu_pct"]), 1)
        wrk_cpu = (ru1.ru_utime + ru1.ru_stime - ru0.ru_utime
                   - ru0.ru_stime)
        run["wrk_cpu_pct"] = round(100 * wrk_cpu / elapsed, 1)
        busy_pct = 100 * (m1[0] - m0[0]) / (m1[1] - m0[1]) * os.cpu_count()
        run["machine_cpu_pct"] = round(busy_pct, 1)
        run["other_cpu_pct"] = round(
            busy_pct - run["workers_cpu_pct"] - run["wrk_cpu_pct"], 1)
        run["nominal_per_s"] = (count / interval
                                * (2 if posters == "all" else 1))
        if s0 and s1:
            a0, _, r0, _ = totals(s0)
            a1, _, r1, _ = totals(s1)
            run["attempts_per_s_during_wrk"] = round((a1 - a0) / elapsed)
            run["delivered_during_wrk"] = {k: r1[k] - r0[k] for k in r1}
        if run.get("stalled"):
            log("stalled:", run["stalled"])
            return run
        drain_s, fin = drain(n, lib)
        att, acc, recv, _ = totals(fin)
        run["attempted"] = att
        run["accepted"] = acc
        run["delivered"] = recv
        run["lost_worst_worker"] = max((att - v for v in recv.values()),
                                       default=0)
        run["drain_s"] = round(drain_s, 2)
        ws = fin["workers"].values()
        tk = sum(x.get("ticks") or 0 for x in ws)
        ts = sum(x.get("tick_sum") or 0 for x in ws)
        run["tick_ms_avg"] = round(1000 * ts / tk, 2) if tk else None
        run["tick_ms_max"] = round(1000 * max(
            (x.get("tick_max") or 0) for x in ws), 2) if tk else None
        # a floor tick handles what every poster published
        per_tick = count * (2 if lib == "floor" and posters == "all"
                            else 1)
        run["tick_us_per_event"] = (round(1e6 * ts / (tk * per_tick), 2)
                                    if tk and count else None)
        errs = {}
        for x in ws:
            for k, v in (x.get("errors") or {}).items():
                errs[k] = errs.get(k, 0) + v
        run["publish_errors"] = errs
        if lib == "loom":
            time.sleep(0.6)     # one full flush of the bus's own stats
            fin = stats(n)
            run["bus"] = {k: x.get("bus") for k, x in
                          fin["workers"].items()}
            lat = [b["latency"] for b in run["bus"].values()
                   if b and b.get("latency", {}).get("count")]
            if lat:
                run["bus_latency_p50_ms"] = round(1000 * max(
                    x["p50"] for x in lat), 3)
                run["bus_latency_p99_ms"] = round(1000 * max(
                    x["p99"] for x in lat), 3)
    except Exception as e:  # noqa: BLE001
        run["error"] = repr(e)
        try:
            ctl(n, posting=0, timeout=20)
        except OSError:
            pass
    finally:
        run["loadavg_after"] = loadavg()
        try:
            n.stop()
        except Exception as e:  # noqa: BLE001
            run["stop_error"] = str(e)
        run["log_lines"], run["log_samples"] = log_counts(n)
        n.cleanup()
    run["foreign_after"] = foreign_processes()
    log("kong %-13s %-3s %-4s rep %d: %s rps, p99 %s ms, cpu %s, "
        "att %s acc %s recv %s, drain %s s, tick %s ms, other cpu %s%%, "
        "busy before %s%%" % (
            lib, posters, scen, rep, run.get("rps"), run.get("p99_ms"),
            run.get("worker_cpu_pct"), run.get("attempted"),
            run.get("accepted"), run.get("delivered"), run.get("drain_s"),
            run.get("tick_ms_avg"), run.get("other_cpu_pct"),
            run.get("busy_before_pct")))
    return run


# -- raw bus ---------------------------------------------------------------

def raw_run(workers, size, mode, rate=None, label=None):
    cfg = {"mode": mode, "payload": size, "duration": RAW_DURATION,
           "stamp": mode == "sat"}
    if rate:
        cfg["rate"] = rate
    n = make_nginx("loom", workers, cfg)
    waited, busy = wait_quiet(10)
    res = {"workers": workers, "payload": size, "mode": label or mode,
           "quiet_wait_s": waited, "busy_before_pct": busy,
           "loadavg_before": loadavg()}
    try:
        n.start()
        wait_ready(n)
        pids = n.worker_pids()
        cpu0 = [proc_cpu(p) for p in pids]
        m0 = machine_busy()
        t0 = time.time()
        ctl(n, go=1)
        deadline = time.time() + RAW_DURATION + 60
        while True:
            time.sleep(0.2)
            st = stats(n)
            w0 = st["workers"]["0"]
            acc = w0.get("accepted") or 0
            if w0.get("ended") and all(
                    (w.get("recv") or 0) >= acc
                    for w in st["workers"].values()):
                break
            if time.time() > deadline:
                res["timeout"] = True
                break
        time.sleep(1.2)    # one full flush of the bus stats
        st = stats(n)
        elapsed = time.time() - t0
        cpu1 = [proc_cpu(p) for p in pids]
        m1 = machine_busy()
        ws = st["workers"]
        w0 = ws["0"]
        res["attempted"] = w0.get("attempted")
        res["accepted"] = w0.get("accepted")
        res["delivered"] = {k: w.get("recv") for k, w in ws.items()}
        res["publish_errors"] = w0.get("errors")
        res["worker_cpu_s"] = [round(b - a, 2) for a, b in zip(cpu0, cpu1)]
        res["machine_cpu_pct"] = round(
            100 * (m1[0] - m0[0]) / (m1[1] - m0[1]) * os.cpu_count(), 1)
        res["elapsed_s"] = round(elapsed, 2)
        if mode == "sat":
            base = st.get("sat_base") or 0
            sent = (w0.get("accepted") or 0) - base
            last = max(w.get("recv_at") or 0 for w in ws.values())
            res["cost_us_per_publish"] = round(w0.get("cost_us") or 0, 3)
            res["sat_events"] = sent
            res["publish_window_s"] = round(w0["ended"] - w0["started"], 3)
            res["all_delivered_after_s"] = round(last - w0["started"], 3)
            res["events_per_s"] = round(sent / (last - w0["started"]))
        else:
            lat = []
            for w in ws.values():
                b = w.get("bus") or {}
                if b.get("latency", {}).get("count"):
                    lat.append(b["latency"])
            res["rate"] = rate
            res["achieved_per_s"] = round(
                (w0.get("accepted") or 0)
                / max(1e-9, (w0.get("ended") or 0) - (w0.get("started")
                                                      or 0)))
            res["latency_per_worker"] = lat
            if lat:
                res["p50_ms"] = round(1000 * statistics.median(
                    x["p50"] for x in lat), 3)
                res["p99_ms"] = round(1000 * max(x["p99"] for x in lat), 3)
                res["max_ms"] = round(1000 * max(x["max"] for x in lat), 3)
        res["bus"] = {k: w.get("bus") for k, w in ws.items()}
    finally:
        res["loadavg_after"] = loadavg()
        try:
            n.stop()
        except Exception as e:  # noqa: BLE001
            res["stop_error"] = str(e)
        res["log_lines"], res["log_samples"] = log_counts(n)
        n.cleanup()
    log("raw %s w=%d %-4s: %s" % (label or mode, workers, size, {
        k: res.get(k) for k in ("events_per_s", "cost_us_per_publish",
                                "achieved_per_s", "p50_ms", "p99_ms",
                                "delivered", "accepted")}))
    return res


# -- aggregation -----------------------------------------------------------

def med(vals):
    vals = [v for v in vals if v is not None]
    return round(statistics.median(vals), 3) if vals else None


def kong_medians(runs):
    out = []
    keys = []
    for r in runs:
        k = (r["posters"], r["scenario"], r["lib"])
        if k not in keys:
            keys.append(k)
    for posters, scen, lib in keys:
        cell = [r for r in runs if (r["posters"], r["scenario"], r["lib"])
                == (posters, scen, lib)]
        rs = [r for r in cell if r.get("rps") is not None]
        full = [r for r in rs if r.get("attempted") is not None]
        failed = [r.get("error") or r.get("stalled") or r.get("skipped")
                  for r in cell if r not in full]
        if not rs:
            out.append({"posters": posters, "scenario": scen, "lib": lib,
                        "runs": 0, "failed_runs": len(failed),
                        "failures": failed})
            continue
        m = {"posters": posters, "scenario": scen, "lib": lib,
             "runs": len(rs), "complete_runs": len(full),
             "failed_runs": len(failed)}
        if failed:
            m["failures"] = failed
        for f in ("rps", "p50_ms", "p99_ms", "workers_cpu_pct",
                  "wrk_cpu_pct", "other_cpu_pct", "attempts_per_s_during_wrk",
                  "nominal_per_s", "tick_ms_avg", "tick_ms_max",
                  "tick_us_per_event", "drain_s", "bus_latency_p50_ms",
                  "bus_latency_p99_ms"):
            m[f] = med(r.get(f) for r in rs)
        rs = full
        # (the decode floor has no delivery: each worker's timer decodes
        # on its own grid, and its counts stop where its last tick did)
        if scen != "none" and rs and m["lib"] != "floor":
            m["delivered_pct_of_attempted_worst"] = med(
                100 * min(r["delivered"].values()) / r["attempted"]
                if r["attempted"] else None for r in rs)
            m["accepted_pct"] = med(100 * r["accepted"] / r["attempted"]
                                    if r["attempted"] else None for r in rs)
            m["lost_worst_worker"] = med(r["lost_worst_worker"] for r in rs)
            m["all_delivered_runs"] = sum(
                1 for r in rs if r["attempted"] and all(
                    v == r["attempted"] for v in r["delivered"].values()))
        m["error_log_lines"] = med(r["log_lines"]["error"] for r in rs)
        out.append(m)
    # RPS relative to the same library's no-event run
    base = {m["lib"]: m["rps"] for m in out if m["scenario"] == "none"}
    for m in out:
        if base.get(m["lib"]) and m.get("rps"):
            m["rps_pct_of_none"] = round(100 * m["rps"] / base[m["lib"]], 1)
    # the same, per repetition (a run against the none run of its own
    # repetition and library: the drift of a noisy host cancels better)
    rbase = {(r["lib"], r["rep"]): r["rps"] for r in runs
             if r["scenario"] == "none" and r.get("rps")}
    for m in out:
        pct = [100 * r["rps"] / rbase[(r["lib"], r["rep"])] for r in runs
               if (r["posters"], r["scenario"], r["lib"]) == (
                   m["posters"], m["scenario"], m["lib"])
               and r.get("rps") and rbase.get((r["lib"], r["rep"]))]
        if pct and m["scenario"] != "none":
            m["rps_pct_of_none_per_rep"] = [round(v, 1) for v in pct]
            m["rps_pct_of_none_rep_median"] = round(
                statistics.median(pct), 1)
    return out


def raw_medians(runs):
    out = []
    for workers, size in RAW:
        sat = [r for r in runs if r["mode"] == "sat"
               and (r["workers"], r["payload"]) == (workers, size)
               and r.get("events_per_s")]
        lat = [r for r in runs if r["mode"] == "lat"
               and (r["workers"], r["payload"]) == (workers, size)]
        low = [r for r in runs if r["mode"] == "lat_low"
               and (r["workers"], r["payload"]) == (workers, size)]
        if not sat:
            continue
        out.append({
            "workers": workers, "payload": size, "runs": len(sat),
            "events_per_s": med(r["events_per_s"] for r in sat),
            "all_delivered_runs": sum(1 for r in sat if all(
                v == r["accepted"] for v in r["delivered"].values())
                and r["accepted"] == r["attempted"]),
            "cost_us_per_publish": med(r["cost_us_per_publish"]
                                       for r in sat),
            "latency_rate": med(r["rate"] for r in lat),
            "latency_p50_ms": med(r.get("p50_ms") for r in lat),
            "latency_p99_ms": med(r.get("p99_ms") for r in lat),
            "latency_all_delivered_runs": sum(1 for r in lat if all(
                v == r["accepted"] for v in r["delivered"].values())
                and r["accepted"] == r["attempted"]),
            "low_rate": LOW_RATE if low else None,
            "low_rate_p50_ms": med(r.get("p50_ms") for r in low),
            "low_rate_p99_ms": med(r.get("p99_ms") for r in low),
        })
    return out


def targets(kong, raw):
    def cell(posters, scen, lib):
        for m in kong:
            if (m["posters"], m["scenario"], m["lib"]) == (
                    posters, scen, lib) and m["runs"]:
                return m
        return None

    res = []
    for posters in ("one", "all"):
        c = cell(posters, "C", "loom")
        if c:
            ok_del = c.get("all_delivered_runs") == c["runs"]
            res.append({
                "target": "10,000 / 0.1 s (%s posting): every event "
                          "delivered, RPS >= 85%% of none, p99 < 10 ms"
                          % posters,
                "delivered_all_runs": ok_del,
                "rps_pct_of_none": c.get("rps_pct_of_none"),
                "p99_ms": c["p99_ms"],
                "publisher_rate_pct_of_nominal": round(
                    100 * c["attempts_per_s_during_wrk"]
                    / c["nominal_per_s"], 1),
                "met": bool(ok_del and (c.get("rps_pct_of_none") or 0) >= 85
                            and c["p99_ms"] < 10),
            })
        d = cell(posters, "D", "loom")
        if d:
            peer = cell(posters, "D", "worker-events")
            ok_del = d.get("all_delivered_runs") == d["runs"]
            ratio = None
            if peer and peer.get("rps"):
                ratio = round(d["rps"] / peer["rps"], 2)
            elif peer and peer.get("rps") == 0 and d["rps"]:
                ratio = "inf"    # the peer served no request at all
            res.append({
                "target": "50,000 / 0.1 s (%s posting): every event "
                          "delivered, RPS >= 2x lua-resty-worker-events"
                          % posters,
                "delivered_all_runs": ok_del,
                "rps": d["rps"],
                "peer_rps": peer["rps"] if peer else None,
                "rps_ratio": ratio,
                "publisher_rate_pct_of_nominal": round(
                    100 * d["attempts_per_s_during_wrk"]
                    / d["nominal_per_s"], 1),
                "met": bool(ok_del and ratio is not None and (
                    ratio == "inf" or ratio >= 2)) if peer else None,
            })
    # issue 27 ("the loop tax"): closer to a worker doing nothing extra
    for posters, scen, pct, p99 in (("one", "C", 95, 20), ("one", "D", 85,
                                                            None),
                                    ("all", "C", 92, None)):
        c = cell(posters, scen, "loom")
        if not c:
            continue
        ok_del = c.get("all_delivered_runs") == c["runs"]
        f = cell(posters, scen, "floor")
        if f:
            # the goal next to what no in-process bus can beat here
            res.append({
                "target": "issue 27 floor: %s (%s posting): decode + "
                          "handler only, no bus" % (SCENARIOS[scen][2],
                                                    posters),
                "goal_pct": pct,
                "floor_pct_of_none_rep_median": f.get(
                    "rps_pct_of_none_rep_median"),
                "floor_shm_pct_of_none_rep_median": (cell(
                    posters, scen, "floor-shm") or {}).get(
                    "rps_pct_of_none_rep_median"),
                "loom_pct_of_none_rep_median": c.get(
                    "rps_pct_of_none_rep_median"),
                "met": None,
            })
        t = {
            "target": "issue 27: %s (%s posting): RPS >= %d%% of none%s, "
                      "100%% delivered" % (
                          SCENARIOS[scen][2], posters, pct,
                          ", bus p99 <= %d ms" % p99 if p99 else ""),
            "delivered_all_runs": ok_del,
            "rps_pct_of_none": c.get("rps_pct_of_none"),
        }
        met = ok_del and (c.get("rps_pct_of_none") or 0) >= pct
        if p99:
            t["bus_p99_ms"] = c.get("bus_latency_p99_ms")
            met = met and t["bus_p99_ms"] is not None \
                and t["bus_p99_ms"] <= p99
        t["met"] = bool(met)
        res.append(t)
    for r in raw:
        res.append({
            "target": "publish-to-handler p99 < 1 ms when not saturated "
                      "(raw, %d worker(s), %s payload, at half the "
                      "saturated rate)" % (r["workers"],
                                           PAYLOAD_NAMES[r["payload"]]),
            "p99_ms": r["latency_p99_ms"],
            "met": r["latency_p99_ms"] is not None
            and r["latency_p99_ms"] < 1,
        })
    for r in raw:
        if r.get("low_rate_p99_ms") is None:
            continue
        res.append({
            "target": "publish-to-handler p99 < 1 ms when not saturated "
                      "(raw, %d worker(s), %s payload, at %d events/s)"
                      % (r["workers"], PAYLOAD_NAMES[r["payload"]],
                         r["low_rate"]),
            "p99_ms": r["low_rate_p99_ms"],
            "met": r["low_rate_p99_ms"] < 1,
        })
    b = cell("one", "B", "loom")
    if b and b.get("bus_latency_p99_ms") is not None:
        res.append({
            "target": "publish-to-handler p99 < 1 ms when not saturated "
                      "(Kong scenario B, 2,000 events/s under wrk)",
            "p99_ms": b["bus_latency_p99_ms"],
            "met": b["bus_latency_p99_ms"] < 1,
        })
    return res


# -- markdown --------------------------------------------------------------

def fmt(v, nd=0):
    if v is None:
        return "-"
    if isinstance(v, (int, float)):
        return "{:,.{}f}".format(v, nd)
    return str(v)


def markdown(data):
    lines = []
    kong = data.get("kong", {}).get("medians", [])
    if kong:
        lines.append("| posters | scenario | library | req/s | % of none "
                     "| p50 ms | p99 ms | workers CPU % | publish attempts/s "
                     "(nominal) | accepted | delivered / attempted (worst "
                     "worker) | runs all delivered | tick µs/event | "
                     "tick ms avg / max | bus p99 ms | drain s |")
        lines.append("|" + "---|" * 16)
        for m in kong:
            sc = SCENARIOS[m["scenario"]][2]
            if not m["runs"]:
                lines.append("| %s | %s | %s | all %d run(s) failed: %s |"
                             % (m["posters"], sc, LIB_NAMES[m["lib"]],
                                m["failed_runs"], "; ".join(
                                    str(f)[:80] for f in m["failures"])))
                continue
            lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s "
                         "| %s | %s | %s | %s | %s | %s |" % (
                             m["posters"], sc, LIB_NAMES[m["lib"]],
                             fmt(m["rps"]), fmt(m.get("rps_pct_of_none"), 0),
                             fmt(m["p50_ms"], 2), fmt(m["p99_ms"], 2),
                             fmt(m["workers_cpu_pct"]),
                             "-" if m["scenario"] == "none" else "%s (%s)" % (
                                 fmt(m["attempts_per_s_during_wrk"]),
                                 fmt(m["nominal_per_s"])),
                             fmt(m.get("accepted_pct"), 1) + "%"
                             if m.get("accepted_pct") is not None else "-",
                             fmt(m.get("delivered_pct_of_attempted_worst"),
                                 1) + "%" if m.get(
                                     "delivered_pct_of_attempted_worst")
                             is not None else "-",
                             "-" if m["scenario"] == "none"
                             or m["lib"] == "floor" else "%d/%d" % (
                                 m.get("all_delivered_runs", 0), m["runs"]),
                             fmt(m["tick_us_per_event"], 2),
                             "-" if m["tick_ms_avg"] is None else "%s / %s" % (
                                 fmt(m["tick_ms_avg"], 1),
                                 fmt(m["tick_ms_max"], 0)),
                             fmt(m.get("bus_latency_p99_ms"), 2),
                             fmt(m["drain_s"], 1)))
    raw = data.get("raw", {}).get("medians", [])
    if raw:
        lines.append("")
        lines.append("| workers | payload | events/s delivered to every "
                     "worker | runs all delivered | publish µs/call | "
                     "latency at events/s | p50 ms | p99 ms | p50 / p99 ms "
                     "at %s/s |" % fmt(LOW_RATE))
        lines.append("|" + "---|" * 9)
        for r in raw:
            lines.append("| %d | %s | %s | %d/%d | %s | %s | %s | %s | %s |"
                         % (
                r["workers"], "~100 B" if r["payload"] == "100"
                else "~10 KiB", fmt(r["events_per_s"]),
                r["all_delivered_runs"], r["runs"],
                fmt(r["cost_us_per_publish"], 2), fmt(r["latency_rate"]),
                fmt(r["latency_p50_ms"], 3), fmt(r["latency_p99_ms"], 3),
                "-" if r.get("low_rate_p99_ms") is None else "%s / %s" % (
                    fmt(r["low_rate_p50_ms"], 3),
                    fmt(r["low_rate_p99_ms"], 3))))
    fl = [m for m in kong if m["lib"] == "floor" and m["scenario"] != "none"]
    if fl:
        lines.append("")
        lines.append("| posters | scenario | goal % of none | floor % of "
                     "none | floor-shm % of none | resty.loom.events % of "
                     "none | loom - floor (points) | loom - floor-shm "
                     "(points) | floor tick µs/event | loom publish "
                     "tick µs/event |")
        lines.append("|" + "---|" * 10)
        for f in fl:
            lo = next((m for m in kong if m["lib"] == "loom" and (
                m["posters"], m["scenario"]) == (f["posters"],
                                                 f["scenario"])), {})
            goal = {("one", "C"): 95, ("one", "D"): 85,
                    ("all", "C"): 92}.get((f["posters"], f["scenario"]))
            sh = next((m for m in kong if m["lib"] == "floor-shm" and (
                m["posters"], m["scenario"]) == (f["posters"],
                                                 f["scenario"])), {})
            a = f.get("rps_pct_of_none_rep_median")
            b = lo.get("rps_pct_of_none_rep_median")
            c = sh.get("rps_pct_of_none_rep_median")

            def pct(m, v):
                return "%s (%s)" % (fmt(v, 1), ", ".join(
                    fmt(x, 1) for x in m.get("rps_pct_of_none_per_rep",
                                             [])))

            def diff(x, y):
                return fmt(x - y, 1) if x is not None and y is not None \
                    else "-"
            lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |"
                         % (f["posters"], SCENARIOS[f["scenario"]][2],
                            fmt(goal), pct(f, a), pct(sh, c), pct(lo, b),
                            diff(b, a), diff(b, c),
                            fmt(f.get("tick_us_per_event"), 2),
                            fmt(lo.get("tick_us_per_event"), 2)))
    tg = data.get("targets", [])
    if tg:
        lines.append("")
        lines.append("| target | measured | met |")
        lines.append("|---|---|---|")
        for t in tg:
            meas = ", ".join("%s=%s" % (k, v) for k, v in t.items()
                             if k not in ("target", "met"))
            met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
            lines.append("| %s | %s | %s |" % (t["target"], meas, met))
    return "\n".join(lines)


# -- main ------------------------------------------------------------------

def main():
    ap = benchcli.parser(__doc__)
    ap.add_argument("--markdown", action="store_true",
                    help="print the tables of the results file and exit")
    ap.add_argument("--retarget", action="store_true",
                    help="recompute the medians and targets of the results "
                         "file, print its tables and exit")
    args = ap.parse_args()
    if args.markdown:
        with open(OUT) as f:
            print(markdown(json.load(f)))
        return
    if args.retarget:
        # recomputes medians and targets of an existing results file
        with open(OUT) as f:
            data = json.load(f)
        if "kong" in data:
            data["kong"]["medians"] = kong_medians(data["kong"]["runs"])
        if "raw" in data:
            data["raw"]["medians"] = raw_medians(data["raw"]["runs"])
        data["targets"] = targets(data.get("kong", {}).get("medians", []),
                                  data.get("raw", {}).get("medians", []))
        with open(OUT + ".tmp", "w") as f:
            json.dump(data, f, indent=1)
        os.replace(OUT + ".tmp", OUT)
        print(markdown(data))
        return
    if not os.path.exists(loomnginx.LOOM_MODULE):
        subprocess.run(["make", "-C", ROOT, "build"], check=True)
    if not shutil.which("wrk"):
        sys.exit("wrk is not installed")
    if PEER and not os.path.exists(os.path.join(
            PEER, "lib", "resty", "worker", "events.lua")):
        sys.exit("PEER_WORKER_EVENTS=%s has no lib/resty/worker/events.lua"
                 % PEER)
    libs = (["loom"] + (["worker-events"] if PEER else [])
            + (["floor", "floor-shm"] if FLOOR else []))
    cells = CELLS
    if os.environ.get("BENCH_CELLS"):
        cells = [tuple(c.split(":"))
                 for c in os.environ["BENCH_CELLS"].split(",")]
    # per run: start-up, warm-up, wrk, draining; raw: 3 runs per cell
    benchcli.announce(__doc__, REPEAT * (
        ("kong" in PARTS) * len(cells) * len(libs) * (DURATION + WARMUP + 8)
        + ("raw" in PARTS) * len(RAW) * (3 * RAW_DURATION + 12)), OUT)

    started = datetime.datetime.now(datetime.timezone.utc)
    data = {
        "benchmark": "resty.loom.events (bench/events/run.py)",
        "started": started.isoformat(timespec="seconds"),
        "machine": machine_info(),
        "peer": peer_info(),
        "params": {"repeat": REPEAT, "wrk": "wrk -t1 -c64 -d%ds --latency"
                   % DURATION, "warmup_s": WARMUP, "raw_duration_s":
                   RAW_DURATION, "workers_kong": 2,
                   "loom_options": {"overflow": "wait", "wait_timeout": 5,
                                    "max_queue": "default (100000)"},
                   "peer_options": "shm process_events 5m, timeout 5, "
                   "interval 1, wait_interval 0.010, wait_max 0.5 "
                   "(Kong 2.8)",
                   "payload_kong": "Lua table of 7 fields (~100 B "
                   "serialised), differing only in a counter",
                   "floor": "no bus; every worker's timer decodes, every "
                   "interval, n events per poster from pre-encoded "
                   "string.buffer bytes (source, event, data: one table "
                   "each) and calls the counting handler; no yield inside "
                   "a tick; the posters' encode cost is not included"
                   if FLOOR else None,
                   "floor_shm": "no bus; every interval each poster "
                   "encodes its n events (string.buffer) and copies them "
                   "into shared memory mapped before the fork, and every "
                   "worker, polling every ms, decodes each poster's new "
                   "events from there and calls the counting handler"
                   if FLOOR else None},
        "loadavg_start": loadavg(),
        "foreign_processes_start": foreign_processes(),
    }
    log("machine", data["machine"], "load", data["loadavg_start"])

    if "kong" in PARTS:
        runs = []
        stalled = set()
        for rep in range(1, REPEAT + 1):
            for i, (posters, scen) in enumerate(cells):
                order = libs if (rep + i) % 2 == 0 else libs[::-1]
                for lib in order:
                    if (lib, posters, scen) in stalled:
                        log("skipping", lib, posters, scen, "rep", rep,
                            "(stalled before)")
                        runs.append({"lib": lib, "posters": posters,
                                     "scenario": scen, "rep": rep,
                                     "skipped": "stalled in an earlier "
                                     "repetition; not repeated"})
                        continue
                    try:
                        r = kong_run(lib, posters, scen, rep)
                        runs.append(r)
                        if r.get("stalled") and lib != "loom":
                            stalled.add((lib, posters, scen))
                    except Exception as e:  # noqa: BLE001
                        log("run failed:", lib, posters, scen, rep, e)
                        runs.append({"lib": lib, "posters": posters,
                                     "scenario": scen, "rep": rep,
                                     "error": str(e)})
        data["kong"] = {"runs": runs, "medians": kong_medians(runs)}

    if "raw" in PARTS:
        runs = []
        for rep in range(1, REPEAT + 1):
            order = RAW if rep % 2 else RAW[::-1]
            for workers, size in order:
                try:
                    s = raw_run(workers, size, "sat")
                    s["rep"] = rep
                    runs.append(s)
                    if s.get("events_per_s"):
                        r = raw_run(workers, size, "lat",
                                    rate=max(1, s["events_per_s"] // 2))
                        r["rep"] = rep
                        runs.append(r)
                    if size == "100":
                        r = raw_run(workers, size, "lat", rate=LOW_RATE,
                                    label="lat_low")
                        r["rep"] = rep
                        runs.append(r)
                except Exception as e:  # noqa: BLE001
                    log("raw run failed:", workers, size, rep, e)
                    runs.append({"workers": workers, "payload": size,
                                 "mode": "error", "rep": rep,
                                 "error": str(e)})
        data["raw"] = {"runs": runs, "medians": raw_medians(runs)}

    data["targets"] = targets(data.get("kong", {}).get("medians", []),
                              data.get("raw", {}).get("medians", []))
    data["finished"] = datetime.datetime.now(
        datetime.timezone.utc).isoformat(timespec="seconds")
    data["loadavg_end"] = loadavg()
    others = [r.get("other_cpu_pct") for r in
              data.get("kong", {}).get("runs", [])
              if r.get("other_cpu_pct") is not None]
    data["note"] = (
        "Measured on a shared 2-core machine: nginx workers and wrk share "
        "the 2 cores, and other developers' jobs (builds, tests, "
        "benchmarks) were running at the same time. Load average at start "
        "%s, at end %s; CPU used by other processes during the wrk windows: "
        "median %s%%, max %s%% of one core. Figures are noisy; compare "
        "libraries and scenarios measured in the same run, not with other "
        "machines." % (" ".join(data["loadavg_start"]),
                       " ".join(data["loadavg_end"]),
                       med(others), max(others) if others else None))
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(OUT + ".tmp", OUT)
    print(markdown(data))
    log("wrote", OUT)


if __name__ == "__main__":
    random.seed()
    main()
