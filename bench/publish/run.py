#!/usr/bin/env python3
"""Benchmark of resty.loom.publish (bench-publish).

nginx (2 workers) answers requests that each publish one 1 KiB message with
three attributes, under `wrk -t1 -c64 -d<D>s --latency`. Scenarios, run
side by side and alternated A B C ... A B C ...:

  none          no publishing (the ceiling)
  loom-fake     resty.loom.publish to the fake Pub/Sub's fast mode, a C
                sink that counts messages (tests/pubsub/sink.c, sink.py)
  loom-fake-half  the same, publishing on every 2nd request of a worker
                (the others do what `none` does): the cost at half the
                message rate, about 40,000 messages/s on this machine
  loom-spool    the same with a spool in "always" mode: every message is
                appended to a mapped file before send() returns and marked
                done once acknowledged (the files under the nginx prefix)
  floor-fake    the floor: the same messages' JSON (base64 by the same C
                function) appended to a batch per worker, cut at the same
                bytes, count and delay, POSTed from a timer over one
                keep-alive cosocket; nothing else (no checks, accounting,
                retries or callbacks)
  floor-fake-half  the floor on every 2nd request
  naive-fake    one HTTP publish per request over a keep-alive cosocket,
                waited for in the request (the "brute force" way)
  loom-emu      resty.loom.publish to Google's Pub/Sub emulator
  naive-emu     the naive way to the emulator

The fast-sink scenarios run first, with no emulator on the machine; the
emulator scenarios follow on their own.

Per run: requests/s, p50, p99, messages acknowledged per second (counted by
the success callback / the naive handler), messages the sink received, HTTP
publish requests per message, worker CPU (% of one core) and RSS. Medians
per scenario go to bench/results/publish.json.

Environment: BENCH_DURATION (10), BENCH_ROUNDS (3), BENCH_SCENARIOS
(comma list), BENCH_CONNECTIONS (64), BENCH_OUT (the file in bench/results/,
publish.json). The spool's own run:
BENCH_SCENARIOS=none,loom-fake,loom-spool BENCH_OUT=publish-spool.json
"""

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from loomtest.nginx import Nginx  # noqa: E402
sys.path.insert(0, os.path.join(ROOT, "bench"))
import benchcli  # noqa: E402
from pubsub import emulator as E  # noqa: E402
from pubsub.sink import FastSink  # noqa: E402

