#!/usr/bin/env python3
"""How long the broker's acknowledgements take under a flood (bench-events).

A publisher's events stay in its queue (counted against max_queue) until
the broker acknowledges them. 2 workers; worker 1 publishes a probe event
to worker 0 every 10 ms and times, with a monotonic clock, how long until
the broker has acknowledged it. Meanwhile, per scenario:

  slow  worker 0 floods worker 1 (overflow = "wait", as fast as the bus
        lets it), whose handler spins 20 µs per event: worker 1 is behind,
        back-pressure holds the broker's writes to it
  fast  the same with a handler that does nothing
  both  both workers flood "all" (overflow = "wait"), handlers do nothing
  idle  no flood (the floor)

Versions: ACK_LIBS="name=<lib dir>,name=<lib dir>" (default: this
checkout's lib/ as "current"), run alternately A B A B, REPEAT rounds
(3) of BENCH_DURATION seconds (4). Prints p50 / p99 / max in ms per
scenario and version, medians over rounds; writes BENCH_OUT
(bench/results/events-ack.json) when set to a path.
"""

import json
import os
import statistics
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from loomtest.nginx import Nginx  # noqa: E402

REPEAT = int(os.environ.get("REPEAT", "3"))
DURATION = float(os.environ.get("BENCH_DURATION", "4"))
SCENARIOS = os.environ.get("BENCH_SCENARIOS", "slow,fast,idle").split(",")
OUT = os.environ.get("BENCH_OUT")
LIBS = [tuple(x.split("=", 1)) for x in os.environ.get(
    "ACK_LIBS", "current=" + os.path.join(ROOT, "lib")).split(",")]

HTTP = r"""
    init_by_lua_block {
        package.path = "%(lib)s/?.lua;" .. package.path
        require("resty.loom.events").new({
            socket = ngx.config.prefix() .. "sock/bus.sock",
            overflow = "wait",
        })
    }
    init_worker_by_lua_block {
        local ffi = require "ffi"
        ffi.cdef [[
        typedef struct { long sec; long nsec; } ack_ts_t;
        int ack_clock_gettime(int clk, ack_ts_t *ts)
            __asm__("clock_gettime");
        ]]
        local ts = ffi.new("ack_ts_t")
        local function mono()
            ffi.C.ack_clock_gettime(1, ts)
            return tonumber(ts.sec) + tonumber(ts.nsec) * 1e-9
        end
        local scenario = "%(scenario)s"
        local bus = require("resty.loom.events").get()
        assert(bus:init_worker())
        local wid = ngx.worker.id()
        bus:subscribe("flood", "e", function()
            if scenario == "slow" and wid == 1 then
                local till = mono() + 20e-6
                while mono() < till do end
            end
        end)
        local function flood(target)
            ngx.timer.at(0.2, function()
                while not ngx.worker.exiting() do
                    for i = 1, 1000 do
                        bus:publish(target, "flood", "e", i)
                    end
                    ngx.sleep(0)
                end
            end)
        end
        if (scenario == "slow" or scenario == "fast") and wid == 0 then
            flood("others")
        elseif scenario == "both" then
            flood("all")
        end
        if wid == 1 then
            ACK = {}
            ngx.timer.at(0.5, function()
                local huge = math.huge
                local deadline = ngx.now() + %(duration)f
                while ngx.now() < deadline do
                    local t0 = mono()
                    if bus:publish(0, "probe", "p", 1) then
                        local seq = bus.seq
                        while math.min(bus.unsent_q:peek() or huge,
                                       bus.unacked_q:peek() or huge)
                              <= seq do
                            local ok = bus.space:wait(1)
                            if not ok then
                                -- (no wake-up: the figure would be the
                                -- wait's, so it is counted apart)
                                ACK.timeouts = (ACK.timeouts or 0) + 1
                            end
                        end
                        ACK[#ACK + 1] = mono() - t0
                    end
                    ngx.sleep(0.01)
                end
                ACK.done = true
            end)
        end
    }
    server {
        listen unix:$PREFIX/sock/bus.sock;
        lua_socket_buffer_size 64k;
        location / {
            content_by_lua_block { require("resty.loom.events").get():serve() }
        }
    }
"""

SERVER = r"""
    location /ack { content_by_lua_block {
        if ngx.worker.id() ~= 1 then return ngx.exit(409) end
        if not (ACK and ACK.done) then return ngx.exit(404) end
        local t = {}
        for i = 1, #ACK do t[i] = ACK[i] end
        ngx.say(require("cjson").encode({ t = t, timeouts = ACK.timeouts }))
    } }
"""


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def run_once(lib, scenario):
    n = Nginx(workers=2, http=HTTP % {"lib": lib, "scenario": scenario,
                                      "duration": DURATION},
              server=SERVER)
    os.makedirs(os.path.join(n.prefix, "sock"), mode=0o700)
    n.start()
    try:
        deadline = time.time() + DURATION + 30
        while time.time() < deadline:
            r = n.get("/ack")
            if r.status == 200:
                got = r.json()
                xs = [x * 1000 for x in got["t"]]
                return {"n": len(xs), "timeouts": got.get("timeouts", 0),
                        "p50": pct(xs, 0.5),
                        "p99": pct(xs, 0.99), "max": max(xs)}
            time.sleep(0.2)
        raise RuntimeError("no answer")
    finally:
        n.stop()
        n.cleanup()


def main():
    results = {}
    for scenario in SCENARIOS:
        for r in range(REPEAT):
            order = LIBS if r % 2 == 0 else LIBS[::-1]
            for name, lib in order:
                got = run_once(lib, scenario)
                results.setdefault(scenario, {}).setdefault(name, []) \
                    .append(got)
                print(scenario, name, json.dumps(got), flush=True)
    summary = {}
    for scenario, by in results.items():
        for name, runs in by.items():
            med = {k: statistics.median(x[k] for x in runs)
                   for k in ("p50", "p99", "max")}
            summary.setdefault(scenario, {})[name] = med
            print("%-5s %-10s p50 %8.2f ms  p99 %8.2f ms  max %8.2f ms" % (
                scenario, name, med["p50"], med["p99"], med["max"]))
    if OUT:
        with open(OUT, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC",
                                             time.gmtime()),
                       "duration": DURATION, "repeat": REPEAT,
                       "runs": results, "medians": summary}, f, indent=1)


if __name__ == "__main__":
    main()
