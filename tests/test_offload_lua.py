"""The Lua offload runtime (runtimes/lua): offload threads with resident
LuaJIT states running user Lua that may block."""

import os
import socket
import subprocess
import threading
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
LIB = os.path.join(ROOT, "runtimes", "lua", "build", "libloom_rt_lua.so")
LUA_PATH = os.path.join(ROOT, "tests", "lua", "?.lua")
SOCKET_CPATH = "/usr/lib/x86_64-linux-gnu/lua/5.1/?.so"
SOCKET_PATH = "/usr/share/lua/5.1/?.lua"


@pytest.fixture(scope="module", autouse=True)
def lua_runtime():
    subprocess.run(["make", "-s", "-C", os.path.dirname(os.path.dirname(LIB))],
                   check=True)
    if not os.path.exists(os.path.join(SOCKET_CPATH[:-4], "socket",
                                       "core.so")):
        pytest.skip("lua-socket is not installed (Debian package lua-socket)")


def config(preload="offload_lua_handlers"):
    cfg = "path=%s;%s cpath=%s" % (LUA_PATH, SOCKET_PATH, SOCKET_CPATH)
    if preload:
        cfg += " preload=" + preload
    return cfg


def start(nginx, workers=1, threads=2, queue=64, timeout=5, cfg=None,
          server="", **kw):
    http = """
    init_worker_by_lua_block {
        local offload = require "resty.loom.offload"
        local rt, err = offload.load(%r, %r,
            { threads = %d, queue = %d, timeout = %s })
        LUA_RT, LUA_ERR = rt, err
    }
    """ % (LIB, config() if cfg is None else cfg, threads, queue, timeout)
    http = http.replace("'", '"')
    server = """
    location /call {
        content_by_lua_block {
            if not LUA_RT then
                ngx.status = 500
                return ngx.say("load failed: ", LUA_ERR)
            end
            local a = ngx.req.get_uri_args()
            local res, err = LUA_RT:call(a.f, a.d or "",
                a.t and { timeout = tonumber(a.t) } or nil)
            if not res then
                ngx.status = 502
                return ngx.print("ERR ", err)
            end
            ngx.print(res)
        }
    }
    location /plain { content_by_lua_block { ngx.say("plain") } }
    """ + server
    return nginx(workers=workers, http=http, server=server, **kw)


def call(n, f, d="", t=None, **kw):
    q = "/call?f=%s&d=%s" % (f, d.replace(" ", "%20"))
    if t is not None:
        q += "&t=%s" % t
    return n.get(q, **kw)


def test_state_is_resident_across_calls(nginx):
    n = start(nginx, threads=1)
    got = [call(n, "offload_lua_handlers.count").text for _ in range(50)]
    # one thread, one state: the counter goes on, the module loaded once
    assert got == ["%d 1 1" % i for i in range(1, 51)]


def test_each_thread_has_its_own_state(nginx):
    n = start(nginx, threads=2, server="""
    location /spread {
        content_by_lua_block {
            local ths = {}
            for i = 1, 40 do
                ths[i] = ngx.thread.spawn(function()
                    return LUA_RT:call("offload_lua_handlers.sleep", "0.01")
                end)
            end
            for i = 1, 40 do assert(ngx.thread.wait(ths[i])) end
            local seen = {}
            for i = 1, 2 do
                local a = LUA_RT:call("offload_lua_handlers.count", "")
                seen[#seen + 1] = a
            end
            ngx.say(table.concat(seen, ","))
        }
    }
    """)
    r = n.get("/spread")
    assert r.status == 200
    for part in r.text.strip().split(","):
        count, loads, thread = part.split()
        assert loads == "1" and thread in ("1", "2")