DURATION = int(os.environ.get("BENCH_DURATION", "10"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
CONNECTIONS = int(os.environ.get("BENCH_CONNECTIONS", "64"))
SCENARIOS = os.environ.get(
    "BENCH_SCENARIOS",
    "none,loom-fake,loom-fake-half,floor-fake,floor-fake-half,naive-fake,"
    "loom-emu,naive-emu"
).split(",")
OUT = os.environ.get("BENCH_OUT", "publish.json")
PATHS = {"none": "/none", "loom-fake": "/loom", "loom-emu": "/loom",
         "loom-fake-half": "/loom-half",
         "loom-spool": "/loom-spool", "naive-fake": "/naive",
         "floor-fake": "/floor", "floor-fake-half": "/floor-half",
         "naive-emu": "/naive"}
PROJECT = "bench-proj"
TOPIC = "bench-topic"

HTTP = """
lua_shared_dict bench 1m;
init_worker_by_lua_block {
    local publish = require "resty.loom.publish"
    local http = require "resty.loom.http"
    local shm = ngx.shared.bench
    local conf = require("cjson").decode([==[%(conf)s]==])
    BENCH = {}
    -- one constant 1 KiB payload: per-request payload strings that differ
    -- only in a counter would measure LuaJIT's string hash, not us
    BENCH.data = string.rep("0123456789abcdef", 64)
    -- one request: one message to publisher p
    function BENCH.send(p)
        local attrs = { host = "edge-1", path = ngx.var.uri,
                        seq = tostring(ngx.var.connection_requests) }
        if p:send(BENCH.data, attrs) then
            shm:incr("accepted", 1, 0)
        else
            shm:incr("rejected", 1, 0)
            ngx.status = 503
        end
        ngx.say("ok")
    end
    -- every 2nd request of the worker publishes; the others do what
    -- /none does (counted apart: "accepted" counts sends)
    BENCH.n = 0
    function BENCH.half(send, p)
        BENCH.n = BENCH.n + 1
        if BENCH.n %% 2 == 0 then
            return send(p)
        end
        local attrs = { host = "edge-1", path = ngx.var.uri,
                        seq = tostring(ngx.var.connection_requests) }
        if attrs then
            shm:incr("skipped", 1, 0)
        end
        ngx.say("ok")
    end
    %(floor)s
    if conf.sink then
        BENCH.p = publish.new({
            project = conf.project, topic = conf.topic,
            emulator_host = conf.sink,
            on_success = function(ids) shm:incr("acked", #ids, 0) end,
            on_error = function(msgs, reason)
                shm:incr("failed", #msgs, 0)
                ngx.log(ngx.WARN, "bench publish failed: ", reason)
            end,
        })
        -- the same publisher with a spool in "always" mode
        BENCH.ps = publish.new({
            project = conf.project, topic = conf.topic, name = "spooled",
            emulator_host = conf.sink,
            spool = conf.spool, spool_mode = "always",
            on_success = function(ids) shm:incr("acked", #ids, 0) end,
            on_error = function(msgs, reason)
                shm:incr("failed", #msgs, 0)
                ngx.log(ngx.WARN, "bench publish failed: ", reason)
            end,
        })
        local host, port = conf.sink:match("^(.+):(%%d+)$")
        BENCH.naive = http.new({ host = host, port = tonumber(port),
                                 pool_size = 128, read_timeout = 10 })
        BENCH.path = "/v1/projects/" .. conf.project .. "/topics/"
                     .. conf.topic .. ":publish"
        BENCH.floor(host, tonumber(port))
    end
}
"""

# The floor (floor-fake): what any publisher of these messages does at
# least. A request appends its message's JSON to the worker's batch (the
# data base64-encoded by the same C function as resty.loom.publish); a
# timer cuts the batch at resty.loom.publish's default bytes, count and
# delay and POSTs it over one keep-alive cosocket, reading the answer
# without decoding it. No checks, no per-message accounting, no retries,
# no callbacks, one request in flight.
FLOOR = """
    local b64 = require "resty.loom.publish.base64"
    local semaphore = require "ngx.semaphore"
    local F = { buf = require("string.buffer").new(), n = 0,
                sema = semaphore.new() }
    local MAX_BYTES, MAX_N, DELAY = 1000000, 1000, 0.05
    local dlen = #BENCH.data
    local elen = b64.encoded_len(dlen)
    function BENCH.floor_send()
        local attrs = { host = "edge-1", path = ngx.var.uri,
                        seq = tostring(ngx.var.connection_requests) }
        local b = F.buf
        b:put(F.n > 0 and ',{"data":"' or '{"data":"')
        b:commit(b64.encode_into(b:reserve(elen), BENCH.data, dlen))
        b:put('","attributes":{"host":"', attrs.host, '","path":"',
              attrs.path, '","seq":"', attrs.seq, '"}}')
        F.n = F.n + 1
        if not F.full and (F.n >= MAX_N or #b >= MAX_BYTES) then
            -- (once per batch: the sender may be busy with the last one)
            F.full = true
            F.sema:post(1)
        end
        ngx.shared.bench:incr("accepted", 1, 0)
        ngx.say("ok")
    end
    function BENCH.floor(host, port)
        local head = "POST " .. BENCH.path .. " HTTP/1.1\\r\\nHost: "
                     .. host .. "\\r\\nContent-Type: application/json\\r\\n"
                     .. "Content-Length: "
        local sock
        local function post(body, n)
            if not sock then
                sock = ngx.socket.tcp()
                sock:settimeout(10000)
                assert(sock:connect(host, port))
            end
            assert(sock:send({ head, #body + 15, "\\r\\n\\r\\n",
                               '{"messages":[', body, "]}" }))
            local h = assert(sock:receiveuntil("\\r\\n\\r\\n")())
            assert(sock:receive(tonumber(h:match("Content%-Length: (%d+)"))))
            ngx.shared.bench:incr(h:find(" 200 ", 1, true) and "acked"
                                  or "failed", n, 0)
        end
        ngx.timer.at(0, function()
            while not ngx.worker.exiting() do
                F.sema:wait(DELAY)
                if F.n > 0 then
                    local n = F.n
                    F.n, F.full = 0, false
                    local ok, err = pcall(post, F.buf:get(), n)
                    if not ok then
                        sock = nil
                        ngx.shared.bench:incr("failed", n, 0)
                        ngx.log(ngx.WARN, "bench floor failed: ", err)
                    end
                end
            end
        end)
    end
"""

SERVER = """
location = /none {
    content_by_lua_block {
        local attrs = { host = "edge-1", path = ngx.var.uri,
                        seq = tostring(ngx.var.connection_requests) }
        if attrs then
            -- the same bookkeeping as the publishing handlers
            ngx.shared.bench:incr("accepted", 1, 0)
        end
        ngx.say("ok")
    }
}
location = /loom {
    content_by_lua_block { BENCH.send(BENCH.p) }
}
location = /loom-half {
    content_by_lua_block { BENCH.half(BENCH.send, BENCH.p) }
}
location = /floor {
    content_by_lua_block { BENCH.floor_send() }
}
location = /floor-half {
    content_by_lua_block { BENCH.half(BENCH.floor_send) }
}
location = /loom-spool {
    content_by_lua_block { BENCH.send(BENCH.ps) }
}
location = /naive {
    content_by_lua_block {
        local attrs = { host = "edge-1", path = ngx.var.uri,
                        seq = tostring(ngx.var.connection_requests) }
        local cjson = require "cjson"
        local body = cjson.encode({ messages = { {
            data = ngx.encode_base64(BENCH.data), attributes = attrs } } })
        local res, err = BENCH.naive:request("POST", BENCH.path,
            { ["Content-Type"] = "application/json" }, body)
        if res and res.status == 200 then
            ngx.shared.bench:incr("acked", 1, 0)
        else
            ngx.shared.bench:incr("failed", 1, 0)
            ngx.status = 502
        end
        ngx.say("ok")
    }
}
location = /counters {
    content_by_lua_block {
        local shm = ngx.shared.bench
        local st = BENCH.p and BENCH.p:stats() or {}
        local ss = BENCH.ps and BENCH.ps:stats() or {}
        ngx.say(require("cjson").encode({
            acked = shm:get("acked") or 0, failed = shm:get("failed") or 0,
            accepted = shm:get("accepted") or 0,
            rejected = shm:get("rejected") or 0,
            buffered = (st.buffered_messages or 0)
                       + (ss.buffered_messages or 0),
            spooled = ss.spooled or 0, spool_errors = ss.spool_errors or 0,
            spool_bytes = ss.spool_bytes or 0 }))
    }
}
"""


def wrk(url):
    out = subprocess.run(
        ["wrk", "-t1", "-c%d" % CONNECTIONS, "-d%ds" % DURATION, "--latency",
         url], capture_output=True, text=True, timeout=DURATION + 60).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))

    def lat(p):
        m = re.search(r"^\s+%s%%\s+([\d.]+)(us|ms|s)\s*$" % p, out, re.M)
        if not m:
            return None
        v, unit = float(m.group(1)), m.group(2)
        v = v / 1000 if unit == "us" else v * 1000 if unit == "s" else v
        # wrk prints 0 when it could not measure (all timed out)
        return v or None
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    total = re.search(r"(\d+) requests in", out)
    return {"rps": rps, "p50_ms": lat(50), "p99_ms": lat(99),
            "requests": int(total.group(1)),
            "non2xx": int(non2xx.group(1)) if non2xx else 0}


