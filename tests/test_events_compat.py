"""The compatibility modules, driven the way their users drive them."""

import time

import eventsconf as ec

WE_HTTP = """
    lua_shared_dict process_events 1m;
    init_by_lua_block {
        require("resty.loom.events").new({
            socket = ngx.config.prefix() .. "sock/bus.sock" })
    }
    init_worker_by_lua_block {
        local we = require "resty.loom.compat.worker_events"
        local h = require "compat_helper"
        local events = require("resty.loom.events")
        events.register_collector("compat", h.state)
        assert(we.configure({ shm = "process_events", interval = 1 }))
        assert(we.configured())
        we.register(h.record("global"))
        we.register(h.record("src"), "src")
        we.register(h.record("ev"), "src", "ev1", "ev2")
        local removable = h.record("removed")
        we.register(removable, "src", "ev1")
        assert(we.unregister(removable, "src", "ev1"))
        assert(not we.unregister(removable))
        -- a weak handler that is collected stops being called
        we.register_weak(h.record("weak"), "src")
        collectgarbage()
        collectgarbage()
        local strong_weak = h.record("weak_kept")
        package.loaded.keep_me = strong_weak
        we.register_weak(strong_weak, "src")
        local list = we.event_list("src", "ev1", "ev2")
        assert(list.ev1 == "ev1" and list._source == "src")
        assert(not pcall(function() return list.nope end))
    }
    server {
        listen unix:$PREFIX/sock/bus.sock;
        lua_socket_buffer_size 64k;
        location / { content_by_lua_block {
            require("resty.loom.events").get():serve() } }
    }
"""

WE_SERVER = """
    location /post { content_by_lua_block {
        local we = require "resty.loom.compat.worker_events"
        local a = ngx.req.get_uri_args()
        local ok, err = we.post(a.source, a.event, { v = a.v }, a.unique)
        ngx.say(ok and "ok" or err)
    } }
    location /post_local { content_by_lua_block {
        local we = require "resty.loom.compat.worker_events"
        local h = require "compat_helper"
        assert(we.post_local("src", "ev2", "local"))
        -- poll runs the handlers right away, in this request
        local before = h.calls
        assert(we.poll() == "done")
        ngx.say(h.calls - before)
    } }
    location /collect { content_by_lua_block {
        local bus = require("resty.loom.events").get()
        ngx.say(require("cjson").encode(bus:collect("compat", 2)))
    } }
"""


def collect(n):
    return {int(k): v for k, v in n.get("/collect").json().items()}


def wait_got(n, key, count, workers, timeout=10):
    deadline = time.time() + timeout
    while True:
        st = collect(n)
        got = {w: st[w]["got"].get(key, {}).get("n", 0) for w in st}
        if all(got.get(w) == count for w in workers) or \
                time.time() > deadline:
            return st, got
        time.sleep(0.05)


def test_worker_events_api(nginx):
    n = nginx(workers=3, http=WE_HTTP, server=WE_SERVER)
    deadline = time.time() + 10
    while n.get("/collect").status != 200 or len(collect(n)) < 3:
        assert time.time() < deadline
        time.sleep(0.05)
    # "started" self-event reached the global handler in every worker
    st = collect(n)
    for s in st.values():
        assert s["got"]["global|resty-worker-events|started"]["n"] == 1

    assert n.get("/post?source=src&event=ev1&v=1").text.strip() == "ok"
    st, got = wait_got(n, "ev|src|ev1", 1, range(3))
    assert got == {0: 1, 1: 1, 2: 1}
    for s in st.values():
        assert s["got"]["src|src|ev1"]["n"] == 1
        assert s["got"]["global|src|ev1"]["n"] == 1
        assert "removed|src|ev1" not in s["got"]
        assert "weak|src|ev1" not in s["got"]
        assert s["got"]["weak_kept|src|ev1"]["n"] == 1
        # handlers get the publisher's pid, as in worker-events
        assert s["got"]["ev|src|ev1"]["who"] in n.worker_pids()
        assert s["got"]["ev|src|ev1"]["last"] == {"v": "1"}

    # an event not registered for: only source-level and global handlers
    n.get("/post?source=src&event=other")
    st, got = wait_got(n, "src|src|other", 1, range(3))
    for s in st.values():
        assert "ev|src|other" not in s["got"]

    # unique: one worker runs it, however many times it is posted
    for _ in range(5):
        n.get("/post?source=u&event=once&unique=job1")
    time.sleep(0.5)
    st = collect(n)
    assert sum(s["got"].get("global|u|once", {}).get("n", 0)
               for s in st.values()) == 1

    # post_local + poll: the handlers ran inside the request
    # global, src, ev (ev2) and the weak handler still referenced
    assert n.get("/post_local").text.strip() == "4"


