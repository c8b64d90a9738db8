"""resty.loom.offload at its limits and under misuse: tens of thousands of
calls in flight in one worker, a full queue, runtimes that break the C ABI
(answering twice, never answering, NULL data), and bad options."""

import os
import subprocess
import time

import pytest

from test_offload_core import LIB, ROOT, call, rss_kb, start, stats


@pytest.fixture(scope="module", autouse=True)
def c_runtime():
    subprocess.run(["make", "-s", "-C", os.path.dirname(LIB)], check=True)


FLOOD = """
location /flood {
    content_by_lua_block {
        local cjson = require "cjson.safe"
        local rt = require("offload_t").rt.main
        local n = tonumber(ngx.var.arg_n)
        local out = { ok = 0, bad = 0, errors = {} }
        local function run(k)
            local res, err = rt:call("echo " .. k)
            if res == nil then
                out.errors[err] = (out.errors[err] or 0) + 1
            elseif res == tostring(k) then
                out.ok = out.ok + 1
            else
                out.bad = out.bad + 1
            end
        end
        -- hold every runtime thread first, so that the queue fills up
        local hold = {}
        for i = 1, tonumber(ngx.var.arg_hold) or 0 do
            hold[i] = ngx.thread.spawn(rt.call, rt, "stuck 1500")
        end
        while rt:stats().running < #hold do
            ngx.sleep(0.01)
        end
        local ths = {}
        for k = 1, n do
            ths[k] = ngx.thread.spawn(run, k)
        end
        for k = 1, n do
            ngx.thread.wait(ths[k])
        end
        for i = 1, #hold do
            local _, res = ngx.thread.wait(hold[i])
            if res ~= "done" then out.bad = out.bad + 1 end
        end
        ths = nil
        collectgarbage()
        collectgarbage()
        ngx.say(cjson.encode(out))
    }
}
"""


def flood(n, count, hold=0, timeout=120):
    r = n.get("/flood?n=%d&hold=%d" % (count, hold), timeout=timeout)
    assert r.status == 200, (r.status, r.body, n.error_log()[-3000:])
    return r.json()


def test_8250_in_flight_one_request(nginx):
    # the case: above 4,095 (one block of lua-nginx-module's
    # semaphores) x 2 the worker died with SIGSEGV
    n = start(nginx, workers=1, threads=4, queue=30000, timeout=60,
              server=FLOOD)
    pid = n.worker_pids()
    assert flood(n, 8250) == {"ok": 8250, "bad": 0, "errors": {}}
    assert n.worker_pids() == pid
    assert "signal" not in n.error_log()


def test_50000_in_flight_then_queue_full(nginx):
    n = start(nginx, workers=1, threads=4, queue=50000, timeout=120,
              server=FLOOD)
    pid = n.worker_pids()[0]
    # warm up: the code paths, the Lua heap and the allocator arenas
    assert flood(n, 1000) == {"ok": 1000, "bad": 0, "errors": {}}
    base = rss_kb(pid)

    rss = []
    for _ in range(2):
        assert flood(n, 50000) == {"ok": 50000, "bad": 0, "errors": {}}
        # the heap is trimmed 1 s after a burst: wait for it, up to 10 s
        # (a loaded machine runs the trim timer late)
        deadline = time.time() + 10
        time.sleep(1.2)
        while rss_kb(pid) - base >= 24 * 1024 and time.time() < deadline:
            time.sleep(0.2)
        rss.append(rss_kb(pid))
    peak_queued = stats(n)["peak_queued"]
    print("50,000 in flight: worker RSS %d kB before, %r kB after each of "
          "2 rounds, peak queued %d" % (base, rss, peak_queued))
    assert peak_queued > 40000
    # the task heap is given back (+51 MB stayed before); what stays is
    # LuaJIT's and lua-nginx-module's: 50,000 light threads that only
    # ngx.sleep() leave +17 MB in this worker too
    assert rss[0] - base < 24 * 1024, (base, rss)

    # beyond the queue: with the 4 threads held, 50,000 calls wait and
    # the next 100 get a clean "queue full"; every accepted one answered
    out = flood(n, 50100, hold=4)
    assert out == {"ok": 50000, "bad": 0, "errors": {"queue full": 100}}
    assert stats(n)["rejected"] == 100
    assert n.worker_pids() == [pid]


MISUSE = os.path.join(ROOT, "runtimes", "c", "libloom_offload_misuse.so")
NOT_HELD = r"\[error\].*answer\(\) for a task the runtime does not hold"


