"""resty.loom.watchdog: stalls of the event loop found while they happen.

Each test drives a real nginx whose handlers block on purpose (helpers in
tests/lua/watchdog_cases.lua) and checks the report the watchdog made:
duration, what was running, the classification (on CPU or which system
call) and the Lua backtrace with function name and line.
"""

import os
import re
import signal
import threading
import time
import xml.etree.ElementTree as ET

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
CASES = os.path.join(ROOT, "tests", "lua", "watchdog_cases.lua")


def marker_line(name):
    with open(CASES) as f:
        for i, line in enumerate(f, 1):
            if line.rstrip().endswith("-- LINE:" + name):
                return i
    raise AssertionError("no marker " + name)


def defined_line(func):
    with open(CASES) as f:
        for i, line in enumerate(f, 1):
            if re.match(r"\s*local function %s\(" % func, line):
                return i
    raise AssertionError("no function " + func)


HTTP = """
init_worker_by_lua_block {
    local wd = require "resty.loom.watchdog"
    assert(wd.start({ threshold = %(threshold)d, log_burst = 100 }))
}
"""

SERVER = """
location = /hello { content_by_lua_block { ngx.say("hello") } }
location = /cpu {
    content_by_lua_block {
        require("watchdog_cases").cpu(tonumber(ngx.var.arg_ms) or 300)
        ngx.say("ok")
    }
}
location = /exec {
    content_by_lua_block {
        require("watchdog_cases").sleep_exec(0.3)
        ngx.say("ok")
    }
}
location = /usleep {
    content_by_lua_block {
        require("watchdog_cases").sleep_ffi(tonumber(ngx.var.arg_ms) or 300)
        ngx.say("ok")
    }
}
location = /timer {
    content_by_lua_block {
        assert(require("watchdog_cases").start_timer(300))
        ngx.say("ok")
    }
}
location = /work {
    content_by_lua_block {
        local t = {}
        for i = 1, 200 do t[i] = ngx.md5(i) end
        ngx.say(#t)
    }
}
location = /reports {
    content_by_lua_block {
        local wd = require "resty.loom.watchdog"
        ngx.say(require("cjson").encode({
            stats = wd.stats(), reports = wd.reports(),
            worker = ngx.worker.id(), pid = ngx.worker.pid(),
        }))
    }
}
location = /flame {
    content_by_lua_block {
        ngx.header.content_type = "image/svg+xml"
        ngx.print(require("resty.loom.watchdog").flamegraph())
    }
}
"""


def start(nginx, workers=1, threshold=100, **kw):
    n = nginx(workers=workers, http=HTTP % {"threshold": threshold},
              server=SERVER, **kw)
    return n


def wait_reports(n, count, timeout=10):
    deadline = time.time() + timeout
    while True:
        data = n.get("/reports").json()
        if len(data["reports"]) >= count or time.time() > deadline:
            return data
        time.sleep(0.1)


def frames_at(report, line):
    return [f for f in report.get("backtrace", [])
            if f["source"] == CASES and f["line"] == line]


def test_cpu_bound_loop(nginx):
    n = start(nginx)
    assert n.get("/cpu?ms=300").status == 200
    data = wait_reports(n, 1)
    reports = data["reports"]
    assert len(reports) == 1, reports
    r = reports[0]
    assert r["request"] == {"method": "GET", "uri": "/cpu?ms=300"}
    assert r["phase"] == "content"
    assert r["duration_ms"] >= 280
    assert r["kind"] == "cpu"
    # mostly runnable: on a CPU, or waiting for one on a busy machine
    assert r["on_cpu_ms"] + r.get("runqueue_ms", 0) >= 0.5 * r["duration_ms"]
    assert r["proc_samples"]["running"] > 0
    assert r["detected_while_blocked"] is True
    assert r["lua_samples"] >= 2
    burn = marker_line("burn")
    # the busy loop is in the backtrace, with the function's name ...
    hits = frames_at(r, burn)
    assert hits and hits[0]["func"] == "cpu", r["backtrace"]
    # ... and it is the hottest Lua line of the stall
    assert any(h["frame"] == "cpu (%s:%d)" % (CASES, burn)
               for h in r["hot"][:2]), r["hot"]
    assert "%s:%d" % (CASES, burn) in r["folded"]
    # one log line for it
    found = n.wait_log(r"event loop blocked [\d.]+ ms \(threshold 100 ms\) "
                       r"by GET /cpu\?ms=300 \(content\)")
    assert len(found) == 1
    assert data["stats"]["stalls"] == 1
    assert data["stats"]["over_100ms"] == 1
    assert data["stats"]["max_ms"] >= 280


