#!/usr/bin/env python3
"""The events bus's broker as workers are added: 4, 8 and 16 nginx workers.

One nginx per run, no HTTP load; a timer publishes events to "all" at a
fixed total rate (SCALE_N events every SCALE_INTERVAL s), either from one
worker ("one": worker 1, so that the broker, worker 0, does not publish)
or from every worker ("all": SCALE_N / workers each, the broker too). Each
event reaches every worker's handler, so deliveries per second grow with
the workers while the broker's work per delivery should not.

Per run, over a window of SCALE_SECONDS (8) once posting has settled:
  - broker µs CPU per delivery: the broker worker's utime + stime (summed
    over its threads, /proc/<pid>/task/*/stat; also its schedstat, in ns)
    divided by the events every worker's handlers ran in the window (the
    broker worker's own handlers and, in "all", its publishes included);
  - % delivered: after a drain, handler runs over accepted events times
    workers (every worker gets every event, its publisher included);
  - publish-to-handler p99: the bus's own histogram, worst worker.
The workers oversubscribe the host's cores at 8 and 16: the CPU figure is
a cost, the p99 there says more about the host than the bus.

Runs alternate the worker counts (4, 8, 16, 4, 8, 16, ...) for REPEAT (3)
reps per scenario; medians. With SCALE_CHECKOUTS="DIR DIR ..." (other
checkouts of resty-loom with their module built, e.g. a baseline), each
cell runs once per checkout, in A B / B A order by rep, each checkout with
its own harness. Results: bench/results/events-scale.json (BENCH_OUT).
Knobs: SCALE_WORKERS ("4,8,16"), SCALE_POSTERS ("one,all"), SCALE_N (1000),
SCALE_INTERVAL (0.1), SCALE_SECONDS (8), REPEAT (3). SCALE_PROFILE (a jit.p
mode, e.g. "Fi1m0") samples the broker over the window and adds a
per-stage breakdown in µs per delivery: read, parse, route, write, acks,
and the broker worker's own client (its handlers, its publishing).
`--markdown` prints the tables of an existing results file.
"""

import datetime
import glob
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import run  # noqa: E402  (the events bench: its nginx harness, helpers)
import benchcli  # noqa: E402
from cost import load_runner  # noqa: E402

ROOT = run.ROOT
WORKERS = [int(x) for x in
           os.environ.get("SCALE_WORKERS", "4,8,16").split(",")]
POSTERS = os.environ.get("SCALE_POSTERS", "one,all").split(",")
N = int(os.environ.get("SCALE_N", "1000"))
INTERVAL = float(os.environ.get("SCALE_INTERVAL", "0.1"))
SECONDS = float(os.environ.get("SCALE_SECONDS", "8"))
REPEAT = int(os.environ.get("REPEAT", "3"))
OUT = os.environ.get("BENCH_OUT", os.path.join(
    ROOT, "bench", "results", "events-scale.json"))
# jit.p's mode, e.g. "Fi1m0" (by function, 1 ms, every function listed)
PROFILE = os.environ.get("SCALE_PROFILE")
BROKER = 0
POSTER = 1      # "one": not the broker


def threads_cpu(pid):
    """utime + stime of every thread of a process, in seconds."""
    total = 0
    for path in glob.glob("/proc/%d/task/*/stat" % pid):
        try:
            with open(path) as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue    # (a thread that ended meanwhile)
        total += int(rest[11]) + int(rest[12])
    return total / run.CLK_TCK


def threads_ns(pid):
    """Time on CPU of every thread of a process (schedstat), in seconds:
    finer than the stat's jiffies."""
    total = 0
    for path in glob.glob("/proc/%d/task/*/schedstat" % pid):
        try:
            with open(path) as f:
                total += int(f.read().split()[0])
        except OSError:
            continue
    return total / 1e9


def with_profiler(n, out):
    """jit.p (mode PROFILE) in the broker over the measured window."""
    with open(n.conf_path) as f:
        conf = f.read()
    hook = 'require("bench_events").init_worker()'
    conf = conf.replace(hook, hook + ' require("scale_prof").start(%d, %s, '
                        '%g, %g, %s)' % (BROKER, json.dumps(PROFILE), 1.5,
                                         SECONDS, json.dumps(out)))
    with open(n.conf_path, "w") as f:
        f.write(conf)


# jit.p's "file:function" lines, by stage of the broker's work
STAGES = [
    ("read", ("broker_reader.lua:reader", "broker_lane.lua")),
    ("parse", ("broker_reader.lua:consume", "frame.lua:peek",
               "frame.lua:collect", "frame.lua:seq", "frame.lua:check_")),
    ("route", ("broker_route.lua", "frame.lua:put_chunked",
               "frame.lua:put_header", "frame.lua:put_trailer",
               "broker_queue.lua", "fifo.lua:push")),
    ("write", ("broker_writer.lua", "frame.lua:whole_frames",
               "ring.lua:push", "ring.lua:lower", "semaphore.lua")),
    ("acks", ("broker_acks.lua", "ring.lua", "fifo.lua",
              "frame.lua:put_empty")),
    # (the broker worker's own client: its handlers, and in "all" its
    # publishing)
    ("own worker", ("receive.lua", "dispatch.lua", "frame.lua:decode",
                      "bench_events.lua:on_event", "lane.lua",
                      "events.lua", "client.lua", "own.lua")),
]