def cpu_ticks(pids):
    t = 0
    for p in pids:
        with open("/proc/%d/stat" % p) as f:
            rest = f.read().rsplit(")", 1)[1].split()
        t += int(rest[11]) + int(rest[12])
    return t


def rss_kb(pids):
    out = []
    for p in pids:
        with open("/proc/%d/status" % p) as f:
            m = re.search(r"VmRSS:\s+(\d+) kB", f.read())
        out.append(int(m.group(1)))
    return out


def counters(n):
    return n.get("/counters").json()


def start_nginx(sink):
    conf = json.dumps({"sink": sink, "project": PROJECT, "topic": TOPIC,
                       "spool": "$PREFIX/spool"})
    n = Nginx(workers=2, http=HTTP % {"conf": conf, "floor": FLOOR}, server=SERVER,
              error_log_level="warn", worker_connections=4096)
    n.start()
    return n


def run_one(name, n, sink_obj):
    path = PATHS[name]
    pids = n.worker_pids()
    before = counters(n)
    fake_before = sink_obj.stats() if isinstance(sink_obj, FastSink) \
        else None
    # the fast sink's own CPU (the emulator is a JVM under a wrapper)
    sink_pids = [sink_obj.proc.pid] if fake_before else []
    ticks0 = cpu_ticks(pids)
    sink0 = cpu_ticks(sink_pids)
    t0 = time.time()
    res = wrk(n.url(path))
    elapsed = time.time() - t0
    ticks1 = cpu_ticks(pids)
    sink1 = cpu_ticks(sink_pids)
    # let the publisher drain what it holds, and the requests wrk left in
    # flight finish (a naive one still waiting for the emulator would count
    # its acknowledgement in the next scenario's window)
    deadline = time.time() + 30
    last = None
    while time.time() < deadline:
        c = counters(n)
        if c == last and c["buffered"] == 0 and (
                name == "none" or name.startswith("naive")
                or c["acked"] + c["failed"] - before["acked"]
                - before["failed"] >= c["accepted"] - before["accepted"]):
            break
        last = c
        time.sleep(0.2)
    after = counters(n)
    acked = after["acked"] - before["acked"]
    if name.startswith(("loom", "floor")) \
            and not isinstance(sink_obj, FastSink):
        res["lost"] = (after["accepted"] - before["accepted"]) - acked
    if name == "loom-spool":
        # (counted per worker: the nginx has 2; one answers /counters)
        res["spool_errors"] = after["spool_errors"]
    res.update({
        "scenario": name,
        "acked_messages": acked,
        "acked_per_s": acked / DURATION,
        "failed_messages": after["failed"] - before["failed"],
        "rejected_sends": after["rejected"] - before["rejected"],
        "worker_cpu_pct": 100.0 * (ticks1 - ticks0)
        / os.sysconf("SC_CLK_TCK") / elapsed,
        # the workers' CPU per request: less sensitive than req/s to what
        # else runs on the machine
        "worker_cpu_us_per_request": 1e6 * (ticks1 - ticks0)
        / os.sysconf("SC_CLK_TCK") / max(res["requests"], 1),
        "worker_rss_kb": rss_kb(pids),
    })
    if fake_before:
        res["sink_cpu_pct"] = 100.0 * (sink1 - sink0) \
            / os.sysconf("SC_CLK_TCK") / elapsed
        fake_after = sink_obj.stats()
        got = fake_after["messages"] - fake_before["messages"]
        reqs = fake_after["requests"] - fake_before["requests"]
        res["sink_messages"] = got
        res["sink_requests"] = reqs
        res["http_requests_per_message"] = reqs / got if got else None
        if name.startswith(("loom", "floor")):
            # accepted sends that never reached the sink
            res["lost"] = (after["accepted"] - before["accepted"]) - got
    elif name != "none" and acked:
        res["http_requests_per_message"] = (
            1.0 if name.startswith("naive") else None)
    return res


