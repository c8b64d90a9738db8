#!/usr/bin/env python3
"""bench-timer: resty.loom.timer next to native ngx.timer (and Kong's
lua-resty-timer-ng when PEER_TIMER_NG names a checkout of it), side by side
in one run, variants alternating, medians over the repetitions.

  python3 bench/timer/run.py [--reps 3] [--duration 10] [--counts 0,1000,...]
                             [--variants native,loom,floor,ng,base,...]

Variants: native ngx.timer, resty.loom.timer, "floor" (the same callbacks
in a plain loop from one native timer: what the callbacks alone cost), ng
(lua-resty-timer-ng, when PEER_TIMER_NG names a checkout), base
(resty.loom.timer from BASE_LOOM_LIB, a lib/ directory of another checkout:
an A/B baseline in the same run), floor_xpcall (the floor with each
callback under xpcall), loom_nostats (resty.loom.timer, stats = false) and
base_nostats (base, stats = false).

Writes bench/results/timer.json. Needs wrk and a built module (make build).
The machine may be shared: the figures are noisy; see the "note" field.
"""

import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from loomtest.nginx import Nginx  # noqa: E402
sys.path.insert(0, os.path.join(ROOT, "bench"))
import benchcli  # noqa: E402

PEER = os.environ.get("PEER_TIMER_NG")
BASE_LIB = os.environ.get("BASE_LOOM_LIB")
CLK_TCK = os.sysconf("SC_CLK_TCK")
# plain loops of the recurring callbacks: only the recurring cells
FLOORS = ("floor", "floor_xpcall")

HTTP = """
lua_shared_dict bench 1m;
lua_max_pending_timers 300000;
lua_max_running_timers 300000;
init_by_lua_block {
    package.path = "%(root)s/bench/timer/?.lua;%(peer)s" .. package.path
    require("timer_bench").init("%(variant)s")
}
init_worker_by_lua_block {
    %(init_worker)s
    require("timer_bench").init_worker(%(n)d, %(iv)s)
    %(init_worker_after)s
}
"""

SERVER = """
location = / {
    content_by_lua_block { ngx.say("hello") }
}
location = /micro {
    content_by_lua_block {
        local cjson = require "cjson"
        local tb = require "timer_bench"
        ngx.say(cjson.encode(tb.micro(tonumber(ngx.var.arg_n))))
    }
}
location = /sleepers {
    content_by_lua_block {
        local ok, err = require("timer_bench").sleepers(
            tonumber(ngx.var.arg_n))
        ngx.say(ok and "ok" or err)
    }
}
location = /park {
    content_by_lua_block {
        local ok, err = require("timer_bench").park(tonumber(ngx.var.arg_n))
        ngx.say(ok and "ok" or err)
    }
}
location = /count {
    content_by_lua_block {
        ngx.say(require("timer_bench").count_now())
    }
}
location = /get {
    content_by_lua_block {
        ngx.say(ngx.shared.bench:get(ngx.var.arg_k) or "nil")
    }
}
location = /switch {
    content_by_lua_block {
        ngx.shared.bench:set("switch", tonumber(ngx.var.arg_s))
        ngx.say("ok")
    }
}
location = /status {
    stub_status;
}
"""


def variants():
    return (["native", "loom", "floor"] + (["ng"] if PEER else [])
            + (["base"] if BASE_LIB else [])
            + ["floor_xpcall", "loom_nostats"]
            + (["base_nostats"] if BASE_LIB else []))


def stop(ngx):
    """Stops nginx (already gone is fine) and removes its prefix."""
    try:
        ngx.stop()
    except RuntimeError:
        pass
    ngx.cleanup()


def start(variant, workers=2, n=0, iv=0.1, init_worker="",
          init_worker_after=""):
    """nginx running the bench for variant, its workers ready. init_worker:
    Lua run first in init_worker_by_lua (a profiler, say);
    init_worker_after: Lua run last (tax.py's switch)."""
    peer = ""
    if variant == "ng":
        peer = "%s/lib/?.lua;%s/lib/?/init.lua;" % (PEER, PEER)
    elif variant in ("base", "base_nostats"):
        peer = "%s/?.lua;" % BASE_LIB
    http = HTTP % {"root": ROOT, "peer": peer, "variant": variant, "n": n,
                   "iv": repr(iv), "init_worker": init_worker,
                   "init_worker_after": init_worker_after}
    ngx = Nginx(workers=workers, http=http, server=SERVER,
                main="worker_rlimit_nofile 20000;",
                worker_connections=16384, error_log_level="warn",
                shutdown_timeout="3s")
    ngx.start()
    deadline = time.time() + 60
    while time.time() < deadline:
        if get(ngx, "ready") == str(workers):
            break
        time.sleep(0.1)
    else:
        log = ngx.error_log()[-2000:]
        stop(ngx)
        raise RuntimeError("%s: workers not ready in 60 s:\n%s" % (
            variant, log))
    return ngx