def test_blocking_socket_round_trip_leaves_the_loop_free(nginx):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]

    def serve():
        c, _ = srv.accept()
        line = c.makefile().readline()
        time.sleep(1.0)            # a slow peer: the offload thread blocks
        c.sendall(b"re:" + line.encode())
        c.close()

    threading.Thread(target=serve, daemon=True).start()
    n = start(nginx, threads=1)
    out = []
    th = threading.Thread(target=lambda: out.append(
        call(n, "offload_lua_handlers.roundtrip", "%d hello" % port)))
    th.start()
    time.sleep(0.2)
    t0 = time.time()
    plain = [n.get("/plain").text for _ in range(10)]
    took = time.time() - t0
    th.join()
    srv.close()
    assert plain == ["plain\n"] * 10
    assert out[0].status == 200 and out[0].text == "re:hello"
    # the ten plain requests were answered while the peer still held the
    # offload thread (they did not wait for its 1 s delay)
    assert took < 0.9, took


def test_handler_error_returns_traceback_and_is_logged_once(nginx):
    n = start(nginx)
    n.allow_log(r"lua handler offload_lua_handlers\.fail")
    r = call(n, "offload_lua_handlers.fail", "bad input")
    assert r.status == 502
    assert r.text.startswith("ERR runtime error: offload_lua_handlers.fail: ")
    assert "offload_lua_handlers.lua:" in r.text and "boom: bad input" in r.text
    assert "stack traceback:" in r.text
    r = call(n, "offload_lua_handlers.fail_table")
    assert "(error object is a table value)" in r.text
    n.wait_log(r"lua handler offload_lua_handlers\.fail_table")
    log = n.error_log()
    assert log.count("boom: bad input") == 1
    # the thread goes on serving
    assert call(n, "offload_lua_handlers.echo", "still").text == "still"


def test_bad_names_and_returns(nginx):
    n = start(nginx)
    n.allow_log(r"lua handler ")
    r = call(n, "nodot")
    assert 'bad handler name "nodot"' in r.text
    r = call(n, "no_such_module.f")
    assert r.status == 502 and "module 'no_such_module' not found" in r.text
    r = call(n, "offload_lua_handlers.missing")
    assert 'no function "offload_lua_handlers.missing"' in r.text
    r = call(n, "offload_lua_handlers.bad_return")
    assert "returned a table, not a string" in r.text


def test_name_must_be_a_string(nginx):
    n = start(nginx, server="""
    location /badname {
        content_by_lua_block {
            local ok, err = pcall(LUA_RT.call, LUA_RT, "", "data")
            ngx.say(ok, " ", err)
            ok, err = pcall(LUA_RT.call, LUA_RT, "a\\0b", "data")
            ngx.say(ok, " ", err)
        }
    }
    """)
    lines = n.get("/badname").text.splitlines()
    assert all(l.startswith("false ") and
               l.endswith("name must be a non-empty string without NUL "
                          "bytes") for l in lines), lines


def test_timeout_and_cancellation(nginx):
    n = start(nginx, threads=1)
    r = call(n, "offload_lua_handlers.until_cancelled", t=0.2)
    assert (r.status, r.text) == (502, "ERR timeout")
    n.wait_log("until_cancelled saw the cancel")
    # the only thread is free again
    assert call(n, "offload_lua_handlers.echo", "next", t=2).text == "next"


def test_queue_bound(nginx):
    n = start(nginx, threads=1, queue=2, server="""
    location /flood {
        content_by_lua_block {
            local ths = {}
            for i = 1, 6 do
                ths[i] = ngx.thread.spawn(function()
                    return LUA_RT:call("offload_lua_handlers.sleep", "0.2")
                end)
            end
            local out = {}
            for i = 1, 6 do
                local _, res, err = ngx.thread.wait(ths[i])
                out[#out + 1] = res or err
            end
            ngx.say(table.concat(out, ","))
        }
    }
    """)
    got = n.get("/flood", timeout=10).text.strip().split(",")
    assert got.count("queue full") >= 1
    assert set(got) <= {"slept", "queue full"}
    assert got.count("slept") >= 2


