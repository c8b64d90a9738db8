#!/usr/bin/env python3
"""bench-watchdog: what the always-on watchdog costs, and how fast it reports.

Two nginx instances side by side (one worker each, same config) serve
ngx.say("hello"); one starts resty.loom.watchdog in init_worker, the other
does not. wrk -t1 -c64 -d<D>s --latency runs against them alternately
(off on off on ...), and the medians of RPS and p99 are compared. Then the
"on" instance is made to stall (CPU loop, FFI usleep, os.execute) and the
report timings are read back: stall start -> noticed by the watchdog, stall
end -> report built and logged.

The direct cost, which the on/off comparison cannot resolve on a noisy
host: during each "on" wrk window, the CPU of the watchdog thread (task
"loom-watchdog": utime+stime of /proc/<pid>/task/<tid>/stat, and its
schedstat run time in ns) and of the worker's main thread, and the loop
iterations counted by the watchdog; bench/watchdog/loop_cost.c (the
module's own per-iteration code, built with the module's -O) gives the ns
added per iteration. Cost per request = (thread CPU + ns per iteration x
iterations) / requests, as a % of the main thread's CPU per request.

It also runs bench/watchdog/profile_mode.lua (plain LuaJIT): the cost of
LuaJIT's profiler line mode for compiled code.

Environment: BENCH_ROUNDS (3), BENCH_DURATION (10, seconds),
BENCH_STALLS (6), BENCH_LOOP_N (2000000, iterations per loop_cost run),
BENCH_BASELINE_MODULE (another build of ngx_loom_module.so: a third
instance, "base", runs the watchdog from it, alternated with the others,
for a before/after in the same run).
Results: bench/results/watchdog.json.
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

from loomtest.nginx import LOOM_MODULE, Nginx  # noqa: E402
sys.path.insert(0, os.path.join(ROOT, "bench"))
import benchcli  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
DURATION = int(os.environ.get("BENCH_DURATION", "10"))
STALLS = int(os.environ.get("BENCH_STALLS", "6"))
LOOP_N = int(os.environ.get("BENCH_LOOP_N", "2000000"))
THREAD_NAME = "loom-watchdog"      # pthread_setname_np in _thread.c
BASE_MODULE = os.environ.get("BENCH_BASELINE_MODULE")

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
location = /wdstats {
    content_by_lua_block {
        local ok, wd = pcall(require, "resty.loom.watchdog")
        local s = ok and wd.stats() or {}
        ngx.say(require("cjson").encode({ iterations = s.iterations }))
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


def task_cpu(pid, tid):
    """(utime + stime in seconds, schedstat run time in ns) of one task."""
    base = "/proc/%d/task/%d/" % (pid, tid)
    with open(base + "stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    with open(base + "schedstat") as f:
        run_ns = int(f.read().split()[0])
    return ticks, run_ns


def find_task(pid, name):
    others = [int(t) for t in os.listdir("/proc/%d/task" % pid)
              if int(t) != pid]
    for tid in others:
        with open("/proc/%d/task/%d/comm" % (pid, tid)) as f:
            if f.read().strip() == name:
                return tid
    # a baseline build may not name its thread: the worker's only other one
    return others[0] if len(others) == 1 else None


def iterations(n):
    return n.get("/wdstats").json().get("iterations")


def wrk(n, direct=False):
    pid = n.worker_pids()[0]
    tid = find_task(pid, THREAD_NAME) if direct else None
    if direct and tid is None:
        raise SystemExit("no %s thread in worker %d" % (THREAD_NAME, pid))
    it0 = iterations(n) if direct else None
    cpu0 = cpu_seconds(pid)
    main0 = task_cpu(pid, pid)
    th0 = task_cpu(pid, tid) if tid else None
    out = subprocess.run(
        ["wrk", "-t1", "-c64", "-d%ds" % DURATION, "--latency",
         n.url("/hello")], capture_output=True, text=True, check=True).stdout
    cpu = cpu_seconds(pid) - cpu0
    main1 = task_cpu(pid, pid)
    th1 = task_cpu(pid, tid) if tid else None
    it1 = iterations(n) if direct else None
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    reqs = max(int(re.search(r"(\d+) requests in", out).group(1)), 1)
    m = re.search(r"99%\s+([\d.]+)(us|ms|s)", out)
    scale = {"us": 0.001, "ms": 1.0, "s": 1000.0}[m.group(2)]
    row = {"rps": rps, "p99_ms": float(m.group(1)) * scale,
           "worker_cpu_us_per_request": cpu * 1e6 / reqs,
           "main_thread_ns_per_request": (main1[1] - main0[1]) / reqs}
    if direct:
        row.update({
            "requests": reqs,
            # two /wdstats requests in the window: negligible
            "loop_iterations": it1 - it0,
            "iterations_per_request": (it1 - it0) / reqs,
            "watchdog_thread_cpu_s_stat": round(th1[0] - th0[0], 3),
            "watchdog_thread_run_ns": th1[1] - th0[1],
            "watchdog_thread_ns_per_request": (th1[1] - th0[1]) / reqs,
            "main_thread_cpu_s_stat": round(main1[0] - main0[0], 3),
        })
    return row


def loop_cost():
    """ns the module's per-iteration code adds (bench/watchdog/loop_cost.c)"""
    exe = os.path.join(ROOT, "build", "wd-loop-cost")
    os.makedirs(os.path.dirname(exe), exist_ok=True)
    # the module's own flags (nginx's objs/Makefile: -O)
    subprocess.run(["cc", "-O", "-W", "-Wall", "-Wno-unused-parameter",
                    "-I", os.path.join(ROOT, "src"), "-o", exe,
                    os.path.join(ROOT, "bench", "watchdog", "loop_cost.c")],
                   check=True)
    out = subprocess.run([exe, str(LOOP_N), "15"], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)


