"""resty.loom.offload through real nginx, with the example C runtime.

Covers the nginx side and the Lua API: results, runtime errors, timeouts
and late answers, queue full, wrong phases, every yieldable phase, 1,000
concurrent calls, aborted calls, start-up off the event loop, start-up
failures, HUP reload with calls in flight, quit with a stuck call, and a
soak of 1,000,000 calls with the worker's RSS flat.
"""

import hashlib
import json
import os
import socket
import subprocess
import threading
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
LIB = os.path.join(ROOT, "runtimes", "c", "libloom_offload_c.so")

LOCATIONS = """
location /call { content_by_lua_block { require("offload_t").call() } }
location /stats { content_by_lua_block { require("offload_t").stats() } }
location /many { content_by_lua_block { require("offload_t").many() } }
location /plain { content_by_lua_block { ngx.say("plain") } }
"""


@pytest.fixture(scope="module", autouse=True)
def c_runtime():
    subprocess.run(["make", "-s", "-C", os.path.dirname(LIB)], check=True)


def lua_opts(**opts):
    parts = []
    for k, v in opts.items():
        if isinstance(v, bool):
            v = "true" if v else "false"
        parts.append("%s = %s" % (k, v))
    return "{" + ", ".join(parts) + "}"


def start(nginx, config="", workers=2, http="", server="", lib=LIB,
          shutdown_timeout="10s", init_worker="", **opts):
    opts.setdefault("timeout", 5)
    load = """
    init_worker_by_lua_block {
        require("offload_t").load(%s, %s, %s)
        %s
    }
    """ % (json.dumps(lib), json.dumps(config), lua_opts(**opts),
           init_worker)
    return nginx(workers=workers, http=load + http,
                 server=LOCATIONS + server, shutdown_timeout=shutdown_timeout)


def call(n, payload, t=None, **kw):
    path = "/call?p=" + payload.replace(" ", "%20")
    if t is not None:
        path += "&t=%s" % t
    return n.get(path, **kw)


def stats(n):
    return n.get("/stats").json()


def wait_running(n, count, timeout=10):
    """Waits until runtime threads hold count tasks (one worker)."""
    deadline = time.time() + timeout
    while stats(n)["running"] != count:
        assert time.time() < deadline, stats(n)
        time.sleep(0.02)


def test_results(nginx):
    n = start(nginx, workers=1)
    r = call(n, "echo hello")
    assert (r.status, r.body) == (200, b"hello")

    # state kept between calls: a counter and a cache in the runtime
    assert [call(n, "incr").body for _ in range(3)] == [b"1", b"2", b"3"]
    assert call(n, "set k v1").body == b"ok"
    assert call(n, "get k").body == b"v1"

    want = hashlib.sha256(b"abc").digest()
    for _ in range(999):
        want = hashlib.sha256(want).digest()
    assert call(n, "sha256 1000 abc").body == want.hex().encode()

    # binary payloads with NUL bytes, empty, large, large answers
    body = bytes(range(256)) * 4096 + b"\0end"
    r = n.post("/call", body=b"echo " + body)
    assert r.status == 200 and r.body == body
    r = n.post("/call", body=b"echo ")
    assert (r.status, r.body) == (200, b"")
    r = call(n, "size 3000000")
    assert r.status == 200 and r.body == b"x" * 3000000

    s = stats(n)
    assert s["state"] == "ready"
    assert s["completed"] >= 10 and s["errors"] == 0
    assert s["latency"]["count"] == s["completed"]
    assert 0 < s["latency"]["p50"] <= s["latency"]["p99"] \
        <= s["latency"]["max"]


def test_runtime_error_keeps_worker(nginx):
    n = start(nginx, workers=1)
    pid = n.worker_pids()
    r = call(n, "fail something broke")
    assert (r.status, r.body) == (502, b"runtime error: something broke")
    r = call(n, "bogus")
    assert r.body == b'runtime error: unknown op "bogus"'
    assert call(n, "echo fine").body == b"fine"
    assert n.worker_pids() == pid
    assert stats(n)["errors"] == 2