def test_called_from_a_timer_and_other_phases(nginx):
    n = start(nginx, server="""
    location /timer {
        content_by_lua_block {
            local res
            ngx.timer.at(0, function()
                res = LUA_RT:call("offload_lua_handlers.echo", "from timer")
            end)
            for _ = 1, 200 do
                if res then break end
                ngx.sleep(0.01)
            end
            ngx.say(res)
        }
    }
    location /access {
        access_by_lua_block {
            ngx.ctx.r = LUA_RT:call("offload_lua_handlers.echo", "access")
        }
        content_by_lua_block { ngx.say(ngx.ctx.r) }
    }
    """)
    assert n.get("/timer").text == "from timer\n"
    assert n.get("/access").text == "access\n"


def test_preload_failure_fails_the_load(nginx):
    # the states start on the host's start-up thread, after load()
    # returned: calls fail with "closed" and the reason is logged once
    n = start(nginx, cfg=config(preload="no_such_module_x"))
    n.allow_log(r"failed to preload no_such_module_x: module "
                r"'no_such_module_x' not found")
    n.wait_log(r"failed to preload no_such_module_x")
    r = call(n, "offload_lua_handlers.echo", "x")
    assert (r.status, r.text) == (502, "ERR closed")


def test_reload_and_quit(nginx):
    n = start(nginx, workers=2, threads=2)
    assert call(n, "offload_lua_handlers.echo", "a").text == "a"
    n.reload()
    assert call(n, "offload_lua_handlers.echo", "b").text == "b"
    # a call in flight when the worker is told to quit is answered
    out = []
    th = threading.Thread(target=lambda: out.append(
        call(n, "offload_lua_handlers.sleep", "0.5", timeout=10)))
    th.start()
    time.sleep(0.2)
    n.quit()
    th.join()
    assert out[0].status == 200 and out[0].text == "slept"


def test_os_execute_gets_the_exit_status(nginx):
    # nginx's SIGCHLD handler reaped these children before the offload
    # fix: os.execute returned -1 for about half the calls
    n = start(nginx, threads=2, server="""
    location /exec {
        content_by_lua_block {
            local ths = {}
            for i = 1, 20 do
                ths[i] = ngx.thread.spawn(function()
                    return LUA_RT:call("offload_lua_handlers.execute",
                                       "exit " .. (i % 4))
                end)
            end
            local out = {}
            for i = 1, 20 do
                local _, res = ngx.thread.wait(ths[i])
                out[i] = res
            end
            ngx.say(table.concat(out, ","))
        }
    }
    """)
    got = n.get("/exec", timeout=20).text.strip().split(",")
    # LuaJIT's os.execute returns the wait status: exit code * 256
    assert got == [str((i % 4) * 256) for i in range(1, 21)]


def test_handler_name_longer_than_the_limit_is_refused(nginx):
    # a name over 256 bytes was cut to 256 for the lookup while the data
    # started 256 bytes in: a handler ran under a wrong name with the
    # rest of the name and the NUL as its data
    n = start(nginx, cfg=config(preload=None))
    n.allow_log(r"lua handler ")
    fn = "f" * 300
    r = call(n, "offload_lua_any." + fn, "data")
    assert r.status == 502 and "longer than 256 bytes" in r.text, r.text[:80]
    ok = "g" * (256 - len("offload_lua_any."))
    r = call(n, "offload_lua_any." + ok, "data")
    assert r.text == ok + "|data"


def test_named_call_with_a_buffer_or_bad_options(nginx):
    # rt:call(name, buf) with a string.buffer as the data sent the name
    # alone (the buffer was taken for opts): the Lua runtime answered "no
    # handler name", and a runtime that takes a bare name as a call with
    # empty data (Java) answered as if the data were ""
    n = start(nginx, server="""
    location /buf {
        content_by_lua_block {
            local buffer = require "string.buffer"
            local b = buffer.new():put("from a buffer")
            ngx.say(LUA_RT:call("offload_lua_handlers.echo", b))
            ngx.say(#b)
            local ok, err = pcall(LUA_RT.call, LUA_RT,
                                  "offload_lua_handlers.echo", 42)
            ngx.say(ok, " ", err)
            ok, err = pcall(LUA_RT.call, LUA_RT, "x", "y", "z")
            ngx.say(ok, " ", err)
            ngx.say(LUA_RT:call("offload_lua_handlers.echo", "f", false))
        }
    }
    """)
    lines = n.get("/buf").text.splitlines()
    assert lines[0] == "from a buffer", lines
    assert lines[1] == "13", lines
    assert lines[2].startswith("false ") and lines[2].endswith(
        "opts must be a table"), lines
    assert lines[3].startswith("false ") and lines[3].endswith(
        "opts must be a table"), lines
    assert lines[4] == "f", lines