def test_blocking_syscall_os_execute(nginx):
    n = start(nginx)
    assert n.get("/exec").status == 200
    reports = wait_reports(n, 1)["reports"]
    assert len(reports) == 1, reports
    r = reports[0]
    assert r["request"]["uri"] == "/exec"
    assert r["kind"] == "blocked"
    assert r["syscall"] == "wait4"
    assert r["wchan"] == "do_wait"
    assert r["off_cpu_ms"] >= 250
    top = r["backtrace"][0]
    assert top["func"] == "sleep_exec"
    assert top["source"] == CASES
    assert top["line"] == marker_line("exec")
    n.wait_log(r"by GET /exec \(content\); on-CPU [\d.]+ ms, off-CPU "
               r"[\d.]+ ms in wait4")


def test_blocking_ffi_usleep(nginx):
    n = start(nginx)
    t0 = time.time()
    assert n.get("/usleep?ms=300").status == 200
    # the sleep was not cut short by the watchdog's sampling
    assert time.time() - t0 >= 0.29
    reports = wait_reports(n, 1)["reports"]
    assert len(reports) == 1, reports
    r = reports[0]
    assert r["request"]["uri"] == "/usleep?ms=300"
    assert r["kind"] == "blocked"
    assert r["syscall"] in ("clock_nanosleep", "nanosleep")
    assert r["duration_ms"] >= 290
    top = r["backtrace"][0]
    assert top["func"] == "sleep_ffi"
    assert top["line"] == marker_line("usleep")


def test_blocking_call_in_timer(nginx):
    n = start(nginx)
    assert n.get("/timer").status == 200
    reports = wait_reports(n, 1)["reports"]
    assert len(reports) == 1, reports
    r = reports[0]
    assert "request" not in r
    assert r["phase"] == "timer"
    assert r["timer"]["created_at"] == "%s:%d" % (
        CASES, marker_line("timer_created"))
    assert r["timer"]["callback"] == "%s:%d" % (
        CASES, defined_line("timer_sleeper"))
    assert r["syscall"] in ("clock_nanosleep", "nanosleep")
    top = r["backtrace"][0]
    assert top["source"] == CASES
    assert top["line"] == marker_line("timer"), r
    n.wait_log(r"by timer \S+watchdog_cases.lua:%d created at "
               r"\S+watchdog_cases.lua:%d" % (
                   defined_line("timer_sleeper"),
                   marker_line("timer_created")))


def test_each_stall_reported_once_and_flamegraph(nginx):
    n = start(nginx)
    for path in ("/cpu?ms=200", "/usleep?ms=200", "/cpu?ms=200"):
        assert n.get(path).status == 200
    data = wait_reports(n, 3)
    reports = data["reports"]
    assert len(reports) == 3
    # newest first, distinct iterations
    assert [r["request"]["uri"] for r in reports] == [
        "/cpu?ms=200", "/usleep?ms=200", "/cpu?ms=200"]
    assert len({r["id"] for r in reports}) == 3
    time.sleep(0.5)
    assert len(n.get("/reports").json()["reports"]) == 3
    assert len(re.findall(r"event loop blocked", n.error_log())) == 3
    svg = n.get("/flame")
    assert svg.status == 200
    assert svg.body.startswith(b"<?xml") or svg.body.startswith(b"<svg")
    assert b"sleep_ffi" in svg.body and b"watchdog_cases.lua" in svg.body