def named(where, root):
    """jit.p names a function defined as a field (function _M.x) by its
    file and line: the name from the source, when it is ours."""
    f, _, line = where.partition(":")
    if not line.isdigit():
        return where
    for d in ("lib/resty/loom/events", "lib/resty/loom", "bench/events/lua"):
        path = os.path.join(root, d, f)
        if os.path.exists(path):
            with open(path) as src:
                text = src.readlines()[int(line) - 1]
            m = re.search(r"function\s+[\w.:]*?(\w+)\s*\(", text)
            return "%s:%s" % (f, m.group(1)) if m else where
    return where


def stages(path, root):
    """% of jit.p's samples per stage ("other": the rest, e.g. the
    harness's stats flush)."""
    out = {name: 0.0 for name, _ in STAGES}
    out["other"] = 0.0
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) != 2 or not parts[0].endswith("%"):
                continue
            pct, where = float(parts[0][:-1]), named(parts[1], root)
            for name, keys in STAGES:
                if any(where.startswith(k) for k in keys):
                    out[name] += pct
                    break
            else:
                out["other"] += pct
    return out


def handled(st):
    return sum(w.get("recv") or 0 for w in st["workers"].values())


def broker_pid(st):
    bus = st["workers"][str(BROKER)].get("bus") or {}
    return bus.get("pid")


def one_run(run, checkout, workers, posters, rep):
    per = N // workers if posters == "all" else N
    n = run.make_nginx("loom", workers, {
        "mode": "kong", "n": per, "interval": INTERVAL, "posters": posters,
        "poster": POSTER, "broker": BROKER, "payload": "100"})
    res = {"checkout": checkout, "workers": workers, "posters": posters,
           "rep": rep,
           "per_poster_per_tick": per, "interval_s": INTERVAL,
           "loadavg_before": run.loadavg()}
    if PROFILE:
        res["profile"] = "/tmp/scale-prof-%s-%s-%d-%d.txt" % (
            os.path.basename(checkout), posters, workers, rep)
        with_profiler(n, res["profile"])
    try:
        n.start()
        st = run.wait_ready(n)
        deadline = time.time() + 5
        while not broker_pid(st) and time.time() < deadline:
            time.sleep(0.3)
            st = run.stats(n)
        pid = broker_pid(st)
        run.ctl(n, posting=1)
        time.sleep(1.5)
        s0 = run.stats(n)
        c0, ns0, t0 = threads_cpu(pid), threads_ns(pid), time.time()
        time.sleep(SECONDS)
        s1 = run.stats(n)
        c1, ns1, t1 = threads_cpu(pid), threads_ns(pid), time.time()
        run.ctl(n, posting=0)
        drain_s, fin = run.drain(n, "loom")
        time.sleep(0.6)     # one full flush of the bus's own stats
        fin = run.stats(n)
        att, acc, recv, _ = run.totals(fin)
        deliveries = handled(s1) - handled(s0)
        res.update({
            "broker_pid": pid,
            "window_s": round(t1 - t0, 2),
            "broker_cpu_s": round(c1 - c0, 3),
            "broker_cpu_pct": round(100 * (c1 - c0) / (t1 - t0), 1),
            "deliveries_in_window": deliveries,
            "deliveries_per_s": round(deliveries / (t1 - t0)),
            "broker_us_per_delivery": round(1e6 * (c1 - c0)
                                            / max(1, deliveries), 3),
            "broker_sched_us_per_delivery": round(
                1e6 * (ns1 - ns0) / max(1, deliveries), 3),
            "attempted": att,
            "accepted": acc,
            "delivered": sum(recv.values()),
            "delivered_pct": round(100 * sum(recv.values())
                                   / max(1, acc * workers), 3),
            "lost_worst_worker": max(acc - v for v in recv.values()),
            "drain_s": round(drain_s, 2),
        })
        errs = {}
        for w in fin["workers"].values():
            for k, v in (w.get("errors") or {}).items():
                errs[k] = errs.get(k, 0) + v
        res["publish_errors"] = errs
        lat = [w["bus"]["latency"] for w in fin["workers"].values()
               if w.get("bus") and w["bus"].get("latency", {}).get("count")]
        if lat:
            res["p50_ms"] = round(1000 * max(x["p50"] for x in lat), 3)
            res["p99_ms"] = round(1000 * max(x["p99"] for x in lat), 3)
        bst = fin["workers"][str(BROKER)]["bus"].get("broker") or {}
        res["broker_dropped"] = bst.get("dropped")
        if PROFILE:
            res["stage_pct"] = stages(res["profile"], checkout)
            res["stage_us_per_delivery"] = {
                k: round(v / 100 * res["broker_sched_us_per_delivery"], 4)
                for k, v in res["stage_pct"].items()}
        res["broker_slow_waits"] = bst.get("slow_waits")
    except Exception as e:  # noqa: BLE001
        res["error"] = repr(e)
    finally:
        try:
            n.stop()
        except Exception as e:  # noqa: BLE001
            res["stop_error"] = str(e)
        res["log_lines"], res["log_samples"] = run.log_counts(n)
        n.cleanup()
    run.log("scale %s %-3s %2d workers rep %d: %s µs/delivery (%s sched), "
            "%s%% cpu, "
            "%s deliveries/s, %s%% delivered, p99 %s ms%s" % (
                os.path.basename(checkout), posters, workers, rep,
                res.get("broker_us_per_delivery"),
                res.get("broker_sched_us_per_delivery"),
                res.get("broker_cpu_pct"), res.get("deliveries_per_s"),
                res.get("delivered_pct"), res.get("p99_ms"),
                ", error " + res["error"] if "error" in res else ""))
    return res