EV_HTTP = """
    init_by_lua_block {
        local ev = require("resty.loom.compat.events").new({
            listening = "unix:" .. ngx.config.prefix() .. "sock/ev.sock",
            broker_id = 1,
            unique_timeout = 5,
            max_queue_len = 1024 * 50,
            max_payload_len = 1024 * 1024,
        })
        package.loaded.my_events = ev
        local ok, err = pcall(require("resty.loom.compat.events").new,
                              { listening = "/not/unix" })
        assert(not ok and err:find('"listening" option is invalid'))
    }
    init_worker_by_lua_block {
        local ev = package.loaded.my_events
        local h = require "compat_helper"
        require("resty.loom.events").register_collector("compat", h.state)
        assert(ev:init_worker())
        ev:subscribe("*", "*", h.record("any"))
        ev:subscribe("s", "e", h.record("exact"))
        local id = ev:subscribe("s", "e", h.record("gone"))
        ev:unsubscribe(id)
    }
    server {
        listen unix:$PREFIX/sock/ev.sock;
        lua_socket_buffer_size 64k;
        location / { content_by_lua_block {
            package.loaded.my_events:run() } }
    }
"""

EV_SERVER = """
    location /pub { content_by_lua_block {
        local ev = package.loaded.my_events
        local a = ngx.req.get_uri_args()
        local ok, err = ev:publish(a.target, "s", "e", { v = a.v })
        ngx.say(ok and "ok" or err)
    } }
    location /ready { content_by_lua_block {
        ngx.say(tostring(package.loaded.my_events:is_ready())) } }
    location /collect { content_by_lua_block {
        local bus = require("resty.loom.events").get()
        ngx.say(require("cjson").encode(bus:collect("compat", 2)))
    } }
"""


def test_lua_resty_events_api(nginx):
    n = nginx(workers=3, http=EV_HTTP, server=EV_SERVER)
    deadline = time.time() + 10
    while n.get("/ready").text.strip() != "true" or \
            n.get("/collect").status != 200 or len(collect(n)) < 3:
        assert time.time() < deadline
        time.sleep(0.05)
    assert n.get("/pub?target=all&v=1").text.strip() == "ok"
    st, got = wait_got(n, "exact|s|e", 1, range(3))
    assert got == {0: 1, 1: 1, 2: 1}
    for s in st.values():
        assert s["got"]["any|s|e"]["n"] == 1
        assert "gone|s|e" not in s["got"]
    # any other target string is a unique hash: one worker
    for _ in range(4):
        n.get("/pub?target=hash1&v=2")
    time.sleep(0.5)
    st = collect(n)
    assert sum(s["got"]["exact|s|e"]["n"] for s in st.values()) == 4
    # the broker is worker 1 here
    assert "pinned to worker 1" in n.error_log()


# lua-resty-worker-events' own habits: handlers registered before
# configure(), configure() called again, post() then poll() in one go,
# exact-level unregister, a handler unregistering another mid-dispatch
WE_HABITS_HTTP = """
    init_by_lua_block {
        require("resty.loom.events").new({
            socket = ngx.config.prefix() .. "sock/bus.sock" })
    }
    init_worker_by_lua_block {
        local we = require "resty.loom.compat.worker_events"
        local r = { calls = {} }
        package.loaded.habits = r
        local function record(name)
            return function()
                r.calls[name] = (r.calls[name] or 0) + 1
            end
        end
        local cb = record("cb")
        assert(we.register(record("started"), we.events._source,
                           we.events.started))
        -- before configure(), as the lua-resty-worker-events synopsis does
        assert(we.register(cb))
        assert(we.register(cb, "src"))
        assert(we.register(cb, "src", "e"))
        assert(we.configure({ shm = "unused" }))
        assert(we.configure({ interval = 0.5 }))
        -- each call removes its own level only
        r.unreg_global = we.unregister(cb)
        r.unreg_global_again = we.unregister(cb)
        r.unreg_source = we.unregister(cb, "src")
        -- "second" is removed by "first" while an event is dispatched
        local second = record("second")
        we.register(function()
            r.calls.first = (r.calls.first or 0) + 1
            we.unregister(second, "mid")
        end, "mid")
        we.register(second, "mid")
    }
    server {
        listen unix:$PREFIX/sock/bus.sock;
        lua_socket_buffer_size 64k;
        location / { content_by_lua_block {
            require("resty.loom.events").get():serve() } }
    }
"""

WE_HABITS_SERVER = """
    location /habits { content_by_lua_block {
        local we = require "resty.loom.compat.worker_events"
        local r = package.loaded.habits
        local before = r.calls.cb or 0
        assert(we.post("src", "e", 1))
        -- the poster's own handler runs in this poll(), as with the shm
        local res = we.poll()
        local after_poll = (r.calls.cb or 0) - before
        assert(we.post_local("mid", "x"))
        we.poll()
        ngx.sleep(0.2)
        ngx.say(require("cjson").encode({
            poll = res, after_poll = after_poll, started = r.calls.started,
            unreg = { r.unreg_global, r.unreg_global_again, r.unreg_source },
            first = r.calls.first, second = r.calls.second or 0,
        }))
    } }
"""


def test_worker_events_habits(nginx):
    n = nginx(workers=1, http=WE_HABITS_HTTP, server=WE_HABITS_SERVER)
    r = n.get("/habits").json()
    assert r["poll"] == "done"
    # only the event-specific registration is left of the three
    assert r["after_poll"] == 1, r
    assert r["started"] == 1  # configure() twice, "started" once
    assert r["unreg"] == [True, False, True]
    assert r["first"] == 1 and r["second"] == 0