def get(ngx, key, timeout=10):
    try:
        return ngx.get("/get?k=" + key, timeout=timeout).text.strip()
    except OSError:
        return None


def cpu_ticks(pids):
    total = 0
    for p in pids:
        with open("/proc/%d/stat" % p) as f:
            rest = f.read().rsplit(")", 1)[1].split()
        total += int(rest[11]) + int(rest[12])
    return total


def rss_kb(pid):
    with open("/proc/%d/status" % pid) as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


def pubs(ngx, workers):
    """{worker: (count, early, published_at)} from the native publisher."""
    out = {}
    for w in range(workers):
        v = get(ngx, "pub:%d" % w)
        if not v or v == "nil":
            return None
        c, e, t = v.split()
        out[w] = (int(c), int(e), float(t))
    return out


def early_fires(p):
    if not p:
        return None
    return sum(v[1] for v in p.values())


def bins(ngx, workers):
    """{worker: (base, interval, [runs of bin 1, bin 2, ...])}: runs by the
    due time of the grid point they were for (see timer_bench.lua)."""
    out = {}
    for w in range(workers):
        v = get(ngx, "bins:%d" % w)
        if not v or v == "nil":
            return None
        f = v.split()
        out[w] = (float(f[0]), float(f[1]), [int(x) for x in f[2:]])
    return out


def rate(bs, ta, tb):
    """Runs per second over the bins due entirely within [ta, tb]
    (CLOCK_MONOTONIC seconds, the clock of timer_bench.lua's mono()) and
    the number of bins, summed over the workers; every timer has exactly
    one grid point per bin, so the expected rate is timers / interval."""
    if not bs:
        return None, 0
    r = 0.0
    nb = None
    for base, iv, counts in bs.values():
        first = int((ta - base) / iv) + 1
        last = int((tb - base) / iv) - 1        # bin last ends <= tb
        if last < first:
            return None, 0
        runs = sum(counts[b - 1] if 0 < b <= len(counts) else 0
                   for b in range(first, last + 1))
        n = last - first + 1
        nb = n if nb is None else min(nb, n)
        r += runs / (n * iv)
    return r, nb


def wrk(url, duration):
    res = subprocess.run(["wrk", "-t1", "-c64", "-d%ds" % duration,
                          "--latency", url], capture_output=True, text=True,
                         timeout=duration + 60)
    out = res.stdout
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    rps = float(m.group(1)) if m else 0.0
    p99 = None
    m = re.search(r"\s99%\s+([\d.]+)(us|ms|s)\b", out)
    if m:
        p99 = float(m.group(1)) * {"us": 0.001, "ms": 1, "s": 1000}[
            m.group(2)]
    m = re.search(r"Socket errors:.*timeout (\d+)", out)
    timeouts = int(m.group(1)) if m else 0
    return {"rps": rps, "p99_ms": p99, "timeouts": timeouts}


def recurring_cell(variant, n, duration, idle_s):
    ngx = start(variant, 2, n, 0.1)
    try:
        pids = ngx.worker_pids()
        time.sleep(2)
        c0, t0 = cpu_ticks(pids), time.time()
        m0 = time.monotonic()
        time.sleep(idle_s)
        c1, t1 = cpu_ticks(pids), time.time()
        m1 = time.monotonic()
        idle_cpu = (c1 - c0) / CLK_TCK / (t1 - t0) * 100
        wrk(ngx.url("/"), 1)
        c2, t2 = cpu_ticks(pids), time.time()
        m2 = time.monotonic()
        w = wrk(ngx.url("/"), duration)
        c3, t3 = cpu_ticks(pids), time.time()
        m3 = time.monotonic()
        # runs due in the windows may start late: give them a period and
        # a publish (0.5 s) before reading the counts
        time.sleep(1.5)
        p3 = pubs(ngx, 2)
        bs = bins(ngx, 2) if n else None
        idle_rate, idle_bins = rate(bs, m0, m1)
        load_rate, load_bins = rate(bs, m2, m3)
        expected = n * 10 * 2
        cell = dict(w)
        cell.update({
            "variant": variant,
            "timers_per_worker": n,
            "worker_cpu_pct_load": (c3 - c2) / CLK_TCK / (t3 - t2) * 100,
            "worker_cpu_pct_idle": idle_cpu,
            "rss_mb_per_worker": sum(rss_kb(p) for p in pids) / 1024 / 2,
            "callbacks_per_s_load": load_rate,
            "callbacks_per_s_idle": idle_rate,
            "callback_bins_load": load_bins,
            "callback_bins_idle": idle_bins,
            "expected_per_s": expected,
            "callback_pct_load": (100 * load_rate / expected
                                  if expected and load_rate else None),
            "callback_pct_idle": (100 * idle_rate / expected
                                  if expected and idle_rate else None),
            "early_fires": early_fires(p3) if n else None,
        })
        return cell
    finally:
        stop(ngx)


