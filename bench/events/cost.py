#!/usr/bin/env python3
"""Worker CPU per event published, for one or more checkouts at once.

    python3 bench/events/cost.py [DIR ...]

Each DIR is a checkout of resty-loom with its module built (default: this
one). For every round, every checkout gets its own nginx (2 workers, the
Kong scenario's harness: 10,000 events every 0.1 s to "all", from worker 0
or from every worker), all running at the same time with no HTTP load, so
that they share whatever the host is doing. The figure is the workers'
utime + stime over the window divided by the events published in it.
COST_LIBS names the harness's variants to run per checkout: "loom" (the
default), "floor" (decode and handler only) and "floor-shm" (encode,
shared memory, decode; see run.py), e.g. COST_LIBS=loom,floor,floor-shm.

Knobs: COST_ROUNDS (3), COST_POSTERS ("one" or "all", default "one"),
COST_SECONDS (8), COST_LIBS ("loom"), BENCH_OUT
(bench/results/events-cost-<posters>.json).
"""

import datetime
import importlib.util
import json
import os
import statistics
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
ROUNDS = int(os.environ.get("COST_ROUNDS", "3"))
POSTERS = os.environ.get("COST_POSTERS", "one")
SECONDS = float(os.environ.get("COST_SECONDS", "8"))
LIBS = os.environ.get("COST_LIBS", "loom").split(",")
OUT = os.environ.get("BENCH_OUT", os.path.join(
    ROOT, "bench", "results", "events-cost-%s.json" % POSTERS))
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    fields = open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def load_runner(checkout, i):
    """That checkout's bench/events/run.py, with its own test harness."""
    sys.path[:] = [os.path.join(checkout, "bench", "events"),
                   os.path.join(checkout, "tests")] + [
        p for p in sys.path
        if not p.endswith(os.path.join("bench", "events"))
        and not p.endswith("tests")]
    for name in list(sys.modules):
        if name.startswith("loomtest"):
            del sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        "events_run_%d" % i, os.path.join(checkout, "bench", "events",
                                          "run.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def published(runner, n):
    st = runner.stats(n)
    return sum(w.get("accepted") or 0 for w in st["workers"].values())


def one_round(runners):
    """runners: (checkout's runner, variant) pairs, all at once."""
    cfg = {"mode": "kong", "n": 10000, "interval": 0.1, "posters": POSTERS,
           "payload": "100"}
    nginxes = []
    try:
        for runner, lib in runners:
            n = runner.make_nginx(lib, 2, cfg)
            n.start()
            nginxes.append(n)
            runner.wait_ready(n)
        runners = [r for r, _ in runners]
        time.sleep(1)
        for runner, n in zip(runners, nginxes):
            runner.ctl(n, posting=1)
        time.sleep(1)
        before = [(sum(cpu_seconds(p) for p in n.worker_pids()),
                   published(r, n)) for r, n in zip(runners, nginxes)]
        time.sleep(SECONDS)
        after = [(sum(cpu_seconds(p) for p in n.worker_pids()),
                  published(r, n)) for r, n in zip(runners, nginxes)]
        for runner, n in zip(runners, nginxes):
            runner.ctl(n, posting=0)
    finally:
        for n in nginxes:
            n.stop()
    return [(c1 - c0) / (e1 - e0) * 1e6
            for (c0, e0), (c1, e1) in zip(before, after)]


def main():
    checkouts = [os.path.abspath(d) for d in sys.argv[1:]] or [ROOT]
    loaded = [load_runner(d, i) for i, d in enumerate(checkouts)]
    runners = [(r, lib) for r in loaded for lib in LIBS]
    names = [d if lib == "loom" else "%s (%s)" % (d, lib)
             for d in checkouts for lib in LIBS]
    started = datetime.datetime.now(datetime.timezone.utc).isoformat()
    per = {d: [] for d in names}
    for r in range(ROUNDS):
        for d, us in zip(names, one_round(runners)):
            per[d].append(round(us, 3))
            print("round %d  %-40s %.3f µs/event" % (r + 1, d, us),
                  file=sys.stderr, flush=True)
    result = {
        "benchmark": "events-cost",
        "started": started,
        "posters": POSTERS,
        "seconds": SECONDS,
        "rounds": ROUNDS,
        "us_per_event": {d: {"runs": v, "median": statistics.median(v)}
                         for d, v in per.items()},
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(result, f, indent=1)
    for d, v in per.items():
        print("%-40s median %.3f µs/event  %s" % (d, statistics.median(v),
                                                  v))


if __name__ == "__main__":
    main()