def _load(n, path, seconds, threads=8):
    stop = time.time() + seconds
    errors = []
    count = [0]

    def run():
        import http.client
        conn = http.client.HTTPConnection("127.0.0.1", n.port, timeout=5)
        while time.time() < stop:
            try:
                conn.request("GET", path)
                resp = conn.getresponse()
                resp.read()
                if resp.status != 200:
                    errors.append(resp.status)
                count[0] += 1
            except OSError as e:
                errors.append(repr(e))
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", n.port,
                                                  timeout=5)
        conn.close()

    ts = [threading.Thread(target=run) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return count[0], errors


def collect_all(n, workers):
    """/reports of every worker (new connections spread over workers)."""
    seen = {}
    deadline = time.time() + 10
    while len(seen) < workers and time.time() < deadline:
        d = n.get("/reports").json()
        seen[d["pid"]] = d
    assert len(seen) == workers, seen.keys()
    return list(seen.values())


def test_no_report_under_normal_load(nginx):
    # the threshold leaves room for a shared, busy CI machine
    n = start(nginx, workers=2, threshold=250, events="accept_mutex off;")
    count, errors = _load(n, "/work", 3)
    assert not errors
    assert count > 200
    total = 0
    for d in collect_all(n, 2):
        s = d["stats"]
        assert s["running"] is True
        assert s["reports"] == 0 and not d["reports"]
        assert s["stalls"] == 0
        assert s["over_1s"] == 0
        assert s["iterations"] > 0
        assert sum(b["count"] for b in s["histogram"]) == s["iterations"]
        assert s["p50_ms"] <= s["p99_ms"] <= s["p999_ms"]
        total += s["iterations"]
    assert total >= count / 4
    assert "event loop blocked" not in n.error_log()


def test_thread_named_and_asleep_while_nothing_can_stall(nginx):
    # the thread is "loom-watchdog" (ps -T, top -H, the bench find it); an
    # idle worker cannot have run half the threshold before the thread's
    # next look, so it is not woken every tick (10 ms here: 100 a second),
    # about twice per threshold; a wake-up costs it tens of µs of CPU
    n = start(nginx)
    assert n.get("/reports").status == 200
    pid = n.worker_pids()[0]
    tids = [t for t in os.listdir("/proc/%d/task" % pid)
            if open("/proc/%d/task/%s/comm" % (pid, t)).read().strip()
            == "loom-watchdog"]
    assert len(tids) == 1, os.listdir("/proc/%d/task" % pid)

    def switches():
        with open("/proc/%d/task/%s/status" % (pid, tids[0])) as f:
            return int(re.search(r"voluntary_ctxt_switches:\s+(\d+)",
                                 f.read()).group(1))

    before = switches()
    time.sleep(2)
    woke = switches() - before
    assert 0 < woke < 100, woke


def test_reload_and_quit(nginx):
    n = start(nginx, workers=2)
    old = n.worker_pids()
    assert n.get("/usleep?ms=150").status == 200
    n.wait_log(r"event loop blocked .* by GET /usleep")
    new = n.reload()
    assert set(new).isdisjoint(old)
    assert n.wait_gone(old, timeout=15)
    for d in collect_all(n, 2):
        assert d["pid"] in new
        assert d["stats"]["running"] is True
        assert not d["reports"]
    # the new generation reports too
    assert n.get("/cpu?ms=150").status == 200
    n.wait_log(r"event loop blocked .* by GET /cpu\?ms=150")
    n.quit(timeout=15)
    assert n.wait_gone(new, timeout=5)
    log = n.error_log()
    assert not re.search(r"\[(alert|crit|emerg)\]", log)
    assert "exit" in log


def test_start_validates_options(nginx):
    n = nginx(workers=1, server="""
location = /t {
    content_by_lua_block {
        local wd = require "resty.loom.watchdog"
        local out = {}
        for _, o in ipairs({ { threshold = "x" }, { threshold = 0.5 },
                             { nope = 1 }, { backtraces = 1 } }) do
            local ok, err = pcall(wd.start, o)
            out[#out + 1] = tostring(ok) .. " " .. tostring(err)
        end
        local ok, err = pcall(wd.start, {})
        out[#out + 1] = tostring(ok) .. " " .. tostring(err)
        ngx.say(table.concat(out, "\\n"))
    }
}
""")
    lines = n.get("/t").text.splitlines()
    assert "opts.threshold must be a number from 1 to 3600000" in lines[0]
    assert "opts.threshold must be a number from 1 to 3600000" in lines[1]
    assert "opts.nope is not an option" in lines[2]
    assert "opts.backtraces must be a boolean" in lines[3]
    assert "must be called in init_worker_by_lua" in lines[4]
    assert all(line.startswith("false") for line in lines)


@pytest.mark.skipif(not os.path.exists("/usr/bin/wrk"), reason="needs wrk")
def test_soak_mixed_stalls(nginx):
    """wrk load mixed with stalls of every kind: no crash, no leak.

    LOOM_WATCHDOG_SOAK=<seconds> runs longer (the million-request soak in
    docs/watchdog.md used 60).
    """
    import subprocess
    seconds = int(os.environ.get("LOOM_WATCHDOG_SOAK", "8"))
    n = start(nginx, workers=2, threshold=50)
    pids = n.worker_pids()

    def rss(pid):
        with open("/proc/%d/status" % pid) as f:
            return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))

    # warm up, then remember the memory
    subprocess.run(["wrk", "-t1", "-c16", "-d1s", n.url("/hello")],
                   capture_output=True, check=True)
    for p in ("/cpu?ms=60", "/usleep?ms=60", "/exec", "/timer"):
        n.get(p)
    time.sleep(0.5)
    before = {p: rss(p) for p in pids}

    stalls = []
    stop = threading.Event()

    def staller():
        kinds = ("/cpu?ms=70", "/usleep?ms=70", "/cpu?ms=70", "/exec")
        i = 0
        while not stop.is_set():
            r = n.get(kinds[i % len(kinds)], timeout=20)
            assert r.status == 200
            stalls.append(r)
            i += 1
            time.sleep(0.05)

    t = threading.Thread(target=staller)
    t.start()
    out = subprocess.run(["wrk", "-t2", "-c32", "-d%ds" % seconds,
                          n.url("/hello")], capture_output=True, text=True)
    stop.set()
    t.join()
    assert out.returncode == 0, out.stderr
    m = re.search(r"(\d+) requests in", out.stdout)
    assert m and int(m.group(1)) > 1000, out.stdout
    assert "Non-2xx" not in out.stdout, out.stdout
    assert "Socket errors" not in out.stdout or \
        re.search(r"connect 0, read 0, write 0, timeout \d+", out.stdout), \
        out.stdout
    assert n.worker_pids() == pids        # no worker crashed
    time.sleep(0.5)
    datas = collect_all(n, 2)
    reports = sum(d["stats"]["reports"] for d in datas)
    assert reports >= len(stalls) * 0.9, (reports, len(stalls))
    for d in datas:
        assert len(d["reports"]) <= 32    # the ring stays bounded
    after = {p: rss(p) for p in pids}
    print("soak: %s stalls made, %d reported, rss before %r after %r\n%s" % (
        len(stalls), reports, before, after, out.stdout))
    for p in pids:
        assert after[p] - before[p] < 20000, (before, after)
    assert "signal" not in "".join(
        line for line in n.error_log().splitlines()
        if "exited on signal" in line)