def micro_cell(variant, n=100000):
    ngx = start(variant, 1)
    try:
        r = ngx.get("/micro?n=%d" % n, timeout=120)
        out = json.loads(r.body)
        out["variant"] = variant
        return out
    finally:
        stop(ngx)


def sleepers_cell(variant, n=5000):
    ngx = start(variant, 1)
    try:
        r = ngx.get("/sleepers?n=%d" % n, timeout=60)
        assert r.text.strip() == "ok", r.text
        deadline = time.time() + 90
        while time.time() < deadline:
            v = get(ngx, "sl_time")
            if v and v != "nil":
                return {"variant": variant, "seconds": float(v)}
            time.sleep(0.05)
        return {"variant": variant, "seconds": None,
                "done": get(ngx, "sl_done")}
    finally:
        stop(ngx)


def idle_cell(variant, n=100000, window=10):
    ngx = start(variant, 1)
    try:
        r = ngx.get("/park?n=%d" % n, timeout=60)
        assert r.text.strip() == "ok", r.text
        pids = ngx.worker_pids()
        time.sleep(2)
        c0, t0 = cpu_ticks(pids), time.time()
        time.sleep(window)
        c1, t1 = cpu_ticks(pids), time.time()
        return {"variant": variant,
                "cpu_pct_of_core": (c1 - c0) / CLK_TCK / (t1 - t0) * 100,
                "window_s": window}
    finally:
        stop(ngx)


def median(vals):
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def summarize(cells, keys):
    out = {}
    for k in keys:
        out[k] = median([c.get(k) for c in cells])
    out["runs"] = len(cells)
    return out


def loadavg():
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


LOADS = []          # 1-minute load averages sampled around every cell


def note():
    """What is known about the conditions of the run: the load average
    sampled before and after each cell, nothing more."""
    loads = LOADS + [float(loadavg()[0])]
    return ("1-minute load average %.2f to %.2f (sampled before and after "
            "each cell) on %d CPUs; wrk and nginx share these CPUs" % (
                min(loads), max(loads), os.cpu_count()))


def fmt(v, nd=1, pct=False):
    if v is None:
        return "n/a"
    if pct:
        return "%.1f%%" % v
    if isinstance(v, float):
        return ("%%.%df" % nd) % v
    return str(v)


