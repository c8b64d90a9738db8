#!/usr/bin/env python3
"""bench-watchdog: what the always-on watchdog costs, and how fast it reports.

Two nginx instances side by side (one worker each, same config) serve
ngx.say("hello"); one starts resty.loom.watchdog in init_worker, the other
does not. wrk -t1 -c64 -d<D>s --latency runs against them alternately
(off on off on ...), and the medians of RPS and p99 are compared. Then the
"on" instance is made to stall (CPU loop, FFI usleep, os.execute) and the
report timings are read back: stall start -> noticed by the watchdog, stall
end -> report built and logged.

It also runs bench/watchdog/profile_mode.lua (plain LuaJIT): the cost of
LuaJIT's profiler line mode for compiled code.

Environment: BENCH_ROUNDS (3), BENCH_DURATION (10, seconds),
BENCH_STALLS (6). Results: bench/results/watchdog.json.
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

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
DURATION = int(os.environ.get("BENCH_DURATION", "10"))
STALLS = int(os.environ.get("BENCH_STALLS", "6"))

SERVER = """
location = /hello { content_by_lua_block { ngx.say("hello") } }
location = /cpu {
    content_by_lua_block {
        require("watchdog_cases").cpu(150)
        ngx.say("ok")
    }
}
location = /usleep {
    content_by_lua_block {
        require("watchdog_cases").sleep_ffi(150)
        ngx.say("ok")
    }
}
location = /exec {
    content_by_lua_block {
        require("watchdog_cases").sleep_exec(0.15)
        ngx.say("ok")
    }
}
location = /reports {
    content_by_lua_block {
        local ok, wd = pcall(require, "resty.loom.watchdog")
        ngx.say(require("cjson").encode({ reports = wd.reports() }))
    }
}
"""

ON = """
init_worker_by_lua_block {
    assert(require("resty.loom.watchdog").start({ threshold = 100 }))
}
"""


def cpu_seconds(pid):
    """utime + stime of a process (all its threads), seconds."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wrk(n):
    pid = n.worker_pids()[0]
    cpu0 = cpu_seconds(pid)
    out = subprocess.run(
        ["wrk", "-t1", "-c64", "-d%ds" % DURATION, "--latency",
         n.url("/hello")], capture_output=True, text=True, check=True).stdout
    cpu = cpu_seconds(pid) - cpu0
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    reqs = int(re.search(r"(\d+) requests in", out).group(1))
    m = re.search(r"99%\s+([\d.]+)(us|ms|s)", out)
    scale = {"us": 0.001, "ms": 1.0, "s": 1000.0}[m.group(2)]
    return rps, float(m.group(1)) * scale, cpu * 1e6 / max(reqs, 1)


def main():
    off = Nginx(workers=1, server=SERVER, error_log_level="warn")
    on = Nginx(workers=1, server=SERVER, http=ON, error_log_level="warn")
    off.start()
    on.start()
    results = {"off": [], "on": []}
    try:
        for n in (off, on):      # warm up
            subprocess.run(["wrk", "-t1", "-c64", "-d2s", n.url("/hello")],
                           capture_output=True, check=True)
        for i in range(ROUNDS):
            for name, n in (("off", off), ("on", on)):
                rps, p99, us = wrk(n)
                results[name].append({"rps": rps, "p99_ms": p99,
                                      "worker_cpu_us_per_request": us})
                print("round %d %-3s rps %9.0f  p99 %7.3f ms  cpu/req "
                      "%6.2f us" % (i + 1, name, rps, p99, us), flush=True)

        kinds = ("/cpu", "/usleep", "/exec")
        for i in range(STALLS):
            on.get(kinds[i % len(kinds)], timeout=20)
            time.sleep(0.2)
        time.sleep(1)
        reports = on.get("/reports").json()["reports"]
    finally:
        off.stop()
        on.stop()
        off.cleanup()
        on.cleanup()

    med = {k: {"rps": statistics.median(x["rps"] for x in v),
               "p99_ms": statistics.median(x["p99_ms"] for x in v),
               "worker_cpu_us_per_request": statistics.median(
                   x["worker_cpu_us_per_request"] for x in v)}
           for k, v in results.items()}
    ratio = med["on"]["rps"] / med["off"]["rps"]
    cpu_ratio = (med["on"]["worker_cpu_us_per_request"]
                 / med["off"]["worker_cpu_us_per_request"])
    # stalls of /hello itself (the machine starving the worker, or worse):
    # keep their evidence
    other = [{k: r.get(k) for k in (
        "duration_ms", "kind", "on_cpu_ms", "off_cpu_ms", "runqueue_ms",
        "syscall", "wchan", "backtrace", "request", "vmstate")}
        for r in reports if r.get("request", {}).get("uri") not in (
            "/cpu", "/usleep", "/exec")]
    reports = [r for r in reports if r.get("request", {}).get("uri") in (
        "/cpu", "/usleep", "/exec")]
    detect = [r["detect_ms"] for r in reports]
    after = [r["reported_after_ms"] for r in reports]
    out = {
        "benchmark": "ngx.say('hello'), 1 worker, wrk -t1 -c64 -d%ds "
                     "--latency, watchdog off/on alternated, %d rounds"
                     % (DURATION, ROUNDS),
        "note": "measured on a shared 2-core machine with other "
                "developers' load present: absolute numbers are noisy, "
                "compare the alternated medians only",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rounds": results,
        "median": med,
        "rps_ratio_on_off": round(ratio, 4),
        "worker_cpu_per_request_ratio_on_off": round(cpu_ratio, 4),
        "stalls": {
            "made": STALLS,
            "reported": len(reports),
            "threshold_ms": 100,
            "detect_ms_median": statistics.median(detect) if detect else None,
            "detect_ms_max": max(detect) if detect else None,
            "stall_start_to_report_ms_median": statistics.median(
                r["duration_ms"] + r["reported_after_ms"] for r in reports)
            if reports else None,
            "stall_end_to_report_ms_median":
                statistics.median(after) if after else None,
            "stall_end_to_report_ms_max": max(after) if after else None,
            "kinds": [[r["request"]["uri"], r["kind"], r.get("syscall"),
                       r["duration_ms"]] for r in reports],
        },
        "stalls_during_throughput_rounds": other,
    }
    # compiled-code cost of the profiler's line mode, in plain LuaJIT
    try:
        pm = subprocess.run(
            ["luajit", os.path.join(ROOT, "bench", "watchdog",
                                    "profile_mode.lua"), "9"],
            capture_output=True, text=True, check=True, cwd=ROOT)
        out["profile_line_mode"] = json.loads(pm.stdout.strip())
        out["profile_line_mode"]["what"] = (
            "CPU seconds of a Lua workload (string keys, tables, concat) "
            "without / with jit.profile line mode and a timer that never "
            "fires, 9 alternated rounds, medians")
    except (OSError, subprocess.CalledProcessError, ValueError) as e:
        out["profile_line_mode"] = {"error": str(e)}

    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    path = os.path.join(ROOT, "bench", "results", "watchdog.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps({"median": med, "rps_ratio_on_off": out[
        "rps_ratio_on_off"], "cpu_ratio": out[
        "worker_cpu_per_request_ratio_on_off"], "stalls": out["stalls"]},
        indent=2))
    print("wrote", path)


if __name__ == "__main__":
    benchcli.parser(__doc__).parse_args()       # --help; no options
    # warm-up, off/on wrk rounds, the stalls, LuaJIT's profiler runs
    benchcli.announce(__doc__, 4 + ROUNDS * 2 * (DURATION + 1) + STALLS
                      + 20, "bench/results/watchdog.json")
    main()