def test_gateway_blocking_endpoint_and_demo(nginx):
    gw = os.path.join(ROOT, "examples", "gateway")
    n = nginx(workers=2, http="""
init_by_lua_block {
    package.path = "%s/lua/?.lua;" .. package.path
}
init_worker_by_lua_block { require("gateway.watchdog").init_worker() }
""" % gw, server="include %s/conf.d/watchdog.server.conf;" % gw)
    r = n.get("/loom/demo/block?cpu_ms=150&socket_ms=150")
    assert r.status == 200 and r.json()["blocked_ms"] == 300
    n.wait_log(r"event loop blocked .* by GET /loom/demo/block")
    data = None
    deadline = time.time() + 10
    while time.time() < deadline:
        data = n.get("/loom/blocking").json()
        reports = [rep for w in data["workers"]
                   for rep in w["watchdog"].get("reports", [])]
        if reports:
            break
        time.sleep(0.1)
    assert data["workers"] and all("watchdog" in w for w in data["workers"])
    rep = reports[0]
    assert rep["request"]["path"] == "/loom/demo/block"
    assert rep["duration_seconds"] >= 0.28
    # both halves of the seed case are visible: CPU in the hashing loop,
    # then off CPU in the socket receive
    assert rep["on_cpu_seconds"] + rep.get("runqueue_seconds", 0) >= 0.1
    assert rep["syscall"] == "recvfrom"
    assert rep["backtrace"][0]["func"] == "blocking_receive"
    assert any("hash_random_strings" in h["frame"] or "ngx_md5" in h["frame"]
               for h in rep["hot"]), rep["hot"]
    # without an events bus each worker answers for itself: ask until the
    # worker that stalled answers
    deadline = time.time() + 10
    while time.time() < deadline:
        svg = n.get("/loom/blocking?format=svg")
        assert svg.status == 200
        if b"blocking_receive" in svg.body:
            break
    assert b"blocking_receive" in svg.body and b"recvfrom" in svg.body


