#!/usr/bin/env python3
"""Benchmark of resty.loom.offload (make bench-offload).

Echo of 64 B and 16 KiB payloads, in one nginx (2 workers), mechanisms side
by side:

  c, rust, go   our runtimes (runtimes/*, "mode=echo"), those that are built
  lua, java     our Lua and Java runtimes calling an echo handler by name
  thread        ngx.run_worker_thread (thread_pool default threads=4)
  uds           a Go sidecar on a UNIX socket, reached with cosockets and
                keepalive (bench/offload/sidecar)
  java_uds      the same in Java (bench/offload/sidecar/EchoSidecar.java)
  none          no offload: the ceiling (concurrent test only)

Jobs, concurrent test only, 4 threads each (the Lua runtime with
threads=4, run_worker_thread on the pool of 4), the same Lua module
(bench/offload/lua/offload_bench_job.lua) in both:

  lua_io, thread_io     a blocking PING to a local redis-server over
                        lua-socket, then some arithmetic
  lua_cpu, thread_cpu   arithmetic only

Sequential: microseconds per call over 100,000 calls made from one request.
Concurrent: wrk -t1 -c64 -d10s --latency on a location doing one call per
request: requests per second and p99. Passes alternate the order of the
mechanisms (A B C ... then ... C B A); figures are medians over passes.
Results: bench/results/offload.json.
"""

import datetime
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.join(
    os.path.dirname(os.path.abspath(__file__)), ".."))
import benchcli  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
TMP = os.path.join(HERE, "tmp")
NGINX = os.environ.get("LOOM_NGINX", "/usr/sbin/nginx")
MODULES = os.environ.get("LOOM_NGINX_MODULES", "/usr/share/nginx/modules")
RESULTS = os.path.join(ROOT, "bench", "results", "offload.json")

RUNTIMES = {
    "c": "runtimes/c/libloom_offload_c.so",
    "rust": "runtimes/rust/build/libloom_rt_rust_example.so",
    "go": "runtimes/go/build/libloom_rt_go_example.so",
}

JAVA_HOME = os.environ.get("JAVA_HOME_17",
                           "/usr/lib/jvm/java-17-openjdk-amd64")

# runtimes called by name: path, configuration, handler
NAMED = {
    "lua": ("runtimes/lua/build/libloom_rt_lua.so",
            "path=" + os.path.join(HERE, "lua", "?.lua"),
            "offload_bench_echo.echo"),
    "java": ("runtimes/java/build/libloom_rt_java.so",
             "classpath=" + os.path.join(
                 ROOT, "runtimes/java/build/loom-examples.jar")
             + " xmx=64m cpus=1", "loom.example.Echo"),
}

JOB_MECHS = ["lua_io", "thread_io", "lua_cpu", "thread_cpu"]

SIZES = ["64", "16384"]

