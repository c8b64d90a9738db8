"""resty.loom.offload at its limits and under misuse: tens of thousands of
calls in flight in one worker, a full queue, runtimes that break the C ABI
(answering twice, never answering, NULL data), and bad options."""

import os
import subprocess
import time

import pytest

from test_offload_core import LIB, rss_kb, start, stats


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
        time.sleep(1.5)     # the heap is trimmed 1 s after a burst
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