def test_long_stall_logged_while_it_lasts(nginx):
    # an endless loop never ends its iteration: the thread itself logs a
    # "still blocked" line, with the backtrace sampled so far
    n = start(nginx)
    result = {}

    def call():
        result["r"] = n.get("/cpu?ms=1800", timeout=20)

    t = threading.Thread(target=call)
    t.start()
    try:
        found = n.wait_log(r"event loop still blocked after (\d+) ms: "
                           r"state R.*lua: [^\n]*watchdog_cases.lua:%d" %
                           marker_line("burn"), timeout=3)
        # logged during the stall, not after it
        assert "r" not in result
        assert 1000 <= int(found[0]) < 1800
    finally:
        t.join()
    assert result["r"].status == 200
    # the loop burns 1,800 ms by ngx.now(), whose milliseconds are
    # truncated: up to 1 ms less by the watchdog's clock
    stall = n.wait_log(r"event loop blocked (\d{4}\.\d) ms")
    assert 1798 <= float(stall[0]) < 2500, stall


def test_without_breakpoints_never_interrupts_a_sleep(nginx):
    # where perf_event_open is not allowed: restartable calls (wait4) still
    # get a backtrace through a plain SIGPROF, a sleep is left alone
    n = nginx(workers=1, server=SERVER, http="""
init_worker_by_lua_block {
    assert(require("resty.loom.watchdog").start({ breakpoints = false }))
}
""")
    assert n.get("/exec").status == 200
    t0 = time.time()
    assert n.get("/usleep?ms=300").status == 200
    assert time.time() - t0 >= 0.29
    data = wait_reports(n, 2)
    # newest first; the sleep could not be sampled while it slept (a
    # sample may still come once the thread runs again, after the call)
    sleep_r, exec_r = data["reports"]
    assert exec_r["request"]["uri"] == "/exec"
    assert exec_r["syscall"] == "wait4"
    assert exec_r["backtrace"][0]["func"] == "sleep_exec"
    assert exec_r["backtrace"][0]["line"] == marker_line("exec")
    assert sleep_r["syscall"] in ("clock_nanosleep", "nanosleep")
    assert sleep_r["duration_ms"] >= 290
    if "backtrace" not in sleep_r:
        assert "cannot interrupt safely" in sleep_r["backtrace_missing"]
        assert "request" not in sleep_r
    else:
        assert sleep_r["request"]["uri"] == "/usleep?ms=300"
        assert "resumed_at" not in sleep_r["backtrace"][0]
    assert data["stats"]["breakpoints"] == "untried"


def test_configure_threshold_at_run_time(nginx):
    n = nginx(workers=1, server=SERVER + """
location = /configure {
    content_by_lua_block {
        local wd = require "resty.loom.watchdog"
        assert(wd.configure({ threshold = tonumber(ngx.var.arg_ms) }))
        ngx.say(wd.stats().threshold_ms)
    }
}
location = /pause {
    content_by_lua_block {
        assert(require("resty.loom.watchdog").enable(ngx.var.arg_on == "1"))
        ngx.say("ok")
    }
}
""", http=HTTP % {"threshold": 400})
    assert n.get("/usleep?ms=150").status == 200
    time.sleep(0.3)
    assert not n.get("/reports").json()["reports"]
    assert n.get("/configure?ms=100").text.strip() == "100"
    assert n.get("/usleep?ms=150").status == 200
    data = wait_reports(n, 1)
    assert len(data["reports"]) == 1
    assert data["reports"][0]["threshold_ms"] == 100
    assert data["stats"]["stalls"] == 1
    # paused: no timing, no report
    assert n.get("/pause?on=0").status == 200
    iters = n.get("/reports").json()["stats"]["iterations"]
    assert n.get("/usleep?ms=150").status == 200
    time.sleep(0.3)
    d = n.get("/reports").json()
    assert len(d["reports"]) == 1 and d["stats"]["running"] is False
    assert d["stats"]["iterations"] == iters
    assert n.get("/pause?on=1").status == 200
    assert n.get("/usleep?ms=150").status == 200
    assert len(wait_reports(n, 2)["reports"]) == 2