def one_round(r, scenarios, inst, sink, runs):
    for s in scenarios:
        res = run_one(s, inst, sink)
        res["round"] = r + 1
        runs.append(res)
        print(json.dumps(res), flush=True)


def main():
    # a TERM still stops nginx and the emulator (the finally below)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(1))
    fake = FastSink()
    emu = None
    instances = []
    notes = ["load average (1, 5, 15 min) at start: %.2f %.2f %.2f"
             % os.getloadavg()]
    runs = []
    try:
        # the fast sink first, with no emulator on the machine: a JVM that
        # has just been loaded keeps taking CPU that the workers and wrk
        # share
        n = start_nginx(fake.host)
        instances.append(n)
        for r in range(ROUNDS):
            one_round(r, [s for s in SCENARIOS if not s.endswith("-emu")],
                      n, fake, runs)
        n.stop()
        emu_scenarios = [s for s in SCENARIOS if s.endswith("-emu")]
        why = emu_scenarios and E.unavailable()
        if why:
            notes.append("emulator scenarios skipped: " + why)
        elif emu_scenarios:
            # a fresh emulator (and nginx) per round: in a 7-round run the
            # one emulator stopped answering in round 6, after about two
            # million messages. A first, unrecorded run warms its JVM.
            for r in range(ROUNDS):
                emu = E.Emulator()
                emu.create_topic(PROJECT, TOPIC)
                n = start_nginx(emu.host)
                instances.append(n)
                run_one(emu_scenarios[0], n, emu)
                one_round(r, emu_scenarios, n, emu, runs)
                n.stop()
                emu.close()
                emu = None
    except BaseException as e:
        notes.append("the run stopped early: %r" % e)
        raise
    finally:
        fake.close()
        if emu:
            emu.close()
        for inst in instances:
            try:
                inst.stop()
            except RuntimeError:
                pass
        # what was measured is kept, also when the run stopped early
        notes.append("load average (1, 5, 15 min) at end: %.2f %.2f %.2f"
                     % os.getloadavg())
        if runs:
            write(runs, notes)