def table(path):
    """Markdown tables of a results file (for docs/timer.md)."""
    with open(path) as f:
        res = json.load(f)
    med = res["medians"]
    vs = res["setup"]["variants"]
    names = {"native": "native ngx.timer", "loom": "resty.loom.timer",
             "ng": "lua-resty-timer-ng 0.2.7",
             "floor": "floor (plain loop)",
             "base": "resty.loom.timer (baseline)",
             "floor_xpcall": "floor + xpcall",
             "loom_nostats": "resty.loom.timer, stats off",
             "base_nostats": "resty.loom.timer (baseline), stats off"}
    out = ["Measured %s, %d repetitions, medians. %s." % (
        res["date"], res["setup"]["reps"],
        res["note"][:1].upper() + res["note"][1:]), ""]
    out.append("100k one-shot timers 60 s out (1 worker):")
    out.append("")
    out.append("| | schedule µs | cancel µs | heap B/timer | RSS B/timer "
               "| heap B/timer after cancel + GC |")
    out.append("|---|---|---|---|---|---|")
    for v in [v for v in vs if v not in FLOORS]:
        m = med["micro"][v]
        out.append("| %s | %s | %s | %s | %s | %s |" % (
            names[v], fmt(m["schedule_us"], 2), fmt(m["cancel_us"], 3),
            fmt(m["heap_b"], 0), fmt(m["rss_b"], 0),
            fmt(m["heap_after_cancel_b"], 0)))
    out.append("")
    out.append("5,000 one-shot jobs that each sleep 0.2 s (1 worker), and "
               "idle CPU with 100k timers pending an hour out:")
    out.append("")
    out.append("| | all 5,000 done after (s) | idle CPU, % of a core |")
    out.append("|---|---|---|")
    for v in [v for v in vs if v not in FLOORS]:
        out.append("| %s | %s | %s |" % (
            names[v], fmt(med["sleepers"][v]["seconds"], 2),
            fmt(med["idle"][v]["cpu_pct_of_core"], 2)))
    out.append("")
    out.append("2 workers serving `ngx.say(\"hello\")` under `wrk -t1 -c64 "
               "-d10s --latency`, N recurring timers per worker at 0.1 s "
               "(callbacks: % of the expected N x 20 per second; CPU: both "
               "workers, % of one core):")
    out.append("")
    out.append("| N | variant | RPS | vs native | vs 0 timers | p99 ms "
               "| CPU load / idle | RSS MB/worker | callbacks load "
               "| callbacks idle | early fires |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for n, row in sorted(med["recurring"].items(), key=lambda x: int(x[0])):
        for v in vs:
            m = row[v]
            out.append("| %s | %s | %s | %s | %s | %s | %s / %s | %s | %s "
                       "| %s | %s |" % (
                           "{:,}".format(int(n)), names[v],
                           fmt(m["rps"], 0), fmt(m.get("rps_vs_native"), 2),
                           fmt(m.get("rps_vs_no_timers"), 3),
                           fmt(m["p99_ms"], 1),
                           fmt(m["worker_cpu_pct_load"], 0),
                           fmt(m["worker_cpu_pct_idle"], 0),
                           fmt(m["rss_mb_per_worker"], 1),
                           fmt(m["callback_pct_load"], pct=True)
                           if int(n) else "-",
                           fmt(m["callback_pct_idle"], pct=True)
                           if int(n) else "-",
                           fmt(m["early_fires"], 0) if int(n) else "-"))
    return "\n".join(out)


def main():
    ap = benchcli.parser(__doc__)
    ap.add_argument("--table", action="store_true",
                    help="print the markdown tables of --out and exit")
    ap.add_argument("--reps", type=int, default=3,
                    help="repetitions, variants alternating (default 3)")
    ap.add_argument("--duration", type=int, default=10,
                    help="seconds of wrk per recurring cell (default 10)")
    ap.add_argument("--idle", type=int, default=4,
                    help="seconds of idle CPU measurement per cell "
                         "(default 4)")
    ap.add_argument("--counts", default="0,1000,10000,50000",
                    help="recurring timers per worker, one cell each "
                         "(default 0,1000,10000,50000)")
    ap.add_argument("--variants", default="",
                    help="variants to run, comma-separated (default: all "
                         "available)")
    ap.add_argument("--skip", default="",
                    help="parts to leave out, comma-separated: micro, "
                         "recurring, sleep, idle")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results",
                                                  "timer.json"),
                    help="results file (default bench/results/timer.json)")
    args = ap.parse_args()
    if args.table:
        print(table(args.out))
        return
    skip = set(filter(None, args.skip.split(",")))
    counts = [int(x) for x in args.counts.split(",")]
    vs = variants()
    if args.variants:
        vs = [v for v in args.variants.split(",") if v in vs]
    # micro, sleepers and idle: ~10 s a cell; recurring: idle + wrk + start
    benchcli.announce(__doc__, args.reps * len(vs) * (
        10 * len({"micro", "sleep", "idle"} - skip)
        + ("recurring" not in skip) * len(counts)
        * (args.duration + args.idle + 4)), args.out)
    raw = {"micro": [], "recurring": [], "sleepers": [], "idle": []}
    failures = []
    load_before = loadavg()
    started = time.time()

    def order(rep):
        return vs if rep % 2 == 0 else list(reversed(vs))

    def attempt(kind, fn, *a):
        load0 = float(loadavg()[0])
        LOADS.append(load0)
        try:
            c = fn(*a)
        except Exception as e:          # a variant that collapses
            failures.append({"kind": kind, "args": [str(x) for x in a],
                             "error": str(e)[:300]})
            print(kind, "FAILED", a, str(e)[:200], flush=True)
            return
        load1 = float(loadavg()[0])
        LOADS.append(load1)
        c["loadavg_1m"] = [load0, load1]
        print(kind, json.dumps(c), flush=True)
        raw[kind].append(c)
        write(args, raw, failures, counts, vs, load_before, started)

    for rep in range(args.reps):
        # the floor only differs from native in the recurring cells
        if "micro" not in skip:
            for v in order(rep):
                if v in FLOORS:
                    continue
                attempt("micro", micro_cell, v)
        if "sleep" not in skip:
            for v in order(rep):
                if v in FLOORS:
                    continue
                attempt("sleepers", sleepers_cell, v)
        if "idle" not in skip:
            for v in order(rep):
                if v in FLOORS:
                    continue
                attempt("idle", idle_cell, v)
        if "recurring" not in skip:
            for n in counts:
                for v in order(rep + counts.index(n)):
                    attempt("recurring", recurring_cell, v, n,
                            args.duration, args.idle)
    write(args, raw, failures, counts, vs, load_before, started)
    print(table(args.out))


