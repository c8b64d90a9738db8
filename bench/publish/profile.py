#!/usr/bin/env python3
"""Where a published message's microseconds go (bench/publish).

Starts the bench's nginx (bench/publish/run.py, 2 workers) and fast sink,
loads one scenario's location with wrk, and profiles the workers while it
runs:

  perf      perf record -e cpu-clock -g on the workers (the machine's
            symbols: nginx, LuaJIT's VM, the kernel; JIT-compiled code
            shows as unknown addresses)
  jitp      LuaJIT's sampling profiler (jit.p) in each worker, by Lua
            function and VM state ("vF": interpreted, compiled, C, GC, ...)

Usage (under /work/wt/run-bench when timing matters):
  profile.py perf|jitp [path, /loom] [seconds, 15]
Output goes to /tmp/loom-publish-profile/.
"""

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import run  # noqa: E402

OUT = "/tmp/loom-publish-profile"

JITP = """
    do
        ngx.timer.at(2, function()
            local p = require "jit.p"
            p.start("%(mode)s", "%(out)s/jitp-" .. ngx.worker.pid() .. ".txt")
            ngx.timer.at(%(secs)d, function() p.stop() end)
        end)
    end
"""


def main():
    tool = sys.argv[1] if len(sys.argv) > 1 else "perf"
    path = sys.argv[2] if len(sys.argv) > 2 else "/loom"
    secs = int(sys.argv[3]) if len(sys.argv) > 3 else 15
    os.makedirs(OUT, exist_ok=True)
    if tool == "jitp":
        run.HTTP = run.HTTP.replace(
            "BENCH = {}", "BENCH = {}\n" + JITP % {
                "mode": os.environ.get("JITP_MODE", "vF"), "out": OUT,
                "secs": secs})
    fake = run.FastSink()
    n = run.start_nginx(fake.host)
    try:
        pids = n.worker_pids()
        run.DURATION = secs + 4
        perf = None
        if tool == "perf":
            perf = subprocess.Popen(
                ["perf", "record", "-e", "cpu-clock", "-g", "-o",
                 os.path.join(OUT, "perf-%s.data" % path.strip("/")),
                 "-p", ",".join(map(str, pids)), "--", "sleep", str(secs)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.time()
        c0 = run.cpu_ticks(pids)
        res = run.wrk(n.url(path))
        c1 = run.cpu_ticks(pids)
        el = time.time() - t0
        if perf:
            perf.wait()
        print("rps %.0f, worker CPU %.2f us per request" % (
            res["rps"], 1e6 * (c1 - c0) / os.sysconf("SC_CLK_TCK")
            / res["requests"]))
        print("elapsed %.1f s; output in %s" % (el, OUT))
    finally:
        n.stop()
        fake.close()


if __name__ == "__main__":
    main()