def summarise(runs):
    for r in runs:
        for k in ("p50_ms", "p99_ms"):
            if not r.get(k):
                r[k] = None
    keys = ["rps", "p50_ms", "p99_ms", "acked_per_s", "worker_cpu_pct",
            "worker_cpu_us_per_request", "sink_cpu_pct",
            "http_requests_per_message", "lost", "non2xx"]
    medians = {}
    for s in SCENARIOS:
        rs = [r for r in runs if r["scenario"] == s]
        if not rs:
            continue
        m = {}
        for k in keys:
            vals = [r[k] for r in rs if r.get(k) is not None]
            if vals:
                m[k] = statistics.median(vals)
        m["worker_rss_kb_max"] = max(max(r["worker_rss_kb"]) for r in rs)
        m["runs"] = len(rs)
        medians[s] = m
    base = medians.get("none", {}).get("rps")
    if base:
        for s, m in medians.items():
            m["rps_vs_none"] = m["rps"] / base
            if m.get("p99_ms") is not None:
                m["p99_minus_none_ms"] = \
                    m["p99_ms"] - medians["none"]["p99_ms"]
    # the workers' CPU each message adds to a request of "none"
    none_cpu = medians.get("none", {}).get("worker_cpu_us_per_request")
    for s, m in medians.items():
        if none_cpu and s.startswith(("loom", "floor")) \
                and m.get("acked_per_s") \
                and m.get("worker_cpu_us_per_request"):
            per_req = m["acked_per_s"] / m["rps"]
            m["messages_per_request"] = per_req
            m["worker_cpu_us_per_message_over_none"] = \
                (m["worker_cpu_us_per_request"] - none_cpu) / per_req
    mem = medians.get("loom-fake", {}).get("rps")
    if mem and "loom-spool" in medians:
        m = medians["loom-spool"]
        m["rps_vs_memory"] = m["rps"] / mem
        # and per round: the spool's run against the memory-only run next
        # to it (the machine's load moves less within a round)
        ratios = []
        for r in runs:
            if r["scenario"] == "loom-spool":
                a = [x for x in runs if x["scenario"] == "loom-fake"
                     and x["round"] == r["round"]]
                if a:
                    ratios.append(r["rps"] / a[0]["rps"])
        if ratios:
            m["rps_vs_memory_per_round"] = ratios
            m["rps_vs_memory_round_median"] = statistics.median(ratios)
        cpu = medians["loom-fake"].get("worker_cpu_us_per_request")
        if cpu and m.get("worker_cpu_us_per_request"):
            m["cpu_per_request_vs_memory"] = \
                m["worker_cpu_us_per_request"] / cpu
    return medians


def write(runs, notes, date=None):
    medians = summarise(runs)
    out = {
        "benchmark": "bench-publish",
        "date": date or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "note": "measured on a shared 2-core machine with other developers' "
                "load present; wrk, nginx (2 workers) and the sink share the "
                "cores, so figures are noisy and conservative",
        "setup": {"wrk": "-t1 -c%d -d%ds --latency" % (CONNECTIONS, DURATION),
                  "rounds": ROUNDS, "workers": 2,
                  "message": "1 KiB data, 3 attributes",
                  "fake_sink": "tests/pubsub/sink.c (one thread, epoll), "
                               "started by tests/pubsub/sink.py",
                  "emulator": E.find_jar()},
        "notes": notes,
        "medians": medians,
        "runs": runs,
    }
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    path = os.path.join(ROOT, "bench", "results", OUT)
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(medians, indent=2))
    print("wrote", path)


if __name__ == "__main__":
    ap = benchcli.parser(__doc__)
    ap.add_argument("--summarise", nargs="*", metavar="NOTE",
                    help="recompute the medians of bench/results/publish.json"
                         " (adding the notes) and exit")
    args = ap.parse_args()
    if args.summarise is not None:
        # recompute the medians of bench/results/publish.json
        with open(os.path.join(ROOT, "bench", "results", OUT)) as f:
            old = json.load(f)
        notes = old["notes"] + args.summarise
        write(old["runs"], notes, old["date"])
    else:
        emu = [s for s in SCENARIOS if s.endswith("-emu")]
        # per run: nginx start, wrk, counting; the emulator starts per round
        benchcli.announce(__doc__, ROUNDS * (
            len(SCENARIOS) * (DURATION + 6) + bool(emu) * 25),
            "bench/results/" + OUT)
        main()