def write(args, raw, failures, counts, vs, load_before, started):
    med = {"micro": {}, "sleepers": {}, "idle": {}, "recurring": {}}
    for v in vs:
        med["micro"][v] = summarize(
            [c for c in raw["micro"] if c["variant"] == v],
            ["schedule_us", "cancel_us", "schedule_cpu_us", "cancel_cpu_us",
             "heap_b", "rss_b", "heap_after_cancel_b",
             "rss_after_cancel_b"])
        med["sleepers"][v] = summarize(
            [c for c in raw["sleepers"] if c["variant"] == v], ["seconds"])
        med["idle"][v] = summarize(
            [c for c in raw["idle"] if c["variant"] == v],
            ["cpu_pct_of_core"])
    keys = ["rps", "p99_ms", "timeouts", "worker_cpu_pct_load",
            "worker_cpu_pct_idle", "rss_mb_per_worker",
            "callbacks_per_s_load", "callbacks_per_s_idle", "expected_per_s",
            "callback_pct_load", "callback_pct_idle", "early_fires"]
    for n in counts:
        row = {}
        for v in vs:
            row[v] = summarize([c for c in raw["recurring"]
                                if c["variant"] == v
                                and c["timers_per_worker"] == n], keys)
        nat = row.get("native", {}).get("rps")
        for v in vs:
            if nat and row[v].get("rps") is not None:
                row[v]["rps_vs_native"] = row[v]["rps"] / nat
        med["recurring"][str(n)] = row
    # the figure: RPS with N timers over the same variant's RPS
    # with none (medians of the same run)
    none = med["recurring"].get("0")
    for n in counts:
        for v in vs:
            row = med["recurring"][str(n)][v]
            r0 = none and none[v].get("rps")
            if r0 and row.get("rps") is not None:
                row["rps_vs_no_timers"] = row["rps"] / r0

    result = {
        "benchmark": "bench-timer",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "note": note(),
        "setup": {
            "variants": vs,
            "peer_timer_ng": bool(PEER),
            "reps": args.reps,
            "wrk": "-t1 -c64 -d%ds --latency (after a 1 s warm-up)"
                   % args.duration,
            "recurring": "2 workers, N timers per worker every 0.1 s, "
                         "trivial callback; idle window %d s; callbacks "
                         "counted by the due time of their grid point, over "
                         "the 0.1 s bins due entirely within each window, "
                         "read 1.5 s after the load ends" % args.idle,
            "micro": "1 worker, 100k one-shot timers 60 s out created in "
                     "one request after 10k warm-up ones; *_us: wall time "
                     "(monotonic clock), *_cpu_us: CPU time of the worker; "
                     "memory after two full GCs (heap: the Lua heap only, "
                     "RSS: everything)",
            "sleepers": "1 worker, 5000 at(0) jobs that each ngx.sleep(0.2)",
            "idle": "1 worker, 100k timers 3600 s out, CPU over 10 s",
            "loadavg_before": load_before,
            "loadavg_now": loadavg(),
            "wall_s": round(time.time() - started, 1),
        },
        "failures": failures,
        "medians": med,
        "raw": raw,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(result, f, indent=2, sort_keys=True)
    os.rename(args.out + ".tmp", args.out)


if __name__ == "__main__":
    main()