def rss_kb(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])


def test_memory_stays_flat_over_many_calls(nginx):
    # each state's heap and the worker's task memory reach a steady size:
    # another 60,000 calls that each make garbage in the handler leave
    # the worker's RSS within 4 MiB of where it was after the first 60,000
    n = start(nginx, threads=2, queue=1024, server="""
    location /many {
        content_by_lua_block {
            local count = tonumber(ngx.var.arg_n)
            local data = string.rep("d", 200)
            local function run(k)
                for _ = 1, count / 8 do
                    local res, err = LUA_RT:call("offload_lua_handlers.churn",
                                                 data)
                    if res ~= data .. "1," .. data .. "2" then
                        return error(tostring(err or res))
                    end
                end
                return true
            end
            local ths = {}
            for k = 1, 8 do ths[k] = ngx.thread.spawn(run, k) end
            for k = 1, 8 do assert(ngx.thread.wait(ths[k])) end
            ngx.print("ok")
        }
    }
    """)
    pid = n.worker_pids()[0]
    assert n.get("/many?n=60000", timeout=120).text == "ok"
    before = rss_kb(pid)
    assert n.get("/many?n=60000", timeout=120).text == "ok"
    after = rss_kb(pid)
    assert after - before < 4096, (before, after)


def test_misspelled_configuration_key_fails_the_load(nginx):
    # "preloads=..." was ignored: the states started without the module
    # and nothing said so
    n = start(nginx, cfg=config(preload=None) + " preloads=offload_lua_any")
    n.allow_log(r'failed to start .*bad configuration "preloads=')
    n.wait_log(r'bad configuration "preloads=offload_lua_any": want '
               r'<key>=<value>, the keys being path, cpath, preload')
    r = call(n, "offload_lua_handlers.echo", "x")
    assert (r.status, r.text) == (502, "ERR closed")


def test_error_paths_keep_the_state_balanced(nginx):
    # every way a call can fail, 1,000 times each on the one thread: the
    # state's heap (stack included: LuaJIT grows it as values are pushed,
    # and what a leaked slot holds stays reachable) is the same size after
    # the 1,000th round as after the 100th
    n = start(nginx, threads=1, server="""
    location /errors {
        content_by_lua_block {
            local names = { "nodot", "no_such_module_q.f",
                "offload_lua_handlers.missing",
                "offload_lua_handlers.bad_return",
                "offload_lua_handlers.fail",
                "offload_lua_handlers.fail_table",
                "offload_lua_handlers.fail_tostring" }
            local seen, kb = {}
            for round = 1, 1000 do
                for _, name in ipairs(names) do
                    local res, err = LUA_RT:call(name, "x")
                    if res then return ngx.say("answered ", name) end
                    -- the kind of failure: the message without the paths
                    seen[err:gsub("/[^:]*:%d+:", ""):match("^[^\\n]*")]
                        = true
                end
                assert(LUA_RT:call("offload_lua_handlers.echo", "ok") == "ok")
                if round == 100 then
                    kb = tonumber(LUA_RT:call("offload_lua_handlers.heap_kb", ""))
                end
            end
            kb = tonumber(LUA_RT:call("offload_lua_handlers.heap_kb", "")) - kb
            local keys = {}
            for k in pairs(seen) do keys[#keys + 1] = k end
            table.sort(keys)
            ngx.say(#keys, " ", kb)
            ngx.say(table.concat(keys, "\\n"))
        }
    }
    """)
    n.allow_log(r"lua handler ")
    r = n.get("/errors", timeout=60)
    lines = r.text.splitlines()
    # one message per failure kind, the same on the 1,000th round
    kinds, grew_kb = lines[0].split()
    assert kinds == "7", lines
    assert float(grew_kb) < 32, lines[0]
    assert any("error in error handling" in l for l in lines), lines
    assert call(n, "offload_lua_handlers.echo", "still").text == "still"