def direct_cost(rows, per_iter):
    """the direct cost per request of a watchdog instance's rounds"""
    rounds = []
    for x in rows:
        loop_ns = per_iter * x["iterations_per_request"]
        thread_ns = x["watchdog_thread_ns_per_request"]
        main_ns = x["main_thread_ns_per_request"]
        rounds.append({
            "loop_ns_per_request": round(loop_ns, 2),
            "thread_ns_per_request": round(thread_ns, 2),
            "loop_pct": round(100 * loop_ns / main_ns, 4),
            "thread_pct": round(100 * thread_ns / main_ns, 4),
            "total_pct": round(100 * (loop_ns + thread_ns) / main_ns, 4)})
    d = {
        "iterations_per_request": statistics.median(
            x["iterations_per_request"] for x in rows),
        "main_thread_ns_per_request": statistics.median(
            x["main_thread_ns_per_request"] for x in rows),
        "rounds": rounds,
    }
    for k in ("loop_ns_per_request", "thread_ns_per_request", "loop_pct",
              "thread_pct", "total_pct"):
        d[k] = statistics.median(r[k] for r in rounds)
    return d


def main():
    off = Nginx(workers=1, server=SERVER, error_log_level="warn")
    on = Nginx(workers=1, server=SERVER, http=ON, error_log_level="warn")
    instances = [("off", off), ("on", on)]
    if BASE_MODULE:
        base = Nginx(workers=1, server=SERVER, http=ON,
                     error_log_level="warn")
        base.conf = base.conf.replace(LOOM_MODULE,
                                      os.path.abspath(BASE_MODULE))
        with open(base.conf_path, "w") as f:
            f.write(base.conf)
        instances.insert(1, ("base", base))
    for _, n in instances:
        n.start()
    results = {name: [] for name, _ in instances}
    try:
        for _, n in instances:      # warm up
            subprocess.run(["wrk", "-t1", "-c64", "-d2s", n.url("/hello")],
                           capture_output=True, check=True)
        for i in range(ROUNDS):
            for name, n in instances:
                row = wrk(n, direct=(name != "off"))
                results[name].append(row)
                print("round %d %-4s rps %9.0f  p99 %7.3f ms  cpu/req "
                      "%6.2f us" % (i + 1, name, row["rps"], row["p99_ms"],
                                    row["worker_cpu_us_per_request"]),
                      flush=True)
                if name != "off":
                    print("          iterations/req %.3f  watchdog thread "
                          "%.1f ns/req  main thread %.0f ns/req" % (
                              row["iterations_per_request"],
                              row["watchdog_thread_ns_per_request"],
                              row["main_thread_ns_per_request"]),
                          flush=True)

        kinds = ("/cpu", "/usleep", "/exec")
        for i in range(STALLS):
            on.get(kinds[i % len(kinds)], timeout=20)
            time.sleep(0.2)
        time.sleep(1)
        reports = on.get("/reports").json()["reports"]
    finally:
        for _, n in instances:
            n.stop()
            n.cleanup()

    med = {k: {"rps": statistics.median(x["rps"] for x in v),
               "p99_ms": statistics.median(x["p99_ms"] for x in v),
               "worker_cpu_us_per_request": statistics.median(
                   x["worker_cpu_us_per_request"] for x in v),
               "main_thread_ns_per_request": statistics.median(
                   x["main_thread_ns_per_request"] for x in v)}
           for k, v in results.items()}

    # the direct cost, per round of each watchdog instance, then medians;
    # the per-iteration code is the same in a baseline build of this
    # release (the thread is what changed)
    lc = loop_cost()
    direct = {
        "what": "(watchdog thread run time + ns added per loop iteration "
                "x iterations) per request, as a % of the worker main "
                "thread's run time per request (schedstat), during the "
                "wrk rounds of each watchdog instance; medians of the "
                "rounds",
        "loop_cost": lc,
        "on": direct_cost(results["on"], lc["added_ns_per_iteration"]),
    }
    if BASE_MODULE:
        direct["base"] = direct_cost(results["base"],
                                     lc["added_ns_per_iteration"])
        direct["base_module"] = os.path.abspath(BASE_MODULE)
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
                     "--latency, watchdog %s alternated, %d rounds"
                     % (DURATION, "/".join(k for k, _ in instances), ROUNDS),
        "note": "measured on a shared 2-core machine with other "
                "developers' load present: absolute numbers are noisy, "
                "compare the alternated medians only",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rounds": results,
        "median": med,
        "rps_ratio_on_off": round(ratio, 4),
        "rps_ratio_base_off": round(med["base"]["rps"] / med["off"]["rps"],
                                    4) if BASE_MODULE else None,
        "worker_cpu_per_request_ratio_on_off": round(cpu_ratio, 4),
        "direct_cost": direct,
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
        "worker_cpu_per_request_ratio_on_off"], "direct_cost": {
            k: ({kk: vv for kk, vv in v.items() if kk != "rounds"}
                if isinstance(v, dict) else v)
            for k, v in direct.items()},
        "stalls": out["stalls"]},
        indent=2))
    print("wrote", path)


if __name__ == "__main__":
    benchcli.parser(__doc__).parse_args()       # --help; no options
    # warm-up, off/on wrk rounds, the stalls, LuaJIT's profiler runs
    benchcli.announce(__doc__, 4 + ROUNDS * (3 if BASE_MODULE else 2)
                      * (DURATION + 1) + STALLS + 30,
                      "bench/results/watchdog.json")
    main()