def test_timeout_cancels_and_drops_late_answer(nginx):
    n = start(nginx, workers=1, threads=1)
    r = call(n, "sleep 3000", t=0.1)
    assert (r.status, r.body) == (502, b"timeout")
    # the runtime saw the cancelled flag and stopped early (its only
    # thread is free long before the 3 s sleep would end), and its late
    # answer ("cancelled") went nowhere: the next call gets its own
    r = call(n, "echo next", t=1.5)
    assert (r.status, r.body) == (200, b"next")

    deadline = time.time() + 5
    while time.time() < deadline:
        s = stats(n)
        if s["late"] >= 1:
            break
        time.sleep(0.05)
    assert s["timeouts"] == 1 and s["late"] == 1
    assert s["completed"] == 1 and s["running"] == 0 and s["queued"] == 0


def test_timeout_while_queued(nginx):
    n = start(nginx, workers=1, threads=1, server="""
    location /t {
        content_by_lua_block {
            local rt = require("offload_t").rt.main
            local th = ngx.thread.spawn(function()
                return rt:call("stuck 300")
            end)
            ngx.sleep(0.05)
            local res, err = rt:call("echo queued", { timeout = 0.05 })
            ngx.say(res, " ", err)
            ngx.say(select(2, ngx.thread.wait(th)))
            ngx.say(rt:call("echo after"))
            local s = rt:stats()
            ngx.say(s.timeouts, " ", s.late, " ", s.queued)
        }
    }
    """)
    r = n.get("/t")
    assert r.text == "nil timeout\ndone\nafter\n1 0 0\n"


def test_queue_full(nginx):
    n = start(nginx, workers=1, threads=1, queue=2, server="""
    location /t {
        content_by_lua_block {
            local rt = require("offload_t").rt.main
            local ths = {}
            ths[1] = ngx.thread.spawn(function()
                return rt:call("stuck 200")
            end)
            -- until the runtime thread is busy with it
            while rt:stats().running == 0 do
                ngx.sleep(0.01)
            end
            for i = 2, 3 do
                ths[i] = ngx.thread.spawn(function()
                    return rt:call("echo " .. i)
                end)
            end
            ngx.say(rt:call("echo 4"))
            for i = 1, 3 do
                local _, res, err = ngx.thread.wait(ths[i])
                ngx.say(res, " ", err)
            end
            ngx.say(rt:call("echo 5"))
            ngx.say(rt:stats().rejected)
        }
    }
    """)
    r = n.get("/t")
    assert r.text == "nilqueue full\ndone nil\n2 nil\n3 nil\n5\n1\n"


def test_wrong_phase(nginx):
    n = start(nginx, workers=1, http="lua_shared_dict offload_t 1m;",
              init_worker="""
        local rt = require("offload_t").rt.main
        local res, err = rt:call("echo x")
        ngx.shared.offload_t:set("init_worker", tostring(res) .. " " .. err)
    """, server="""
    location /phases {
        set_by_lua_block $set_res {
            local rt = require("offload_t").rt.main
            local res, err = rt:call("echo x")
            return tostring(res) .. " " .. err
        }
        content_by_lua_block {
            ngx.say(ngx.var.set_res)
        }
        header_filter_by_lua_block {
            local rt = require("offload_t").rt.main
            local res, err = rt:call("echo x")
            ngx.header["X-Header-Filter"] = tostring(res) .. " " .. err
        }
        log_by_lua_block {
            local rt = require("offload_t").rt.main
            local res, err = rt:call("echo x")
            ngx.shared.offload_t:set("log", tostring(res) .. " " .. err)
        }
    }
    location /read {
        content_by_lua_block {
            local d = ngx.shared.offload_t
            ngx.say(d:get("init_worker"))
            ngx.say(d:get("log"))
            ngx.say(require("offload_t").rt.main:call("echo still fine"))
        }
    }
    """)
    r = n.get("/phases")
    assert r.text == "nil API disabled in the context of set\n"
    assert r.headers["X-Header-Filter"] == \
        "nil API disabled in the context of header_filter"
    r = n.get("/read")
    assert r.text == ("nil API disabled in the context of init_worker\n"
                      "nil API disabled in the context of log\n"
                      "still fine\n")


