"""The example C runtime (runtimes/c): its own mock-host test, and what it
shows through real nginx: CPU work off the event loop, state shared by the
runtime's threads."""

import hashlib
import json
import os
import subprocess
import threading
import time

import pytest

from test_offload_core import LIB, ROOT, call, start, wait_running


@pytest.fixture(scope="module", autouse=True)
def c_runtime():
    subprocess.run(["make", "-s", "-C", os.path.dirname(LIB)], check=True)


def test_mock_host():
    res = subprocess.run(["make", "-s", "-C", os.path.dirname(LIB), "test"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ok shutdown" in res.stdout
    assert "not ok" not in res.stdout


def test_hashing_does_not_block_the_event_loop(nginx):
    n = start(nginx, workers=1, threads=1, timeout=60)
    done = []

    def hash_it():
        r = call(n, "sha256 4000000 x", timeout=60)
        done.append((time.time(), r))

    th = threading.Thread(target=hash_it)
    th.start()
    wait_running(n, 1)
    plain = []
    for _ in range(20):
        r = n.get("/plain")
        plain.append((time.time(), r.text))
    th.join()
    # the same (only) worker answered every plain request while its
    # runtime thread was still hashing
    assert [t for _, t in plain] == ["plain\n"] * 20
    assert done[0][1].status == 200 and len(done[0][1].body) == 64
    assert plain[-1][0] < done[0][0]


def test_cache_shared_by_threads(nginx):
    n = start(nginx, workers=1, threads=4, server="""
    location /cache {
        content_by_lua_block {
            local rt = require("offload_t").rt.main
            local ths = {}
            for i = 1, 200 do
                ths[i] = ngx.thread.spawn(function()
                    assert(rt:call("set k" .. i .. " v" .. i) == "ok")
                    return rt:call("get k" .. i)
                end)
            end
            local bad = 0
            for i = 1, 200 do
                local _, v = ngx.thread.wait(ths[i])
                if v ~= "v" .. i then bad = bad + 1 end
            end
            local _, err = rt:call("get missing")
            ngx.say(bad, " ", err)
        }
    }
    """)
    assert n.get("/cache").text == "0 runtime error: not found\n"
    # the cache outlives the request: state kept between calls
    assert call(n, "get k77").body == b"v77"
    info = call(n, "info").body.decode()
    assert info == "worker=0 threads=4 config="
    s = json.loads(n.get("/stats").body)
    assert s["threads"] == 4 and s["errors"] == 1


def test_gateway_endpoints(nginx):
    root = ROOT
    # one worker: without an events bus /loom/offload shows its own only
    n = nginx(workers=1, http="""
    init_by_lua_block {
        package.path = "%(root)s/examples/gateway/lua/?.lua;" .. package.path
    }
    init_worker_by_lua_block {
        require("gateway.offload").init_worker()
    }
    """ % {"root": root}, server="""
    include %s/examples/gateway/conf.d/offload.server.conf;
    """ % root)
    want = hashlib.sha256(b"hello world").digest()
    for _ in range(9):
        want = hashlib.sha256(want).digest()
    r = n.get("/offload/hash?data=hello%20world&rounds=10")
    assert r.status == 200
    body = r.json()
    assert body["sha256"] == want.hex() and body["rounds"] == 10
    assert n.get("/offload/hash?rounds=0").status == 400
    r = n.get("/loom/offload")
    assert r.status == 200
    workers = r.json()["workers"]
    rts = [w["offload"]["runtimes"]["libloom_offload_c.so"] for w in workers]
    assert rts and all(rt["state"] == "ready" for rt in rts)
    assert rts[0]["completed_total"] == 1


def children(pid):
    with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
        return f.read().split()


def test_children_of_the_main_thread_are_still_reaped(nginx):
    # the SIGCHLD wrapper leaves runtime threads' children to them, but
    # must still run nginx's handler for children of the worker's main
    # thread: one that nobody waits for (an io.popen() never closed)
    # is reaped, not left a zombie
    n = start(nginx, workers=1, server="""
    location /popen {
        content_by_lua_block {
            POPENED = POPENED or {}
            POPENED[#POPENED + 1] = io.popen("exit 3")
            ngx.say("ok")
        }
    }
    """)
    pid = n.worker_pids()[0]
    assert call(n, "echo x").body == b"x"      # the runtime is loaded
    for _ in range(3):
        assert n.get("/popen").text == "ok\n"
    deadline = time.time() + 10
    while children(pid) and time.time() < deadline:
        time.sleep(0.05)
    assert children(pid) == []