def test_answer_twice(nginx):
    n = start(nginx, lib=MISUSE, workers=1)
    n.allow_log(NOT_HELD)
    pid = n.worker_pids()
    for i in range(3):
        assert call(n, "twice").body == b"first"
    n.wait_log(NOT_HELD, count=3)
    assert call(n, "rc").body == b"-1"
    # a task that was never taken, at an address the host never gave out
    assert call(n, "ghost").body == b"ghosted"
    n.wait_log(NOT_HELD, count=4)
    assert call(n, "rc").body == b"-1"
    assert call(n, "echo after").body == b"echo after"
    s = stats(n)
    assert (s["completed"], s["errors"], s["misused"], s["running"]) \
        == (7, 0, 4, 0), s
    assert n.worker_pids() == pid
    assert "signal" not in n.error_log()


def test_answer_null_data(nginx):
    n = start(nginx, lib=MISUSE, workers=1)
    n.allow_log(r"\[error\].*answer\(\) with NULL data and length 16")
    r = call(n, "nulldata")
    assert (r.status, r.body) == (
        502, b"runtime error: invalid answer: NULL data with a length")
    n.wait_log(r"misuse.so: answer\(\) with NULL data and length 16: "
               r"the call fails")
    assert call(n, "rc").body == b"-1"
    s = stats(n)
    assert (s["completed"], s["errors"], s["misused"]) == (1, 1, 1), s


def test_never_answered_is_reclaimed(nginx):
    # reclaim 2 s: the stats read right after the timeout must come
    # before the reclaim, also on a loaded machine
    n = start(nginx, lib=MISUSE, workers=1, reclaim=2)
    lost = r"\[error\].*misuse.so: a task was not answered within 2000 ms"
    n.allow_log(lost)
    r = call(n, "never", t=0.2)
    assert (r.status, r.body) == (502, b"timeout")
    s = stats(n)
    assert (s["running"], s["reclaimed"], s["timeouts"]) == (1, 0, 1), s
    n.wait_log(lost)
    s = stats(n)
    assert (s["running"], s["reclaimed"], s["in_flight"]) == (0, 1, 0), s
    # the runtime's thread is free for other calls meanwhile
    assert call(n, "echo on").body == b"echo on"
    assert len(n.wait_log(lost)) == 1


BAD_OPTS = """
location /badopts {
    content_by_lua_block {
        local offload = require "resty.loom.offload"
        local lib = %s
        local nan, inf = 0/0, math.huge
        local cases = {
            { thraeds = 2 }, { threads = nan }, { threads = inf },
            { threads = 0 }, { threads = 1.5 }, { threads = 1e9 },
            { queue = -1 }, { queue = nan }, { queue = 1e300 },
            { timeout = 0 }, { timeout = nan }, { timeout = -inf },
            { timeout = 1e12 }, { grace = nan }, { grace = -1 },
            { grace = inf }, { spin_us = nan }, { poll_us = -inf },
            { reclaim = 0 }, { reclaim = nan }, { reclaim = inf },
            { timeout = "5" }, { global = 1 },
        }
        for _, opts in ipairs(cases) do
            local ok, err = pcall(offload.load, lib, "bad", opts)
            ngx.say(ok and "accepted" or err)
        end
        -- nothing was created by the refused calls
        ngx.say(#offload.worker_stats())
        local rt = require("offload_t").rt.main
        for _, t in ipairs({ nan, inf, -1, 0, "1" }) do
            local ok, err = pcall(rt.call, rt, "echo x", { timeout = t })
            ngx.say(ok and "accepted" or err)
        end
        local ok, err = pcall(rt.call, rt, "echo x", { into = {} })
        ngx.say(ok and "accepted" or err)
        ok, err = pcall(rt.call, rt, "echo x", { timeot = 1 })
        ngx.say(ok and "accepted" or err)
        for _, t in ipairs({ nan, -inf, inf }) do
            local ok, err = pcall(rt.wait_ready, rt, t)
            ngx.say(ok and "accepted" or err)
        end
        ngx.say(rt:stats().submitted)
    }
}
"""


def test_bad_options_refused_before_anything_changes(nginx):
    n = start(nginx, workers=1, server=BAD_OPTS % ('"%s"' % LIB))
    lines = n.get("/badopts").text.splitlines()
    assert "accepted" not in lines, lines
    assert lines[0] == "opts.thraeds is not an option"
    for line in lines[1:23]:
        assert line.startswith("opts.") and " must be " in line, lines
    assert lines[23] == "1"           # only the runtime loaded at start
    assert all("opts.timeout must be a number above 0 and at most 2000000"
               in x for x in lines[24:29])
    assert lines[29] == "opts.into must be a string.buffer"
    assert lines[30] == "opts.timeot is not an option"
    assert all("timeout must be a number from 0" in x for x in lines[31:34])
    assert lines[34] == "0"           # no call was submitted