def test_yieldable_phases(nginx):
    n = start(nginx, workers=1, http="lua_shared_dict offload_t 1m;",
              server="""
    location /phases {
        rewrite_by_lua_block {
            ngx.ctx.rw = require("offload_t").rt.main:call("echo rewrite")
        }
        access_by_lua_block {
            ngx.ctx.ac = require("offload_t").rt.main:call("echo access")
        }
        content_by_lua_block {
            local rt = require("offload_t").rt.main
            local th = ngx.thread.spawn(function()
                return rt:call("echo thread")
            end)
            local co = coroutine.wrap(function()
                return rt:call("echo coroutine")
            end)
            local _, th_res = ngx.thread.wait(th)
            ngx.say(ngx.ctx.rw, " ", ngx.ctx.ac, " ", th_res, " ", co(),
                    " ", rt:call("echo content"))
            assert(ngx.timer.at(0, function(premature)
                local res, err = rt:call("echo timer")
                ngx.shared.offload_t:set("timer", res or err)
            end))
        }
    }
    location /timer {
        content_by_lua_block {
            ngx.say(ngx.shared.offload_t:get("timer"))
        }
    }
    """)
    r = n.get("/phases")
    assert r.text == "rewrite access thread coroutine content\n"
    deadline = time.time() + 5
    while n.get("/timer").text != "timer\n" and time.time() < deadline:
        time.sleep(0.05)
    assert n.get("/timer").text == "timer\n"


def test_buffers(nginx):
    n = start(nginx, workers=1, server="""
    location /t {
        content_by_lua_block {
            local buffer = require "string.buffer"
            local rt = require("offload_t").rt.main
            local inb = buffer.new():put("echo ", string.rep("ab", 1000))
            local out = buffer.new():put("<")
            local res = assert(rt:call(inb, { into = out }))
            ngx.say(res == out, " ", #out, " ", out:get(3))
            local ok, err = pcall(rt.call, rt, 123)
            ngx.say(ok, " ", err:match("payload must be .*"))
        }
    }
    """)
    assert n.get("/t").text == ("true 2001 <ab\nfalse payload must be a "
                                "string or a string.buffer\n")


