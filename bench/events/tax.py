#!/usr/bin/env python3
"""bench-events-tax: what posting events takes from the req/s of the same
nginx in the Kong scenario of bench/events/run.py (2 workers, a timer
publishing n events to "all" every interval), measured by switching the
posting on and off every few seconds while one wrk run goes on
(bench/onoff.py says how and why), for the bus and the floors alternated
in one run.

  python3 bench/events/tax.py [--rounds 2] [--phases 21] [--settle 0.5]
                              [--window 1.5] [--cells one:C,all:C,one:D]
                              [--libs loom,floor,floor-shm]

Cells are run.py's: "one" (worker 0 posts) or "all" (every worker posts),
and a scenario: B (1,000 every 0.5 s), C (10,000 every 0.1 s), D (50,000
every 0.1 s). Libs: loom (resty.loom.events), floor (no bus: every worker
decodes the events it would receive from pre-encoded bytes), floor-shm
(each poster encodes into shared memory, every worker decodes from there:
the least an inter-worker bus must do), worker-events (with
PEER_WORKER_EVENTS=<checkout of lua-resty-worker-events>). Order per
round: the libs, then reversed in the next round. After the last phase
the posting stops and the bus drains: the events delivered to every
worker are counted against those accepted.

Writes bench/results/events-tax.json. Needs wrk and a built module (make
build). Run it under /work/wt/run-bench on a shared machine.
"""

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import run as eb  # noqa: E402  (bench/events/run.py)
import onoff  # noqa: E402  (bench/onoff.py, on the path run.py set)

ROOT = eb.ROOT
benchcli = eb.benchcli

LIBS = ("loom", "floor", "floor-shm", "worker-events")


def cell(lib, posters, scen, phases, settle, window):
    count, interval, _ = eb.SCENARIOS[scen]
    n = eb.make_nginx(lib, 2, {"mode": "kong", "n": count,
                               "interval": interval, "posters": posters})
    n.start()
    try:
        eb.wait_ready(n)

        def switch(on):
            eb.ctl(n, posting=1 if on else 0)

        out, ratios = onoff.run(n.url("/"), n.url("/_bench/status"), switch,
                                phases, settle, window)
        eb.ctl(n, posting=0, timeout=20)
        _, fin = eb.drain(n, lib)
        att, acc, recv, _ = eb.totals(fin)
        res = {"lib": lib, "posters": posters, "scenario": scen,
               "phases": out, "ratios": ratios,
               "attempted": att, "accepted": acc, "delivered": recv,
               "delivered_pct_worst": (100.0 * min(recv.values()) / acc
                                       if acc else None)}
        if lib == "loom":
            time.sleep(0.6)     # one full flush of the bus's own stats
            bus = [x.get("bus") for x in eb.stats(n)["workers"].values()]
            lat = [b["latency"] for b in bus
                   if b and b.get("latency", {}).get("count")]
            if lat:
                res["bus_latency_p99_ms"] = 1000 * max(x["p99"] for x in lat)
        return res
    finally:
        n.stop()
        n.cleanup()


def main():
    ap = benchcli.parser(__doc__)
    onoff.add_args(ap, os.path.join(ROOT, "bench", "results",
                                    "events-tax.json"))
    ap.add_argument("--cells", default="one:C,all:C,one:D",
                    help="comma-separated posters:scenario (default "
                         "one:C,all:C,one:D)")
    ap.add_argument("--libs", default="loom,floor,floor-shm",
                    help="comma-separated (default loom,floor,floor-shm)")
    args = ap.parse_args()
    if args.table:
        print(table(args.out))
        return
    onoff.check_args(ap, args)
    libs = [x for x in args.libs.split(",") if x]
    for lib in libs:
        if lib not in LIBS:
            ap.error("unknown lib %r (one of %s)" % (lib, ", ".join(LIBS)))
        if lib == "worker-events" and not eb.PEER:
            ap.error("lib worker-events needs PEER_WORKER_EVENTS")
    cells = []
    for c in args.cells.split(","):
        posters, _, scen = c.partition(":")
        if posters not in ("one", "all") or scen not in ("B", "C", "D"):
            ap.error("bad cell %r (one:C, all:D, ...)" % c)
        cells.append((posters, scen))
    per_cell = 12 + args.phases * (args.settle + args.window + 0.5)
    benchcli.announce(__doc__, args.rounds * len(libs) * len(cells)
                      * per_cell, args.out)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    runs = []
    for r in range(args.rounds):
        for posters, scen in cells:
            for lib in (libs if r % 2 == 0 else list(reversed(libs))):
                load0 = float(eb.loadavg()[0])
                c = cell(lib, posters, scen, args.phases, args.settle,
                         args.window)
                c["round"] = r
                c["loadavg_1m"] = [load0, float(eb.loadavg()[0])]
                runs.append(c)
                print("%s:%s %-10s round %d: median on/off %.3f, "
                      "delivered %s %%" % (
                          posters, scen, lib, r,
                          onoff.summary([c])["median_ratio"],
                          "%.1f" % c["delivered_pct_worst"]
                          if c["delivered_pct_worst"] is not None
                          else "n/a"), flush=True)
                write(args, libs, cells, runs, started)
    print(table(args.out))


def write(args, libs, cells, runs, started):
    summary = {}
    for posters, scen in cells:
        for lib in libs:
            mine = [c for c in runs if c["lib"] == lib
                    and c["posters"] == posters and c["scenario"] == scen]
            sm = onoff.summary(mine)
            if sm:
                sm["delivered_pct_worst"] = min(
                    (c["delivered_pct_worst"] for c in mine
                     if c["delivered_pct_worst"] is not None), default=None)
                p99 = [c["bus_latency_p99_ms"] for c in mine
                       if "bus_latency_p99_ms" in c]
                sm["bus_latency_p99_ms"] = max(p99) if p99 else None
                summary["%s:%s:%s" % (posters, scen, lib)] = sm
    with open(args.out, "w") as f:
        json.dump({"started": started, "phases": args.phases,
                   "settle_s": args.settle, "window_s": args.window,
                   "libs": libs, "summary": summary, "runs": runs}, f,
                  indent=1)


def table(path):
    with open(path) as f:
        d = json.load(f)
    lines = ["| posting | lib | req/s on / off (median of pairs) | q1-q3 "
             "| pairs | req/s on, off | delivered (worst worker) "
             "| bus p99 ms |", "|---|---|---|---|---|---|---|---|"]
    for key, s in d["summary"].items():
        posters, scen, lib = key.split(":", 2)
        lines.append("| %s, %s | %s | %.3f | %.3f-%.3f | %d | %d, %d | %s "
                     "| %s |" % (
                         posters, eb.SCENARIOS[scen][2], lib,
                         s["median_ratio"], s["q1"], s["q3"], s["pairs"],
                         s["median_rps_on"], s["median_rps_off"],
                         "%.1f %%" % s["delivered_pct_worst"]
                         if s["delivered_pct_worst"] is not None else "n/a",
                         "%.1f" % s["bus_latency_p99_ms"]
                         if s["bus_latency_p99_ms"] is not None else "-"))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
