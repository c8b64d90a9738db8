#!/usr/bin/env python3
"""bench-timer-tax: what 50,000 recurring timers per worker take from the
req/s of the same nginx, measured by switching them on and off every few
seconds while one wrk run goes on (bench/onoff.py says how and why), for
variants of bench/timer/run.py alternated in one run.

  python3 bench/timer/tax.py [--rounds 2] [--phases 21] [--settle 0.5]
                             [--window 1.5] [--timers 50000]
                             [--variants loom,loom_nostats,floor,...]

Each variant's 2 workers create their timers (on) and cancel them (off);
a phase starts once both have. The callbacks run per second in each
on-phase are counted too (by the bench's callback), against the expected
timers x 10 x 2 workers.

Variants: loom (resty.loom.timer), loom_nostats (stats = false), floor
(the callbacks in a plain loop from one native timer), floor_xpcall (the
same under xpcall), base and base_nostats (BASE_LOOM_LIB). Native
ngx.timer cannot cancel a recurring timer, so it is not a variant here.
Order per round: the variants, then reversed in the next round.

Writes bench/results/timer-tax.json. Needs wrk and a built module (make
build). Run it under /work/wt/run-bench on a shared machine.
"""

import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import run as tb  # noqa: E402  (bench/timer/run.py: start(), get(), pubs())
import onoff  # noqa: E402  (bench/onoff.py, on the path run.py set)

ROOT = tb.ROOT
benchcli = tb.benchcli

VARIANTS = ("loom", "loom_nostats", "floor", "floor_xpcall", "base",
            "base_nostats")


def callback_rate(a, b):
    """Callbacks per second of all workers between two snapshots of their
    publishers (tb.pubs(): every 0.5 s, each with its own count and time)."""
    if not a or not b:
        return None
    r = 0.0
    for w in a:
        if b[w][2] <= a[w][2]:
            return None
        r += (b[w][0] - a[w][0]) / (b[w][2] - a[w][2])
    return r


def cell(variant, n, phases, settle, window):
    # (init_switch needs the state init_worker sets up)
    ngx = tb.start(variant, 2, 0, 0.1, init_worker_after=(
        'require("timer_bench").init_switch(%d, 0.1)' % n))
    state = {"s": 0}

    def switch(on):
        # odd: on; every phase a new number, so each is seen as a change
        state["s"] += 1 if (state["s"] % 2 == 1) == (not on) else 2
        s = state["s"]
        ngx.get("/switch?s=%d" % s, timeout=10)
        deadline = time.time() + 30
        while not all(tb.get(ngx, "switched:%d" % w) == str(s)
                      for w in range(2)):
            if time.time() > deadline:
                raise RuntimeError("switch %d not applied in 30 s" % s)
            time.sleep(0.02)

    def on_phase(on):
        if not on:
            return None
        # the publishers' snapshots lag by up to 0.5 s: both fall within
        # the phase after the settle time
        p0 = tb.pubs(ngx, 2)

        def after():
            cr = callback_rate(p0, tb.pubs(ngx, 2))
            return {"callbacks_pct": (100.0 * cr / (n * 10 * 2)
                                      if cr is not None else None)}
        return after

    try:
        out, ratios = onoff.run(ngx.url("/"), ngx.url("/status"), switch,
                                phases, settle, window, on_phase)
        return {"variant": variant, "timers_per_worker": n,
                "phases": out, "ratios": ratios,
                "median_ratio": statistics.median(ratios),
                # the floors' callbacks run on the native timer's grid, not
                # each timer's own: their "early" count means nothing
                "early_fires": (None if variant.startswith("floor")
                                else tb.early_fires(tb.pubs(ngx, 2)))}
    finally:
        tb.stop(ngx)


def main():
    ap = benchcli.parser(__doc__)
    onoff.add_args(ap, os.path.join(ROOT, "bench", "results",
                                    "timer-tax.json"))
    ap.add_argument("--timers", type=int, default=50000,
                    help="recurring timers per worker (default 50000)")
    ap.add_argument("--variants", default="loom,loom_nostats,floor,"
                    "floor_xpcall",
                    help="comma-separated (default loom,loom_nostats,"
                         "floor,floor_xpcall)")
    args = ap.parse_args()
    if args.table:
        print(table(args.out))
        return
    vs = [v for v in args.variants.split(",") if v]
    for v in vs:
        if v not in VARIANTS:
            ap.error("unknown variant %r (one of %s)" % (
                v, ", ".join(VARIANTS)))
        if v.startswith("base") and not tb.BASE_LIB:
            ap.error("variant %s needs BASE_LOOM_LIB" % v)
    onoff.check_args(ap, args)
    if args.timers < 1:
        ap.error("--timers must be positive")
    per_cell = 6 + args.phases * (args.settle + args.window + 0.5)
    benchcli.announce(__doc__, args.rounds * len(vs) * per_cell, args.out)
    cells = []
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for r in range(args.rounds):
        for v in (vs if r % 2 == 0 else list(reversed(vs))):
            load0 = float(tb.loadavg()[0])
            c = cell(v, args.timers, args.phases, args.settle, args.window)
            c["round"] = r
            c["loadavg_1m"] = [load0, float(tb.loadavg()[0])]
            cells.append(c)
            print("%-14s round %d: median on/off %.3f (%s)" % (
                v, r, c["median_ratio"],
                " ".join("%.2f" % x for x in c["ratios"])), flush=True)
            write(args, vs, cells, started)
    print(table(args.out))


def summary(vs, cells):
    out = {}
    for v in vs:
        mine = [c for c in cells if c["variant"] == v]
        sm = onoff.summary(mine)
        if not sm:
            continue
        cbs = [p["callbacks_pct"] for c in mine for p in c["phases"]
               if p.get("callbacks_pct") is not None]
        sm["median_callbacks_pct"] = statistics.median(cbs) if cbs else None
        sm["early_fires"] = (None if v.startswith("floor") else
                             sum(c["early_fires"] for c in mine))
        out[v] = sm
    return out


def write(args, vs, cells, started):
    with open(args.out, "w") as f:
        json.dump({"started": started, "timers_per_worker": args.timers,
                   "phases": args.phases, "settle_s": args.settle,
                   "window_s": args.window, "variants": vs,
                   "summary": summary(vs, cells), "cells": cells}, f,
                  indent=1)


def table(path):
    with open(path) as f:
        d = json.load(f)
    lines = ["| variant | req/s on / off (median of pairs) | q1-q3 | pairs "
             "| req/s on, off | callbacks run | early fires |",
             "|---|---|---|---|---|---|---|"]
    for v, s in d["summary"].items():
        lines.append("| %s | %.3f | %.3f-%.3f | %d | %d, %d | %s | %s |" % (
            v, s["median_ratio"], s["q1"], s["q3"], s["pairs"],
            s["median_rps_on"], s["median_rps_off"],
            "%.1f %%" % s["median_callbacks_pct"]
            if s["median_callbacks_pct"] is not None else "n/a",
            "n/a" if s["early_fires"] is None else s["early_fires"]))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