def test_1000_concurrent_calls(nginx):
    n = start(nginx, workers=2, threads=2, queue=4096)
    results = []

    def run():
        results.append(n.get("/many?n=1000&c=1000&p=echo", timeout=30))

    # 1,000 light threads in each worker at the same time
    ths = [threading.Thread(target=run) for _ in range(4)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    for r in results:
        assert r.status == 200
        assert r.json() == {"ok": 1000, "errors": {}, "bad": 0}
    peak = max(stats(n)["peak_queued"] for _ in range(8))
    assert peak > 100


def test_aborted_calls(nginx):
    n = start(nginx, workers=1, threads=1, http="lua_check_client_abort on;",
              server="""
    location /kill {
        content_by_lua_block {
            local rt = require("offload_t").rt.main
            local th = ngx.thread.spawn(function()
                return rt:call("sleep 300")
            end)
            ngx.sleep(0.02)
            ngx.thread.kill(th)
            ngx.say(rt:call("echo after kill"))
        }
    }
    """)
    assert n.get("/kill").text == "after kill\n"

    # the client goes away while its call runs
    s = socket.create_connection(("127.0.0.1", n.port))
    s.sendall(b"GET /call?p=sleep%20400 HTTP/1.1\r\nHost: x\r\n\r\n")
    wait_running(n, 1)
    s.close()

    deadline = time.time() + 5
    while time.time() < deadline:
        st = stats(n)
        if st["aborted"] == 1 and st["late"] == 1:
            break
        time.sleep(0.05)
    # the killed light thread's task ended with its request (answered by
    # then); the client abort cancelled its call, whose answer was dropped
    assert st["aborted"] == 1 and st["late"] == 1
    assert st["running"] == 0
    assert call(n, "echo alive").body == b"alive"


def test_startup_off_the_event_loop(nginx):
    n = start(nginx, "init_delay_ms=2500", workers=1, server="""
    location /state {
        content_by_lua_block {
            ngx.say(require("offload_t").rt.main:state())
        }
    }
    """)
    t0 = time.time()
    # served while the runtime starts: start-up is not on the event loop
    assert n.get("/state").text == "starting\n"
    assert n.get("/plain").text == "plain\n"
    assert time.time() - t0 < 2
    # a call made during start-up waits in the queue
    r = call(n, "echo early")
    assert (r.status, r.body) == (200, b"early")
    assert n.get("/state").text == "ready\n"


def test_startup_failure(nginx):
    n = start(nginx, "init_fail=no-database", workers=1, server="""
    location /ready {
        content_by_lua_block {
            local rt = require("offload_t").rt.main
            ngx.say(rt:wait_ready(3))
            ngx.say(rt:state())
        }
    }
    """)
    n.allow_log(r"failed to start .*libloom_offload_c.so: no-database")
    r = n.get("/ready")
    assert r.text == "nilfailed to start: no-database\nfailedno-database\n"
    r = call(n, "echo x")
    assert (r.status, r.body) == (502, b"closed")


def test_missing_library(nginx):
    n = start(nginx, workers=1, lib="/nonexistent/libnope.so", server="""
    location /ready {
        content_by_lua_block {
            ngx.say(require("offload_t").rt.main:wait_ready(3))
        }
    }
    location /bad {
        content_by_lua_block {
            local offload = require "resty.loom.offload"
            ngx.say(pcall(offload.load, "x", nil, { threads = 0 }))
            ngx.say(pcall(offload.load, "x", 5))
        }
    }
    """)
    n.allow_log(r"failed to start /nonexistent/libnope.so")
    r = n.get("/ready")
    assert r.text.startswith("nilfailed to start: /nonexistent/libnope.so")
    r = n.get("/bad")
    assert "opts.threads must be a whole number from 1 to 1024" in r.text
    assert "config must be a string" in r.text


def test_instances_keep_their_own_state(nginx):
    n = start(nginx, workers=1, init_worker="""
        require("offload_t").load(%s, "b=1", {}, "b")
    """ % json.dumps(LIB))
    assert call(n, "incr").body == b"1"
    assert call(n, "incr").body == b"2"
    assert n.get("/call?rt=b&p=incr").body == b"1"
    assert n.get("/call?rt=b&p=info").body == \
        b"worker=0 threads=2 config=b=1"


def test_reload_with_calls_in_flight(nginx):
    n = start(nginx, workers=2, threads=2)
    old = n.worker_pids()
    results = []

    def run():
        results.append(call(n, "sleep 800", timeout=20))

    ths = [threading.Thread(target=run) for _ in range(6)]
    for t in ths:
        t.start()
    time.sleep(0.5)
    n.reload()
    for t in ths:
        t.join()
    assert [(r.status, r.body) for r in results] == [(200, b"slept")] * 6
    assert call(n, "echo new generation").body == b"new generation"
    assert n.wait_gone(old, timeout=10)


def test_quit_with_stuck_call(nginx):
    n = start(nginx, workers=1, threads=1, grace=1, shutdown_timeout="60s")
    results = []

    def run():
        results.append(call(n, "stuck 30000", t=60, timeout=60))

    th = threading.Thread(target=run)
    th.start()
    wait_running(n, 1)
    t0 = time.time()
    n.quit(timeout=30)
    took = time.time() - t0
    th.join()
    # the call got "closed" after the 1 s grace period, and the stuck
    # runtime was abandoned after another bounded wait, long before the
    # call's own timeout and nginx's shutdown timer (60 s each)
    assert (results[0].status, results[0].body) == (502, b"closed")
    assert took < 8
    log = n.error_log()
    assert "grace period over" in log
    assert "did not shut down within 1000 ms, abandoned" in log


def rss_kb(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_soak_rss_flat(nginx):
    n = start(nginx, workers=1, threads=2, queue=4096, server="""
    location /gc {
        content_by_lua_block {
            collectgarbage()
            collectgarbage()
            ngx.say(collectgarbage("count"))
        }
    }
    """)
    pid = n.worker_pids()[0]

    def batch(count, c):
        r = n.get("/many?n=%d&c=%d&p=echo" % (count, c), timeout=120)
        assert r.json() == {"ok": count, "errors": {}, "bad": 0}

    # warm up: 200,000 calls, sequential and from 64 light threads
    batch(100000, 1)
    batch(100000, 64)
    n.get("/gc")
    before = rss_kb(pid)
    for _ in range(4):
        batch(100000, 1)
        batch(100000, 64)
    n.get("/gc")
    after = rss_kb(pid)
    s = stats(n)
    assert s["completed"] == 1000000
    assert s["running"] == 0 and s["queued"] == 0
    print("soak: worker RSS %d kB after 200k calls, %d kB after 1M" % (
        before, after))
    # 800,000 calls after the warm-up: no growth beyond allocator noise
    assert after - before < 2048, (before, after)


def test_quit_with_abandoned_call(nginx):
    # a call whose client went away while a runtime thread still holds it:
    # at exit its semaphore goes back to lua-nginx-module (no "sema mm"
    # alert), and the worker does not wait for the stuck answer
    n = start(nginx, workers=1, threads=1, grace=1,
              http="lua_check_client_abort on;")
    s = socket.create_connection(("127.0.0.1", n.port))
    s.sendall(b"GET /call?p=stuck%205000 HTTP/1.1\r\nHost: x\r\n\r\n")
    wait_running(n, 1)
    s.close()
    deadline = time.time() + 5
    while stats(n)["aborted"] != 1 and time.time() < deadline:
        time.sleep(0.05)
    assert stats(n)["aborted"] == 1
    t0 = time.time()
    n.quit(timeout=30)
    assert time.time() - t0 < 5
    assert "sema mm" not in n.error_log()


def test_quit_during_startup(nginx):
    # a runtime whose start-up never ends does not hold the worker back
    n = start(nginx, "init_delay_ms=60000", workers=1, grace=1)
    r = call(n, "echo never", t=0.2)
    assert (r.status, r.body) == (502, b"timeout")
    t0 = time.time()
    n.quit(timeout=30)
    assert time.time() - t0 < 5
    assert "still starting at exit, abandoned" in n.error_log()


def test_stats_from_all_workers(nginx):
    import eventsconf as ec
    n = nginx(workers=2, http=ec.http(extra_worker="""
        require("offload_t").load(%s, "", { timeout = 5 })
        require("resty.loom.offload").register_collector()
    """ % json.dumps(LIB)), server=LOCATIONS + ec.SERVER + """
    location /all {
        content_by_lua_block {
            local offload = require "resty.loom.offload"
            local res, how = offload.collect(2)
            ngx.say(require("cjson").encode({ res = res, how = how }))
        }
    }
    """)
    ec.wait_ready(n)
    for _ in range(20):
        assert call(n, "echo x").body == b"x"
    r = n.get("/all").json()
    assert "how" not in r          # gathered over the bus, not "local"
    assert sorted(r["res"]) == ["0", "1"]
    assert sum(w[0]["completed"] for w in r["res"].values()) == 20
