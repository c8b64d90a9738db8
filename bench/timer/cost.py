#!/usr/bin/env python3
"""bench-timer-cost: the worker's CPU time per recurring callback, with no
HTTP load, for variants of bench/timer/run.py alternated in one run:
1 worker, 50,000 recurring timers at 0.1 s (500,000 callbacks/s).

  python3 bench/timer/cost.py [--pairs 5] [--window 6] [--timers 50000]
                              [--variants floor,floor_xpcall,loom,...]

Per cell: start nginx, wait --warmup seconds, then over --window seconds
read the worker's CPU time (/proc/<pid>/schedstat, nanoseconds; utime +
stime of /proc/<pid>/stat alongside, in clock ticks) and the callbacks it
ran (counted by the bench's callback itself, read through /count). The
figure is CPU time / callbacks. Variants run in order, then reversed (A B
B A ...), --pairs times; medians. Variants: floor (the callbacks in a plain
loop from one native timer), floor_xpcall (the same, each under xpcall with
a traceback handler), loom (resty.loom.timer), loom_nostats (stats =
false), base and base_nostats (the same two from BASE_LOOM_LIB, a lib/
directory of another checkout). Run it under /work/wt/run-bench on a
shared machine.

Writes bench/results/timer-cost.json.

  python3 bench/timer/cost.py --profile jitp|jitv|perf [--variants ...]

instead runs one cell per variant with LuaJIT's sampling profiler (jit.p,
function level, 1 ms: "Fi1") or trace log (jit.v, from before the first
timer) on in the worker for --window seconds after --warmup; output in
/tmp/loom-timer-profile/<variant>-<mode>.txt. perf: the worker writes its
trace dump (jit.dump, machine code) and `perf record -e cpu-clock` samples
it for --window seconds; the text file gives each trace's and each
function's share of the samples (bench/jitperf.py).
"""

import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import run as tb  # noqa: E402  (bench/timer/run.py: start(), cpu_ticks())
import jitperf  # noqa: E402  (bench/jitperf.py, on the path run.py set)

ROOT = tb.ROOT
benchcli = tb.benchcli


PROFILE_DIR = "/tmp/loom-timer-profile"

PROFILE = {
    "jitp": """
        ngx.timer.at(%(warmup)s, function()
            local p = require "jit.p"
            p.start("Fi1", "%(out)s")
            ngx.timer.at(%(window)s, function() p.stop() end)
        end)
""",
    "jitv": """
        require("jit.v").on("%(out)s")
        ngx.timer.at(%(warmup)s + %(window)s, function()
            require("jit.v").off()
        end)
""",
    "perf": """
        require("jit.dump").on("m", "%(out)s.dump")
""",
}


def perf_shares(ngx, out, warmup, window):
    pid = ngx.worker_pids()[0]
    time.sleep(warmup)
    subprocess.run(["perf", "record", "-q", "-e", "cpu-clock", "-F", "4000",
                    "-p", str(pid), "-o", out + ".data", "--", "sleep",
                    str(window)], check=True, capture_output=True)
    with open(out, "w") as f:
        for where, share in jitperf.shares(out + ".dump", out + ".data"):
            if share >= 0.002:
                f.write("%5.1f %%  %s\n" % (100 * share, where))


def profile(mode, variants, timers, warmup, window):
    os.makedirs(PROFILE_DIR, exist_ok=True)
    for v in variants:
        out = os.path.join(PROFILE_DIR, "%s-%s.txt" % (v, mode))
        ngx = tb.start(v, 1, timers, 0.1, PROFILE[mode] % {
            "out": out, "warmup": warmup, "window": window})
        try:
            if mode == "perf":
                perf_shares(ngx, out, warmup, window)
            else:
                time.sleep(warmup + window + 1)
        finally:
            tb.stop(ngx)
        print(out, flush=True)


def schedstat_ns(pid):
    with open("/proc/%d/schedstat" % pid) as f:
        return int(f.read().split()[0])


def count_now(ngx):
    c, e, t = ngx.get("/count", timeout=10).text.split()
    return int(c), int(e), float(t)


