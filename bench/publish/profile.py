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
  cpu       no wrk: one request publishes N messages in a loop (yielding
            every 500) and waits for their acknowledgements; the worker's
            CPU time (getrusage) per message, minus the same loop without
            send(). Repeated R times: the medians. Much less noisy than
            req/s on a shared machine, for an A/B of the publishing path.

Usage (under /work/wt/run-bench when timing matters):
  profile.py perf|jitp [path, /loom] [seconds, 15]
  profile.py cpu [messages, 200000] [repeats, 5]
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


CPU_LOCATION = """
location = /cpu {
    content_by_lua_block {
        local ffi = require "ffi"
        pcall(ffi.cdef, [[
        struct loom_bench_ru { long ut_s, ut_us, st_s, st_us, rest[14]; };
        int getrusage(int who, struct loom_bench_ru *ru);
        ]])
        local ru = ffi.new("struct loom_bench_ru")
        local function cpu()
            ffi.C.getrusage(0, ru)
            return tonumber(ru.ut_s + ru.st_s)
                   + tonumber(ru.ut_us + ru.st_us) / 1e6
        end
        local n = tonumber(ngx.var.arg_n)
        local publish = ngx.var.arg_send == "1"
        local shm = ngx.shared.bench
        local p, data = BENCH.p, BENCH.data
        local a0 = shm:get("acked") or 0
        local c0 = cpu()
        for i = 1, n do
            local attrs = { host = "edge-1", path = ngx.var.uri,
                            seq = tostring(i) }
            if publish then
                while not p:send(data, attrs) do
                    ngx.sleep(0.001)
                end
            end
            if i % 500 == 0 then
                ngx.sleep(0)
            end
        end
        while publish and (shm:get("acked") or 0) - a0 < n do
            ngx.sleep(0.001)
        end
        ngx.say(cpu() - c0)
    }
}
"""


def cpu_mode(n, reps):
    import statistics
    run.SERVER = run.SERVER + CPU_LOCATION
    fake = run.FastSink()
    inst = run.start_nginx(fake.host)
    try:
        if os.environ.get("PROFILE_PERF"):
            # one recorded run of the publishing loop (after a warm-up)
            inst.get("/cpu?n=%d&send=1" % n, timeout=120)
            pids = inst.worker_pids()
            out = os.path.join(OUT, "perf-cpu.data")
            perf = subprocess.Popen(
                ["perf", "record", "-e", "cpu-clock", "-o", out, "-p",
                 ",".join(map(str, pids))],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1)
            inst.get("/cpu?n=%d&send=1" % n, timeout=120)
            perf.send_signal(2)
            perf.wait()
            print("perf data in", out)
        per = []
        for r in range(reps + 1):
            t = {}
            for send in ("0", "1"):
                t[send] = float(inst.get("/cpu?n=%d&send=%s" % (n, send),
                                         timeout=120).text)
            if r:       # the first is a warm-up
                per.append(1e6 * (t["1"] - t["0"]) / n)
                print("publishing: %.3f us of worker CPU per message "
                      "(loop alone %.3f)" % (per[-1], 1e6 * t["0"] / n),
                      flush=True)
        print("median %.3f us per message" % statistics.median(per))
    finally:
        inst.stop()
        fake.close()


def main():
    tool = sys.argv[1] if len(sys.argv) > 1 else "perf"
    if tool == "cpu":
        return cpu_mode(int(sys.argv[2]) if len(sys.argv) > 2 else 200000,
                        int(sys.argv[3]) if len(sys.argv) > 3 else 5)
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
