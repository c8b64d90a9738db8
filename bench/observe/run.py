#!/usr/bin/env python3
"""bench-observe: what scraping /loom/metrics every second costs the example
gateway. wrk drives the gateway's / for --duration seconds per cell; cells
alternate A (nobody scrapes) and B (a scraper GETs /loom/metrics every
second, like Prometheus) in one run, --pairs times; the figures are the
medians and the B/A ratio of each pair, of req/s and of worker CPU per
request (from /proc, less blurred by other processes than req/s).

  python3 bench/observe/run.py [--pairs 20] [--duration 3] [--connections 32]

Writes bench/results/observe.json. Needs wrk and a built module (make build,
make runtimes). The machine may be shared: the "noise" field gives the
spread of the A cells and the load average.
"""

import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from loomtest.gateway import Gateway  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "bench"))
import benchcli  # noqa: E402


class Scraper(threading.Thread):
    """GETs /loom/metrics every interval seconds until stopped."""

    def __init__(self, port, interval=1.0):
        super().__init__(daemon=True)
        self.port, self.interval = port, interval
        self.stop = threading.Event()
        self.times, self.sizes, self.failures = [], [], 0

    def run(self):
        next_at = time.time()
        while not self.stop.is_set():
            start = time.time()
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port,
                                               timeout=5)
                c.request("GET", "/loom/metrics")
                r = c.getresponse()
                body = r.read()
                c.close()
                if r.status != 200:
                    self.failures += 1
                else:
                    self.sizes.append(len(body))
                    self.times.append(time.time() - start)
            except OSError:
                self.failures += 1
            next_at += self.interval
            self.stop.wait(max(0, next_at - time.time()))


CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids):
    total = 0
    for pid in pids:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])     # utime + stime
    return total / CLK_TCK


def cpu_per_scrape(g, count=300):
    """Worker CPU (all workers) per GET /loom/metrics of an idle gateway:
    the figure the host's noise does not blur."""
    pids = g.worker_pids()
    c = http.client.HTTPConnection("127.0.0.1", g.port, timeout=5)
    before = cpu_seconds(pids)
    start = time.time()
    for _ in range(count):
        c.request("GET", "/loom/metrics")
        r = c.getresponse()
        r.read()
        assert r.status == 200
    took = time.time() - start
    used = cpu_seconds(pids) - before
    c.close()
    return used / count, took / count


def wrk(port, duration, connections):
    out = subprocess.run(
        ["wrk", "-t2", "-c%d" % connections, "-d%ds" % duration,
         "http://127.0.0.1:%d/" % port],
        capture_output=True, text=True, check=True).stdout
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    n = re.search(r"(\d+) requests in", out)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return (float(m.group(1)), int(n.group(1)),
            int(errors.group(1)) if errors else 0)


def main():
    ap = benchcli.parser(__doc__)
    ap.add_argument("--pairs", type=int, default=20,
                    help="A/B pairs of cells (default 20)")
    ap.add_argument("--duration", type=int, default=3,
                    help="seconds of wrk per cell (default 3)")
    ap.add_argument("--connections", type=int, default=32,
                    help="wrk connections (default 32)")
    args = ap.parse_args()
    benchcli.announce(__doc__, args.pairs * 2 * (args.duration + 1) + 15,
                      os.path.join("bench", "results", "observe.json"))

    g = Gateway().start()
    load_before = os.getloadavg()
    cells = []
    scrapes = []
    try:
        wrk(g.port, 2, args.connections)            # warm up
        pids = g.worker_pids()
        cpu, wall = cpu_per_scrape(g)
        print("idle gateway: %.2f ms worker CPU, %.2f ms wall per scrape"
              % (cpu * 1000, wall * 1000), flush=True)
        for i in range(args.pairs):
            for variant in ("A", "B"):
                s = None
                if variant == "B":
                    s = Scraper(g.port)
                    s.start()
                cpu0 = cpu_seconds(pids)
                rps, reqs, bad = wrk(g.port, args.duration, args.connections)
                cpu_us = (cpu_seconds(pids) - cpu0) / reqs * 1e6
                if s:
                    s.stop.set()
                    s.join()
                    scrapes.append(s)
                cells.append({"pair": i, "variant": variant, "rps": rps,
                              "worker_cpu_us_per_request": round(cpu_us, 3),
                              "non_2xx": bad,
                              "scrapes": len(s.times) if s else 0,
                              "scrape_failures": s.failures if s else 0})
                print("pair %d %s: %.0f req/s, %.2f us CPU/req%s" % (
                    i, variant, rps, cpu_us,
                    " (%d scrapes)" % len(s.times) if s else ""), flush=True)
    finally:
        g.stop()
    load_after = os.getloadavg()

    a = [c["rps"] for c in cells if c["variant"] == "A"]
    b = [c["rps"] for c in cells if c["variant"] == "B"]
    ratios = [cb / ca for ca, cb in zip(a, b)]
    cpu_a = [c["worker_cpu_us_per_request"] for c in cells
             if c["variant"] == "A"]
    cpu_b = [c["worker_cpu_us_per_request"] for c in cells
             if c["variant"] == "B"]
    cpu_ratios = [cb / ca for ca, cb in zip(cpu_a, cpu_b)]
    times = [t for s in scrapes for t in s.times]
    sizes = [n for s in scrapes for n in s.sizes]
    result = {
        "what": "example gateway GET / req/s, without (A) and with (B) a "
                "GET /loom/metrics every second",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "nproc": os.cpu_count(),
        "workers": 2,
        "duration_s": args.duration,
        "connections": args.connections,
        "cells": cells,
        "median_rps_a": statistics.median(a),
        "median_rps_b": statistics.median(b),
        "pair_ratios_b_over_a": [round(r, 4) for r in ratios],
        "median_ratio_b_over_a": round(statistics.median(ratios), 4),
        "median_cost_percent": round(
            (1 - statistics.median(ratios)) * 100, 2),
        "median_cpu_us_per_request_a": statistics.median(cpu_a),
        "median_cpu_us_per_request_b": statistics.median(cpu_b),
        "median_cpu_ratio_b_over_a": round(statistics.median(cpu_ratios), 4),
        "scrape_median_ms": round(statistics.median(times) * 1000, 2)
        if times else None,
        "scrape_bytes": statistics.median(sizes) if sizes else None,
        "scrape_failures": sum(s.failures for s in scrapes),
        "idle_scrape_worker_cpu_ms": round(cpu * 1000, 3),
        "idle_scrape_wall_ms": round(wall * 1000, 3),
        "noise": {
            "a_min_max_spread_percent": round(
                (max(a) - min(a)) / statistics.median(a) * 100, 1),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in load_after],
        },
    }
    path = os.path.join(ROOT, "bench", "results", "observe.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(json.dumps({k: v for k, v in result.items() if k != "cells"},
                     indent=1))


if __name__ == "__main__":
    main()