def cell(variant, timers, warmup, window, jitv=None):
    # (jitv: the trace log of the whole cell)
    ngx = tb.start(variant, 1, timers, 0.1, PROFILE["jitv"] % {
        "out": jitv, "warmup": 0, "window": 3600} if jitv else "")
    try:
        pid = ngx.worker_pids()[0]
        time.sleep(warmup)
        c0, e0, m0 = count_now(ngx)
        s0, k0 = schedstat_ns(pid), tb.cpu_ticks([pid])
        time.sleep(window)
        c1, e1, m1 = count_now(ngx)
        s1, k1 = schedstat_ns(pid), tb.cpu_ticks([pid])
        runs = c1 - c0
        return {
            "variant": variant,
            "timers": timers,
            "window_s": m1 - m0,
            "callbacks": runs,
            "callbacks_pct": 100 * runs / (m1 - m0) / (timers * 10),
            "early_fires": e1 - e0,
            "cpu_pct": (s1 - s0) / 1e9 / (m1 - m0) * 100,
            "us_per_callback": (s1 - s0) / 1e3 / runs if runs else None,
            "us_per_callback_ticks": ((k1 - k0) / tb.CLK_TCK * 1e6 / runs
                                      if runs else None),
        }
    finally:
        tb.stop(ngx)


def main():
    ap = benchcli.parser(__doc__)
    ap.add_argument("--pairs", type=int, default=5,
                    help="rounds, the order reversed every other one "
                         "(default 5)")
    ap.add_argument("--window", type=float, default=6,
                    help="seconds measured per cell (default 6)")
    ap.add_argument("--warmup", type=float, default=3,
                    help="seconds after the start before the window "
                         "(default 3)")
    ap.add_argument("--timers", type=int, default=50000,
                    help="recurring timers at 0.1 s (default 50000)")
    ap.add_argument("--variants",
                    default="floor,floor_xpcall,loom,loom_nostats",
                    help="comma-separated (default floor,floor_xpcall,loom,"
                         "loom_nostats)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results",
                                                  "timer-cost.json"),
                    help="results file (default "
                         "bench/results/timer-cost.json)")
    ap.add_argument("--profile", choices=sorted(PROFILE),
                    help="profile one cell per variant instead (see above)")
    ap.add_argument("--jitv", action="store_true",
                    help="log each cell's traces (jit.v) to "
                         "/tmp/loom-timer-profile/<variant>-<round>-jitv.txt")
    args = ap.parse_args()
    vs = [v for v in args.variants.split(",") if v]
    if args.profile:
        profile(args.profile, vs, args.timers, args.warmup, args.window)
        return
    benchcli.announce(__doc__, args.pairs * len(vs)
                      * (args.window + args.warmup + 3), args.out)
    started = time.time()
    load0 = tb.loadavg()
    raw = []
    for p in range(args.pairs):
        for v in (vs if p % 2 == 0 else list(reversed(vs))):
            jitv = None
            if args.jitv:
                os.makedirs(PROFILE_DIR, exist_ok=True)
                jitv = os.path.join(PROFILE_DIR, "%s-%d-jitv.txt" % (v, p))
            c = cell(v, args.timers, args.warmup, args.window, jitv)
            c["round"] = p
            c["loadavg_1m"] = float(tb.loadavg()[0])
            print(json.dumps(c), flush=True)
            raw.append(c)
    med = {}
    for v in vs:
        cs = [c for c in raw if c["variant"] == v]
        med[v] = {k: statistics.median([c[k] for c in cs])
                  for k in ("us_per_callback", "us_per_callback_ticks",
                            "cpu_pct", "callbacks_pct", "early_fires")}
        med[v]["min_us"] = min(c["us_per_callback"] for c in cs)
        med[v]["max_us"] = max(c["us_per_callback"] for c in cs)
    result = {
        "benchmark": "bench-timer-cost",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "setup": {
            "variants": vs, "pairs": args.pairs, "window_s": args.window,
            "warmup_s": args.warmup, "timers": args.timers,
            "interval_s": 0.1, "workers": 1,
            "cpu": "worker's /proc/<pid>/schedstat run time (ns) over the "
                   "window / callbacks the bench's callback counted in it",
            "loadavg_before": load0, "loadavg_after": tb.loadavg(),
            "wall_s": round(time.time() - started, 1),
        },
        "medians": med,
        "raw": raw,
    }
    with open(args.out + ".tmp", "w") as f:
        json.dump(result, f, indent=2, sort_keys=True)
    os.rename(args.out + ".tmp", args.out)
    print("| variant | µs per callback (median) | min-max | CPU % | "
          "callbacks % | early |")
    print("|---|---|---|---|---|---|")
    for v in vs:
        m = med[v]
        print("| %s | %.4f | %.4f-%.4f | %.2f | %.1f | %d |" % (
            v, m["us_per_callback"], m["min_us"], m["max_us"], m["cpu_pct"],
            m["callbacks_pct"], m["early_fires"]))


if __name__ == "__main__":
    main()