# what state a module keeps between calls, here and in
# ngx.run_worker_thread, on the same nginx: the docs' side-by-side table
# ("Compared with ngx.run_worker_thread") rests on this test
STATE_SERVER = """
location /state {
    content_by_lua_block {
        local function ours()
            return LUA_RT:call("offload_lua_state.count", "")
        end
        local function theirs()
            local ok, res = ngx.run_worker_thread("one", "offload_lua_state",
                                                  "count")
            assert(ok, res)
            return res
        end
        local f = ngx.var.arg_m == "ours" and ours or theirs
        local seq = {}
        for i = 1, 10 do
            seq[i] = assert(f())
        end
        -- four calls in flight at once: each takes its state when made
        local ths, par = {}, {}
        for i = 1, 4 do
            ths[i] = ngx.thread.spawn(f)
        end
        for i = 1, 4 do
            local ok, res = ngx.thread.wait(ths[i])
            assert(ok and res, res)
            par[i] = res
        end
        table.sort(par, function(a, b) return tonumber(a) < tonumber(b) end)
        ngx.say(table.concat(seq, " "), " | ", table.concat(par, " "))
    }
}
"""


def test_state_kept_between_calls_compared_with_run_worker_thread(nginx):
    # one thread on each side: ours with threads = 1, run_worker_thread on
    # a pool of one thread
    n = start(nginx, threads=1, cfg=config(preload=None),
              main="thread_pool one threads=1;", server=STATE_SERVER)
    ours = n.get("/state?m=ours")
    theirs = n.get("/state?m=rwt")
    assert ours.status == 200 and theirs.status == 200

    # sequential calls: both keep the module loaded and its upvalue alive
    # (lua-nginx-module 0.10.23 takes a VM from its pool and requires the
    # module only on that VM's first call: it does not reload it per call)
    assert ours.text.split(" | ")[0] == " ".join(map(str, range(1, 11)))
    assert theirs.text.split(" | ")[0] == " ".join(map(str, range(1, 11)))

    # four calls at once on one thread: ours run one after the other in the
    # thread's one state, which goes on counting; run_worker_thread gives
    # each call in flight a VM of its own (the pool grows up to
    # lua_worker_thread_vm_pool_size), so three calls find a fresh VM
    # where the module is loaded again with its counter at 0
    assert ours.text.split(" | ")[1].strip() == "11 12 13 14"
    assert theirs.text.split(" | ")[1].strip() == "1 1 1 11"


def test_calls_switching_between_handlers_reach_each(nginx):
    # a thread reuses the function of its last call when the next names
    # the same handler: names of one length that differ (echo, fail),
    # and a failed lookup in between, must still reach their own function
    n = start(nginx, threads=1)
    n.allow_log(r"lua handler ")
    seq = [("offload_lua_handlers.echo", "a", "a"),
           ("offload_lua_handlers.echo", "b", "b"),
           ("offload_lua_handlers.fail", "c", "ERR runtime error: "
            "offload_lua_handlers.fail: "),
           ("offload_lua_handlers.echo", "d", "d"),
           ("offload_lua_handlers.nope", "e", 'ERR runtime error: no '
            'function "offload_lua_handlers.nope"'),
           ("offload_lua_handlers.echo", "f", "f"),
           ("offload_lua_handlers.count", "", "1 1 1"),
           ("offload_lua_handlers.echo", "g", "g")]
    for name, data, want in seq:
        assert call(n, name, data).text.startswith(want), (name, data)