CONF = """
load_module {modules}/ndk_http_module.so;
load_module {modules}/ngx_http_lua_module.so;
load_module {root}/build/ngx_loom_module.so;

worker_processes 2;
worker_rlimit_nofile 20000;
daemon on;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
{user}
thread_pool default threads=4;

events {{ worker_connections 4096; }}

http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    lua_package_path "{root}/lib/?.lua;{here}/lua/?.lua;;";

    init_by_lua_block {{
        require("offload_bench").init({libs},
            {{ uds = "unix:{sock}", java_uds = "unix:{jsock}" }}, {redis})
    }}
    init_worker_by_lua_block {{
        require("offload_bench").init_worker()
    }}

    server {{
        listen 127.0.0.1:{port} reuseport;
        location = /seq {{
            content_by_lua_block {{ require("offload_bench").seq() }}
        }}
        location = /c {{
            content_by_lua_block {{ require("offload_bench").conc() }}
        }}
        location = /stats {{
            content_by_lua_block {{ require("offload_bench").stats() }}
        }}
    }}
}}
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=300):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def loadavg():
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def to_ms(v):
    m = re.match(r"([\d.]+)(us|ms|s)$", v)
    num, unit = float(m.group(1)), m.group(2)
    return num / 1000 if unit == "us" else num * 1000 if unit == "s" else num


def cpu_ticks(pids):
    """utime + stime of the processes (all their threads), in ticks."""
    total = 0
    for pid in pids:
        try:
            with open("/proc/%d/stat" % pid) as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(rest[11]) + int(rest[12])
    return total


def children(pid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open("/proc/%s/stat" % d) as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except OSError:
                pass
    return out


def wrk(url, duration, pids):
    c0 = cpu_ticks(pids)
    out = subprocess.run(
        ["wrk", "-t1", "-c64", "-d%ds" % duration, "--latency", url],
        capture_output=True, text=True, check=True).stdout
    ticks = cpu_ticks(pids) - c0
    reqs = int(re.search(r"(\d+) requests in", out).group(1))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    lat = dict(re.findall(r"^\s+(50|75|90|99)%\s+(\S+)$", out, re.M))
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errs = re.search(r"Socket errors: (.*)", out)
    hz = os.sysconf("SC_CLK_TCK")
    return {"rps": rps, "p50_ms": to_ms(lat["50"]), "p99_ms": to_ms(lat["99"]),
            "cpu_us_per_req": round(ticks * 1e6 / hz / max(reqs, 1), 2),
            "non2xx": int(bad.group(1)) if bad else 0,
            "socket_errors": errs.group(1) if errs else ""}


def build(mechs):
    subprocess.run(["make", "-s", "-C", ROOT, "build"], check=True)
    for rt in ("c", "lua", "java"):
        subprocess.run(["make", "-s", "-C", os.path.join(ROOT, "runtimes",
                                                         rt)], check=True)
    os.makedirs(TMP, exist_ok=True)
    side = os.path.join(TMP, "sidecar")
    subprocess.run(["go", "build", "-o", side,
                    os.path.join(HERE, "sidecar", "main.go")], check=True,
                   env=dict(os.environ, GOFLAGS="-mod=mod"))
    subprocess.run([os.path.join(JAVA_HOME, "bin", "javac"), "-d", TMP,
                    os.path.join(HERE, "sidecar", "EchoSidecar.java")],
                   check=True)
    return side


def rss_kb(pid):
    with open("/proc/%d/status" % pid) as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


def main():
    ap = benchcli.parser(__doc__)
    ap.add_argument("--duration", type=int, default=10,
                    help="seconds per wrk run (default 10)")
    # 3: the median of 2 is their mean, and one pass that fell off the
    # poll fast path (another process on the CPU) decided a figure
    ap.add_argument("--passes", type=int, default=3,
                    help="alternating passes (default 3)")
    ap.add_argument("--calls", type=int, default=100000,
                    help="sequential calls per measurement (default 100000)")
    ap.add_argument("--only", default="",
                    help="comma-separated mechanisms to run")
    ap.add_argument("--sizes", default=",".join(SIZES),
                    help="comma-separated payload sizes (default %s)"
                         % ",".join(SIZES))
    ap.add_argument("--threads", type=int, default=2,
                    help="runtime threads per worker (default 2)")
    ap.add_argument("--spin-us", type=int, default=None,
                    help="opts.spin_us (default: the library's)")
    ap.add_argument("--poll-us", type=int, default=None,
                    help="opts.poll_us (default: the library's)")
    ap.add_argument("--variants", action="store_true",
                    help="also run the C runtime with spin_us=0 poll_us=0 "
                         "(c_nospin) and with poll_us=0 (c_nopoll)")
    ap.add_argument("--skip-concurrent", action="store_true",
                    help="sequential test only; its figures replace the "
                         "sequential ones in the results file, the rest is "
                         "kept")
    ap.add_argument("--no-write", action="store_true",
                    help="print results, do not write the results file")
    args = ap.parse_args()
    sizes = [s for s in args.sizes.split(",") if s in SIZES]

    libs = {k: os.path.join(ROOT, v) for k, v in RUNTIMES.items()
            if os.path.exists(os.path.join(ROOT, v))}
    opts = {"threads": args.threads, "queue": 4096}
    if args.spin_us is not None:
        opts["spin_us"] = args.spin_us
    if args.poll_us is not None:
        opts["poll_us"] = args.poll_us
    variants = {k: (v, opts) for k, v in libs.items()}
    if args.variants and "c" in libs:
        variants["c_nospin"] = (libs["c"], dict(opts, spin_us=0, poll_us=0))
        variants["c_nopoll"] = (libs["c"], dict(opts, poll_us=0))
    for k, (path, config, handler) in NAMED.items():
        variants[k] = (os.path.join(ROOT, path), opts, config, handler)
    libs = variants
    mechs = list(libs) + ["thread", "uds", "java_uds"]
    # the jobs' runtime: as many threads as run_worker_thread's pool
    libs["lua_job"] = (os.path.join(ROOT, NAMED["lua"][0]),
                       dict(opts, threads=4), NAMED["lua"][1], None)
    jobs = list(JOB_MECHS)
    if args.only:
        keep = args.only.split(",")
        mechs = [m for m in mechs if m in keep]
        jobs = [m for m in jobs if m in keep]
        libs = {k: v for k, v in libs.items()
                if k in keep or (k == "lua_job" and jobs)}
    # sequential: ~10 us a call; concurrent: one wrk run per cell
    benchcli.announce(__doc__, args.passes * len(sizes) * (
        len(mechs) * (args.calls * 10e-6 + 1)
        + (not args.skip_concurrent) * (len(mechs) + 1) * (args.duration + 2))
        + (not args.skip_concurrent) * args.passes * len(jobs)
        * (args.duration + 2),
        "print only" if args.no_write else RESULTS)

    side = build(mechs)
    prefix = os.path.join(TMP, "nginx")
    # an nginx left by an interrupted run would hold the prefix and ports
    try:
        with open(os.path.join(prefix, "nginx.pid")) as f:
            os.kill(int(f.read()), signal.SIGTERM)
        time.sleep(0.5)
    except (OSError, ValueError):
        pass
    shutil.rmtree(prefix, ignore_errors=True)
    os.makedirs(prefix)
    sock = os.path.join(TMP, "echo.sock")
    jsock = os.path.join(TMP, "jecho.sock")
    port = free_port()
    redis_port = free_port()

    def lua_table(d):
        return "{" + ", ".join("%s = %d" % kv for kv in d.items()) + "}"

    def lua_lib(k, v):
        path, o = v[0], v[1]
        extra = ""
        if len(v) > 2:
            extra = ", %s, %s" % (json.dumps(v[2]),
                                  json.dumps(v[3]) if v[3] else "nil")
        return '%s = { "%s", %s%s }' % (k, path, lua_table(o), extra)

    lua_libs = "{" + ", ".join(lua_lib(k, v) for k, v in libs.items()) + "}"
    conf = CONF.format(modules=MODULES, root=ROOT, here=HERE, prefix=prefix,
                       port=port, sock=sock, jsock=jsock, redis=redis_port,
                       libs=lua_libs,
                       user="user root;" if os.geteuid() == 0 else "")
    conf_path = os.path.join(prefix, "nginx.conf")
    with open(conf_path, "w") as f:
        f.write(conf)

    # a TERM (e.g. from `timeout`) runs the clean-up below as well
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    sidecar = subprocess.Popen([side, sock])
    jsidecar = subprocess.Popen([os.path.join(JAVA_HOME, "bin", "java"),
                                 "-Xmx64m", "-XX:ActiveProcessorCount=1",
                                 "-cp", TMP, "EchoSidecar", jsock])
    redis = subprocess.Popen(["redis-server", "--port", str(redis_port),
                              "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no"],
                             stdout=subprocess.DEVNULL)
    started = False
    base = "http://127.0.0.1:%d" % port
    results = {"sequential": {}, "concurrent": {}}
    load_before = loadavg()
    try:
        for _ in range(200):
            if os.path.exists(sock) and os.path.exists(jsock):
                break
            time.sleep(0.05)
        subprocess.run([NGINX, "-p", prefix, "-c", conf_path], check=True)
        started = True
        for _ in range(100):
            try:
                get(base + "/stats", 1)
                break
            except OSError:
                time.sleep(0.1)
        # let start-up finish before measuring
        time.sleep(1)
        with open(os.path.join(prefix, "nginx.pid")) as f:
            master = int(f.read())
        # nginx workers (with their runtime threads) and the sidecars
        workers = children(master)
        pids = workers + [sidecar.pid, jsidecar.pid]

        seq = {(m, s): [] for m in mechs for s in sizes}
        for p in range(args.passes):
            order = mechs if p % 2 == 0 else mechs[::-1]
            for s in sizes:
                for m in order:
                    r = json.loads(get("%s/seq?m=%s&s=%s&n=%d" % (
                        base, m, s, args.calls)))
                    seq[(m, s)].append(r)
                    print("seq  %-6s %5s B  %7.2f us/call  loop cpu %6.2f  "
                          "p50 %6.2f  p99 %6.2f" % (
                              m, s, r["us_per_call"], r["loop_cpu_us"],
                              r["p50"], r["p99"]), flush=True)

        conc_mechs = mechs + ["none"]
        conc = {(m, s): [] for m in conc_mechs + jobs for s in sizes}
        for p in range(0 if args.skip_concurrent else args.passes):
            order = conc_mechs if p % 2 == 0 else conc_mechs[::-1]
            # the jobs alternate too: lua_io ran before thread_io in every
            # pass, so whatever the machine did first counted against it
            job_order = jobs if p % 2 == 0 else jobs[::-1]
            for s in sizes:
                for m in order + (job_order if s == sizes[0] else []):
                    r = wrk("%s/c?m=%s&s=%s" % (base, m, s), args.duration,
                            pids)
                    conc[(m, s)].append(r)
                    print("conc %-6s %5s B  %9.0f rps  p50 %5.2f ms  "
                          "p99 %5.2f ms  cpu %5.1f us/req  non-2xx %d" % (
                              m, s, r["rps"], r["p50_ms"], r["p99_ms"],
                              r["cpu_us_per_req"], r["non2xx"]), flush=True)
        stats = get(base + "/stats")
        print("runtime stats (one worker):", stats.strip())
        memory = {"worker_rss_kb": [rss_kb(w) for w in workers],
                  "go_sidecar_rss_kb": rss_kb(sidecar.pid),
                  "java_sidecar_rss_kb": rss_kb(jsidecar.pid)}
        print("memory:", memory)
    finally:
        if started:
            subprocess.run([NGINX, "-p", prefix, "-c", conf_path, "-s",
                            "quit"])
        for proc in (sidecar, jsidecar, redis):
            proc.send_signal(signal.SIGTERM)
            proc.wait()

    def med(xs):
        return round(statistics.median(xs), 3)

    for (m, s), rs in seq.items():
        if not rs:
            continue
        results["sequential"].setdefault(m, {})[s] = {
            "us_per_call": med([r["us_per_call"] for r in rs]),
            "loop_cpu_us_per_call": med([r["loop_cpu_us"] for r in rs]),
            "p50_us": med([r["p50"] for r in rs]),
            "p99_us": med([r["p99"] for r in rs]),
            "runs": [r["us_per_call"] for r in rs],
        }
    for (m, s), rs in conc.items():
        if not rs:
            continue
        results["concurrent"].setdefault(m, {})[s] = {
            "rps": med([r["rps"] for r in rs]),
            "p50_ms": med([r["p50_ms"] for r in rs]),
            "p99_ms": med([r["p99_ms"] for r in rs]),
            "cpu_us_per_req": med([r["cpu_us_per_req"] for r in rs]),
            "non2xx": sum(r["non2xx"] for r in rs),
            "runs_rps": [r["rps"] for r in rs],
        }

    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "note": "measured on a shared 2-vCPU machine while other developers "
                "were building and testing: numbers are noisy; wrk ran on "
                "the same 2 CPUs as nginx",
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                    "loadavg_before": load_before,
                    "loadavg_after": loadavg()},
        "setup": {"workers": 2,
                  "runtime_opts": {k: v[1] for k, v in libs.items()},
                  "thread_pool": "default threads=4",
                  "wrk": "-t1 -c64 -d%ds --latency" % args.duration,
                  "passes": args.passes, "sequential_calls": args.calls},
        "runtime_stats_at_end": json.loads(stats),
        "memory_at_end": memory,
        "sequential": results["sequential"],
        "concurrent": results["concurrent"],
    }
    if args.skip_concurrent and os.path.exists(RESULTS):
        with open(RESULTS) as f:
            prev = json.load(f)
        prev["sequential"] = out["sequential"]
        prev["sequential_run"] = {k: out[k] for k in ("date", "machine",
                                                        "setup")}
        out = prev
    if not args.no_write:
        os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
        with open(RESULTS, "w") as f:
            json.dump(out, f, indent=2, sort_keys=True)
            f.write("\n")
        print("wrote", RESULTS)

    print("\n| mechanism | seq 64 B us/call | seq 16 KiB us/call "
          "| 64 B RPS | 64 B p99 ms | 64 B CPU us/req | 16 KiB RPS "
          "| 16 KiB p99 ms | 16 KiB CPU us/req |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in mechs + ["none"] + jobs:
        sq = results["sequential"].get(m, {})
        cc = results["concurrent"].get(m, {})

        def f(d, s, k, fmt):
            return fmt % d[s][k] if s in d else "-"
        print("| %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            m, f(sq, "64", "us_per_call", "%.2f"),
            f(sq, "16384", "us_per_call", "%.2f"),
            f(cc, "64", "rps", "%.0f"), f(cc, "64", "p99_ms", "%.2f"),
            f(cc, "64", "cpu_us_per_req", "%.1f"),
            f(cc, "16384", "rps", "%.0f"), f(cc, "16384", "p99_ms", "%.2f"),
            f(cc, "16384", "cpu_us_per_req", "%.1f")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