def summarize(runs, checkout):
    out = {}
    for posters in POSTERS:
        for w in WORKERS:
            rs = [r for r in runs if r["posters"] == posters
                  and r["workers"] == w and "error" not in r
                  and r["checkout"] == checkout]
            if not rs:
                continue

            def med(k):
                v = [r[k] for r in rs if r.get(k) is not None]
                return statistics.median(v) if v else None
            out["%s:%d" % (posters, w)] = {
                "posters": posters, "workers": w, "runs": len(rs),
                "broker_us_per_delivery": med("broker_us_per_delivery"),
                "broker_sched_us_per_delivery": med(
                    "broker_sched_us_per_delivery"),
                "broker_cpu_pct": med("broker_cpu_pct"),
                "deliveries_per_s": med("deliveries_per_s"),
                "delivered_pct": min(r["delivered_pct"] for r in rs),
                "p99_ms": med("p99_ms"),
                "p50_ms": med("p50_ms"),
            }
            if PROFILE:
                out["%s:%d" % (posters, w)]["stage_us_per_delivery"] = {
                    k: statistics.median(r["stage_us_per_delivery"][k]
                                         for r in rs
                                         if "stage_us_per_delivery" in r)
                    for k in [name for name, _ in STAGES] + ["other"]}
    return out


def markdown(res):
    lines = []
    for checkout, meds in res["medians"].items():
        lines += ["", checkout, "",
                  "| posters | workers | broker µs CPU per delivery "
                  "(stat / schedstat) | broker CPU % | deliveries/s | "
                  "% delivered (worst run) | p99 ms |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for m in meds.values():
            lines.append("| %s | %d | %.3f / %.3f | %.1f | %d | %.3f | %.1f |"
                         % (m["posters"], m["workers"],
                            m["broker_us_per_delivery"],
                            m["broker_sched_us_per_delivery"],
                            m["broker_cpu_pct"], m["deliveries_per_s"],
                            m["delivered_pct"], m["p99_ms"]))
        stages_ = [m for m in meds.values() if "stage_us_per_delivery" in m]
        if stages_:
            names = list(stages_[0]["stage_us_per_delivery"])
            lines += ["", "| stage | " + " | ".join(
                "%s %d" % (m["posters"], m["workers"]) for m in stages_)
                + " |", "|---|" + "---:|" * len(stages_)]
            for k in names:
                lines.append("| %s | %s |" % (k, " | ".join(
                    "%.3f" % m["stage_us_per_delivery"][k]
                    for m in stages_)))
    return "\n".join(lines)


def main():
    p = benchcli.parser(__doc__)
    p.add_argument("--markdown", action="store_true",
                   help="print the table of an existing results file")
    args = p.parse_args()
    if args.markdown:
        with open(OUT) as f:
            print(markdown(json.load(f)))
        return
    benchcli.announce(__doc__, REPEAT * len(POSTERS) * len(WORKERS)
                      * (SECONDS + 8) * len(os.environ.get(
                          "SCALE_CHECKOUTS", ROOT).split()), OUT)
    checkouts = [os.path.abspath(d) for d in
                 os.environ.get("SCALE_CHECKOUTS", ROOT).replace(
                     ",", " ").split()]
    runners = ([run] if checkouts == [ROOT] else
               [load_runner(d, i) for i, d in enumerate(checkouts)])
    started = datetime.datetime.now(datetime.timezone.utc).isoformat()
    runs = []
    for rep in range(1, REPEAT + 1):
        for posters in POSTERS:
            for w in WORKERS:
                order = list(zip(runners, checkouts))
                if rep % 2 == 0:
                    order.reverse()
                for runner, d in order:
                    runs.append(one_run(runner, d, w, posters, rep))
    res = {
        "benchmark": "events-scale",
        "started": started,
        "machine": run.machine_info(),
        "settings": {"checkouts": checkouts, "profile": PROFILE,
                     "workers": WORKERS, "posters": POSTERS, "n": N,
                     "interval_s": INTERVAL, "seconds": SECONDS,
                     "repeat": REPEAT, "broker": BROKER,
                     "poster_one": POSTER, "payload": "~100 B"},
        "runs": runs,
    }
    res["medians"] = {d: summarize(runs, d) for d in checkouts}
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(res, f, indent=1)
    print(markdown(res))


if __name__ == "__main__":
    main()