def test_short_stalls_still_say_what_ran(nginx):
    # stalls just over the threshold end before the watchdog's look at the
    # threshold; the sample it took at half the threshold names the code
    n = start(nginx)
    paths = ["/usleep?ms=112", "/cpu?ms=112"] * 2
    for p in paths:
        assert n.get(p).status == 200
    reports = wait_reports(n, 4)["reports"]
    assert len(reports) == 4, reports
    for r, p in zip(reports, reversed(paths)):
        assert r["request"]["uri"] == p
        assert any(f["source"] == CASES for f in r["backtrace"]), r


@pytest.mark.skipif(not os.path.exists("/usr/bin/wrk"), reason="needs wrk")
def test_reload_under_load_with_stalls(nginx):
    # HUP while wrk runs and stalls of every kind happen: old workers stop
    # their watchdog threads and exit cleanly, none dies on a signal
    import subprocess
    n = start(nginx, workers=2, threshold=50)
    stop = threading.Event()
    made, errors = [0], []

    def staller():
        kinds = ("/cpu?ms=70", "/usleep?ms=70", "/exec", "/timer")
        i = 0
        while not stop.is_set():
            try:
                r = n.get(kinds[i % len(kinds)], timeout=20)
                if r.status != 200:
                    errors.append(r.status)
                made[0] += 1
            except OSError as e:
                errors.append(repr(e))
            i += 1
            time.sleep(0.03)

    t = threading.Thread(target=staller)
    t.start()
    w = subprocess.Popen(["wrk", "-t2", "-c32", "-d8s", n.url("/hello")],
                         stdout=subprocess.PIPE, text=True)
    generations = [n.worker_pids()]
    try:
        for _ in range(2):
            time.sleep(2.5)
            generations.append(n.reload())
    finally:
        out = w.communicate()[0]
        stop.set()
        t.join()
    assert not errors, errors
    assert made[0] > 10
    assert re.search(r"\d+ requests in", out), out
    for old in generations[:-1]:
        assert n.wait_gone(old, timeout=15)
    for d in collect_all(n, 2):
        assert d["stats"]["running"] is True
    n.quit(timeout=15)
    log = n.error_log()
    assert "exited on signal" not in log
    assert len(re.findall(r"event loop blocked", log)) >= made[0] * 0.9


def worker_cpu_seconds(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


BAD_OPTS = """{
    { threshold = 1/0 }, { threshold = 0/0 }, { threshold = 1e308 },
    { threshold = -1 }, { threshold = 0 },
    { interval = 1e308 }, { interval = 0/0 }, { interval = 1/0 },
    { interval = -1 }, { interval = 0.5 }, { interval = 200 },
    { ring = 0 }, { ring = 0.5 }, { ring = 1/0 }, { ring = 0/0 },
    { long = 1/0 }, { long = 0/0 }, { long = -5 },
    { max_samples = 0/0 }, { max_samples = 1.5 },
    { log_burst = 0 }, { log_burst = 0/0 },
    { log_interval = 0 }, { log_interval = 1/0 }, { log_interval = 0/0 },
}"""


def test_start_refuses_nan_inf_and_absurd_options(nginx):
    # issue 17 item 20: threshold = 1/0 was accepted and an idle worker
    # burnt a core; 0/0 turned detection off; interval = 1e308 burnt 25 %
    # of a core; ring = 0 or 0.5 kept no reports
    n = nginx(workers=1, http="""
    init_worker_by_lua_block {
        local wd = require "resty.loom.watchdog"
        local out = {}
        for i, o in ipairs(%s) do
            local ok, err = pcall(wd.start, o)
            out[i] = tostring(ok) .. " " .. tostring(err)
        end
        package.loaded.wd_refused = out
        assert(wd.start({ threshold = 100 }))
        -- configure() refuses the same and keeps what it had
        local ok = pcall(wd.configure, { ring = 0 })
        package.loaded.wd_configure = tostring(ok)
        local _, err = pcall(wd.configure, { timers = false })
        package.loaded.wd_start_only = err
    }
    """ % BAD_OPTS, server=SERVER + """
location = /refused {
    content_by_lua_block {
        ngx.say(table.concat(package.loaded.wd_refused, "\\n"))
        ngx.say(package.loaded.wd_configure)
        ngx.say(package.loaded.wd_start_only)
    }
}
location = /limits {
    content_by_lua_block {
        local wd = require "resty.loom.watchdog"
        for _, o in ipairs({ { limit = 0/0 }, { limit = 1.5 },
                             { limt = 1 }, { limit = 1 } }) do
            ngx.say(tostring((pcall(wd.reports, o))))
        end
    }
}
""")
    lines = n.get("/refused").text.splitlines()
    assert len(lines) == 27
    for line in lines[:-2]:
        assert line.startswith("false opts."), lines
    assert lines[-2] == "false"
    assert lines[-1] == "opts.timers can only be set by start", lines
    assert any("opts.interval must be at most opts.threshold" in ln
               for ln in lines)
    r = n.get("/limits")
    assert r.text.split() == ["false", "false", "false", "true"], r.text
    # an idle worker stays idle
    pid = n.worker_pids()[0]
    c0 = worker_cpu_seconds(pid)
    time.sleep(2)
    busy = (worker_cpu_seconds(pid) - c0) / 2
    assert busy < 0.2, "worker busy %.0f %% of a core" % (busy * 100)
    # and the ring still keeps reports
    assert n.get("/usleep?ms=200").status == 200
    data = wait_reports(n, 1)
    assert len(data["reports"]) == 1
    assert data["stats"]["threshold_ms"] == 100


def test_flamegraph_example_serves_valid_xml(nginx):
    # issue 17 item 22: ngx.print(wd.flamegraph()), the documented example,
    # printed the frame count after </svg>
    n = start(nginx)
    for path in ("/cpu?ms=200", "/usleep?ms=200"):
        assert n.get(path).status == 200
    wait_reports(n, 2)
    r = n.get("/flame")
    assert r.status == 200
    root = ET.fromstring(r.body)            # raises on trailing junk
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    titles = [t.text or "" for t in root.iter(
        "{http://www.w3.org/2000/svg}title")]
    assert any("sleep_ffi" in t for t in titles), titles


def test_loom_timer_stall_names_the_timer_and_log_has_no_timer_context(
        nginx):
    # issue 17 item 21: a stall inside a resty.loom.timer callback was
    # reported as "timer": {} and "by timer ?"; stall lines of requests
    # ended in "context: ngx.timer" (they were logged from the report timer)
    n = nginx(workers=1, http=HTTP % {"threshold": 100}, server=SERVER + """
location = /loom {
    content_by_lua_block {
        assert(require("watchdog_cases").start_loom_timers(250))
        ngx.say("ok")
    }
}
""")
    assert n.get("/loom").status == 200
    reports = wait_reports(n, 2)["reports"]
    assert len(reports) == 2, reports
    burner, sleeper = reports           # newest first
    for r in reports:
        assert r["phase"] == "timer"
        assert "request" not in r
    assert sleeper["timer"]["created_at"] == "%s:%d" % (
        CASES, marker_line("loom_created"))
    assert sleeper["timer"]["callback"] == "%s:%d" % (
        CASES, defined_line("loom_sleeper"))
    assert "name" not in sleeper["timer"]
    assert sleeper["backtrace"][0]["line"] == marker_line("loom_sleep")
    # the runner's frames (resty/loom/timer) are not in the backtrace
    for r in reports:
        assert not any("resty/loom/timer" in f["source"]
                       for f in r["backtrace"]), r["backtrace"]
    assert burner["kind"] == "cpu"
    assert burner["timer"] == {
        "created_at": "%s:%d" % (CASES, marker_line("loom_named")),
        "callback": "%s:%d" % (CASES, defined_line("loom_burner")),
        "name": "burner",
    }
    n.wait_log(r'by timer "burner" \S+watchdog_cases.lua:%d created at '
               r'\S+watchdog_cases.lua:%d' % (defined_line("loom_burner"),
                                             marker_line("loom_named")))
    # a request's stall: the line has no "context: ngx.timer"
    assert n.get("/usleep?ms=200").status == 200
    wait_reports(n, 3)
    line = n.wait_log(r"event loop blocked [^\n]*by GET /usleep[^\n]*")[0]
    assert "context:" not in line, line
    lines = [ln for ln in n.error_log().splitlines()
             if "event loop blocked" in ln]
    assert len(lines) == 3
    assert not any("context: ngx.timer" in ln for ln in lines), lines


def test_loom_timer_stall_without_stats_still_named(nginx):
    # resty.loom.timer with stats = false keeps no creation site: the
    # report still names the timer and the callback's file
    n = nginx(workers=1, http="""
    init_by_lua_block {
        require("resty.loom.timer").configure({ stats = false })
    }
    """ + HTTP % {"threshold": 100}, server=SERVER + """
location = /loom {
    content_by_lua_block {
        assert(require("watchdog_cases").start_loom_timers(250))
        ngx.say("ok")
    }
}
""")
    assert n.get("/loom").status == 200
    reports = wait_reports(n, 2)["reports"]
    assert len(reports) == 2, reports
    burner, sleeper = reports
    assert burner["timer"] == {"callback": CASES, "name": "burner"}
    assert sleeper["timer"] == {"callback": CASES}
    assert sleeper["backtrace"][0]["line"] == marker_line("loom_sleep")
    n.wait_log(r'by timer "burner" \S+watchdog_cases.lua;')


def test_flamegraph_bad_options_raise_at_the_callers_line(nginx):
    # a misspelt or bad renderer option named the watchdog's own line
    n = nginx(
        workers=1, http=HTTP % {"threshold": 100}, server=SERVER + r"""
location = /badflame {
    content_by_lua_block {
        local wd = require "resty.loom.watchdog"
        for _, o in ipairs({ { widht = 800 }, { width = 0/0 }, "wide" }) do
            local ok, err = pcall(function()
                local svg = wd.flamegraph(nil, o)   -- not a tail call
                return svg
            end)
            ngx.say(ok, " ", err)
        end
        ngx.say(#wd.flamegraph(nil, { width = 800 }) > 0)
    }
}
""")
    lines = n.get("/badflame").text.splitlines()
    prefix = r"false content_by_lua\(nginx\.conf:\d+\):\d+: "
    assert re.match(prefix + r"opts\.widht is not an option$", lines[0]), \
        lines
    assert re.match(prefix + r"opts\.width must be a whole number", lines[1])
    assert re.match(prefix + r"opts must be a table$", lines[2]), lines
    assert lines[3] == "true"


def test_timers_wrap_keeps_resty_loom_timer_patch(nginx):
    # the watchdog required before resty.loom.timer's patch(): start()
    # replaced the patched ngx.timer.at/every with wrappers of the native
    # ones, so every timer went native again, in silence
    n = nginx(workers=1, http="""
    init_by_lua_block {
        require "resty.loom.watchdog"
        require("resty.loom.timer").patch()
    }
    """ + HTTP % {"threshold": 100}, server=SERVER + """
location = /patched {
    content_by_lua_block {
        local timer = require "resty.loom.timer"
        ngx.say(ngx.timer.at == timer.at, " ", ngx.timer.every == timer.every)
        assert(ngx.timer.at(5, function() end))
        ngx.say(timer.pending_count())
        -- a bad delay still names this line
        local ok, err = pcall(function()
            local h = ngx.timer.at("soon", function() end)
            return h
        end)
        ngx.say(err)
    }
}
""")
    lines = n.get("/patched").text.splitlines()
    assert lines[:2] == ["true true", "1"], lines
    assert re.match(r"content_by_lua\(nginx\.conf:\d+\):\d+: ", lines[2]), \
        lines
