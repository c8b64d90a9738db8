"""resty.loom.compat.worker_events against lua-resty-worker-events 2.x:
each test ports one case of the peer's t/sanity.t (named in its
docstring) and checks what it checks, in handler-call order and
messages."""

import re
import time

from loomtest.nginx import ROOT

LINE = re.compile(r"compat-handler: ([^;]*);")


def handler_lines(n):
    return LINE.findall(n.error_log())


def settle(n, count, timeout=10):
    """Handler lines once at least count are there and no more come."""
    deadline = time.time() + timeout
    while len(handler_lines(n)) < count and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    return handler_lines(n)


def conf(configure="interval = 0.1", register=True, mapping=False):
    """The peer's setup plus the bus: events.new() in init_by_lua and its
    unix server; configure() (and a global handler) in init_worker."""
    module = "resty.loom.compat.worker_events"
    path = ""
    if mapping:
        module = "resty.worker.events"
        path = 'package.path = "%s/lib/compat/?.lua;" .. package.path' % ROOT
    reg = 'we.register(require("compat_log").handler("h"))' \
        if register else ""
    return """
    lua_shared_dict worker_events 1m;
    init_by_lua_block {
        %s
        require("resty.loom.events").new({
            socket = ngx.config.prefix() .. "sock/bus.sock" })
    }
    init_worker_by_lua_block {
        local we = require "%s"
        %s
        local ok, err = we.configure{ shm = "worker_events", %s }
        if not ok then
            ngx.log(ngx.ERR, "failed to configure worker events: ", err)
        end
    }
    server {
        listen unix:$PREFIX/sock/bus.sock;
        location / { content_by_lua_block {
            require("resty.loom.events").get():serve() } }
    }
    """ % (path, module, reg, configure)


def started(pid_re=r"\d+"):
    return re.compile(r"h source=resty-worker-events, event=started, "
                      r"who=%s, by=0, data=nil$" % pid_re)


def test_started_then_local_then_broadcast_order(nginx):
    """sanity.t 2: the own "started" event, then the local post with pid
    nil, then the two posts with the poster's pid."""
    server = """
    location = /t { content_by_lua_block {
        local we = require "resty.loom.compat.worker_events"
        we.post("content_by_lua", "request1", "01234567890")
        we.post_local("content_by_lua", "request2", "01234567890")
        we.post("content_by_lua", "request3", "01234567890")
        ngx.say(ngx.worker.pid())
    } }
    """
    n = nginx(workers=1, http=conf(), server=server)
    settle(n, 1)
    pid = n.get("/t").text.strip()
    got = settle(n, 4)
    assert started(pid).match(got[0]), got
    assert got[1:] == [
        "h source=content_by_lua, event=request2, who=nil, by=0, "
        "data=01234567890",
        "h source=content_by_lua, event=request1, who=%s, by=0, "
        "data=01234567890" % pid,
        "h source=content_by_lua, event=request3, who=%s, by=0, "
        "data=01234567890" % pid,
    ]


def test_post_with_missing_data(nginx):
    """sanity.t 9 (data nil) and 4's posts: a post without data reaches
    handlers with data nil, with and without a unique key."""
    server = """
    location = /t { content_by_lua_block {
        local we = require "resty.loom.compat.worker_events"
        ngx.say(we.post("content_by_lua", "request1"))
        ngx.say(we.post("content_by_lua", "request2", nil, true))
        ngx.say(we.post("content_by_lua", "request3", nil))
    } }
    """
    n = nginx(workers=1, http=conf("timeout = 0.2, wait_max = 0.05, "
                                   "wait_interval = 0.02"), server=server)
    settle(n, 1)
    assert n.get("/t").text == "true\ntrue\ntrue\n"
    got = [re.sub(r"who=\d+", "who=P", l) for l in settle(n, 4)[1:]]
    assert got == ["h source=content_by_lua, event=request%d, who=P, by=0, "
                   "data=nil" % i for i in (1, 2, 3)]


def test_unique_done_once_within_timeout(nginx):
    """sanity.t 5: 'one' done, and only once within timeout; again after
    it."""
    server = """
    location = /t { content_by_lua_block {
        local we = require "resty.loom.compat.worker_events"
        we.post("content_by_lua","request1","01234567890")
        we.post("content_by_lua","request2","01234567890", "unique_value")
        we.post("content_by_lua","request3","01234567890", "unique_value")
        ngx.sleep(0.1) -- wait for unique timeout to expire
        we.post("content_by_lua","request4","01234567890", "unique_value")
        we.post("content_by_lua","request5","01234567890", "unique_value")
        we.post("content_by_lua","request6","01234567890")
        ngx.say("ok")
    } }
    """
    n = nginx(workers=1, http=conf("interval = 0.1, timeout = 0.04"),
              server=server)
    settle(n, 1)
    assert n.get("/t").status == 200
    got = [re.search(r"event=(\w+)", l).group(1) for l in settle(n, 5)]
    assert got == ["started", "request1", "request2", "request4",
                   "request6"]


def test_unique_done_once_across_workers(nginx):
    """sanity.t 5 with 3 workers: every worker sees the posts, exactly one
    runs each unique event."""
    server = """
    location = /t { content_by_lua_block {
        local we = require "resty.loom.compat.worker_events"
        for i = 1, 5 do
            we.post("content_by_lua", "unique" .. i, "x", "key" .. i)
            we.post("content_by_lua", "unique" .. i, "x", "key" .. i)
        end
        we.post("content_by_lua", "all", "x")
        ngx.say("ok")
    } }
    """
    n = nginx(workers=3, http=conf(), server=server)
    settle(n, 9)
    for _ in range(3):
        assert n.get("/t").status == 200
        time.sleep(0.05)
    got = settle(n, 9 + 9 + 5)
    events = [re.search(r"event=(\w+)", l).group(1) for l in got]
    for i in range(1, 6):
        # posted twice per request, three requests within the timeout
        assert events.count("unique%d" % i) == 1, got
    assert events.count("all") == 9
    assert events.count("started") == 9   # each worker's, in every worker


def test_unique_claimed_by_another_worker_is_skipped(nginx):
    """sanity.t 6: a unique key already claimed in the shm (by pid 666) is
    skipped; the posts around it run."""
    server = """
    location = /t { content_by_lua_block {
        local we = require "resty.loom.compat.worker_events"
        we.post("content_by_lua","request1","01234567890")
        assert(ngx.shared.worker_events:add("events-one:unique_value", 666))
        we.post("content_by_lua","request2","01234567890", "unique_value")
        we.post("content_by_lua","request3","01234567890")
        ngx.say("ok")
    } }
    """
    n = nginx(workers=1, http=conf(), server=server)
    settle(n, 1)
    assert n.get("/t").status == 200
    got = [re.search(r"event=(\w+)", l).group(1) for l in settle(n, 3)]
    assert got == ["started", "request1", "request3"]


REGISTER_LEVELS = """
    lua_shared_dict worker_events 1m;
    init_by_lua_block {
        require("resty.loom.events").new({
            socket = ngx.config.prefix() .. "sock/bus.sock" })
    }
    init_worker_by_lua_block {
        local we = require "resty.loom.compat.worker_events"
        local cb = function(extra, data, event, source, pid)
            ngx.log(ngx.NOTICE, "compat-handler: ", event, " ", data, " ",
                    extra, ";")
        end
        ngx.cb_global  = function(...) return cb("global", ...) end
        ngx.cb_source  = function(...) return cb("source", ...) end
        ngx.cb_event12 = function(...) return cb("event12", ...) end
        ngx.cb_event3  = function(...) return cb("event3", ...) end
        -- registered before configure(), as the peer's test does
        we.register(ngx.cb_global)
        we.register(ngx.cb_source,  "content_by_lua")
        we.register(ngx.cb_event12, "content_by_lua", "request1", "request2")
        we.register(ngx.cb_event3,  "content_by_lua", "request3")
        assert(we.configure{ interval = 0.1, shm = "worker_events" })
    }
    server {
        listen unix:$PREFIX/sock/bus.sock;
        location / { content_by_lua_block {
            require("resty.loom.events").get():serve() } }
    }
"""


def test_register_levels_and_unregister(nginx):
    """sanity.t 7: global, source and event handlers in that order; each
    unregister with the registration's arguments removes that level."""
    server = """
    location = /t { content_by_lua_block {
        local we = require "resty.loom.compat.worker_events"
        local function post(d)
            for i = 1, 3 do we.post("content_by_lua", "request" .. i, d) end
            ngx.sleep(0.2)
        end
        local r = {}
        post("123")
        r[1] = we.unregister(ngx.cb_global)
        post("124")
        r[2] = we.unregister(ngx.cb_source,  "content_by_lua")
        post("125")
        r[3] = we.unregister(ngx.cb_event12, "content_by_lua", "request1",
                             "request2")
        post("126")
        r[4] = we.unregister(ngx.cb_event3,  "content_by_lua", "request3")
        post("127")
        r[5] = we.unregister(ngx.cb_event3,  "content_by_lua", "request3")
        ngx.say(table.concat({tostring(r[1]), tostring(r[2]), tostring(r[3]),
                              tostring(r[4]), tostring(r[5])}, " "))
    } }
    """
    n = nginx(workers=1, http=REGISTER_LEVELS, server=server)
    settle(n, 1)
    assert n.get("/t").text == "true true true true false\n"
    expect = ["started nil global"]
    for d, tags in (("123", ["global", "source", "event"]),
                    ("124", ["source", "event"]), ("125", ["event"]),
                    ("126", ["event3"]), ("127", [])):
        for i in (1, 2, 3):
            for t in tags:
                if t == "event":
                    t = "event3" if i == 3 else "event12"
                if t == "event3" and i != 3:
                    continue
                expect.append("request%d %s %s" % (i, d, t))
    assert handler_lines(n) == expect


def test_weak_handlers_collected(nginx):
    """sanity.t 8: weak handlers at every level run until collected, then
    not at all."""
    server = """
    location = /t { content_by_lua_block {
        local we = require "resty.loom.compat.worker_events"
        ngx.sleep(0.1)
        local count = 0
        local cb = {
            global = function() count = count + 1 end,
            source = function() count = count + 1 end,
            event12 = function() count = count + 1 end,
            event3 = function() count = count + 1 end,
        }
        we.register_weak(cb.global)
        we.register_weak(cb.source,  "content_by_lua")
        we.register_weak(cb.event12, "content_by_lua", "request1", "request2")
        we.register_weak(cb.event3,  "content_by_lua", "request3")
        local function post()
            for i = 1, 3 do we.post("content_by_lua", "request" .. i, "1") end
            ngx.sleep(0.2)
        end
        post()
        ngx.say("before GC:", count)
        cb = nil
        collectgarbage()
        collectgarbage()
        count = 0
        post()
        ngx.say("after GC:", count)
    } }
    """
    n = nginx(workers=1, http=conf(register=False), server=server)
    assert n.get("/t").text == "before GC:9\nafter GC:0\n"


def test_callback_error_logged_with_stack_trace(nginx):
    """sanity.t 9-10: a failing handler is logged with the peer's line and
    a traceback through its nested calls; the next handler still runs."""
    server = """
    location = /t { content_by_lua_block {
        local we = require "resty.loom.compat.worker_events"
        local function error_func() error("something went wrong here!") end
        local function in_between() error_func() end
        we.register(function() in_between() end, "content_by_lua")
        we.register(require("compat_log").handler("after"), "content_by_lua")
        we.post("content_by_lua", "test_event")
        ngx.sleep(0.2)
        ngx.say("ok")
    } }
    """
    n = nginx(workers=1, http=conf(register=False), server=server)
    n.allow_log(r"event callback failed")
    assert n.get("/t").text == "ok\n"
    log = n.error_log()
    assert re.search(r"\[error\].*worker-events: event callback failed; "
                     r"source=content_by_lua, event=test_event, pid=\d+ "
                     r"error='.*something went wrong here!", log)
    assert "in function 'error_func'" in log
    assert "in function 'in_between'" in log
    assert len(handler_lines(n)) == 1


def test_shm_fragmentation_post_completes(nginx):
    """sanity.t 11: with the shm filled up, a 500 KiB post still
    succeeds (and is delivered)."""
    server = """
    location = /t { content_by_lua_block {
        local we = require "resty.loom.compat.worker_events"
        for i = 1, 1500000 do
            ngx.shared.worker_events:add(i, tostring(i))
        end
        local ok, err = we.post("source", "event", ("y"):rep(1024):rep(500))
        ngx.say(err == nil and "event posted")
    } }
    """
    n = nginx(workers=1, http=conf("shm_retries = 999"), server=server)
    r = n.request("GET", "/t", timeout=60)
    assert r.text == "event posted\n"
    got = settle(n, 2)
    assert got[-1].startswith("h source=source, event=event") and \
        got[-1].endswith("data=#512000")


CONFIGURE_CASES = [
    ("{}", '"shm" option required to start'),
    ('{ shm = "nope" }', 'shm "nope" not found'),
    ('{ shm = "worker_events", timeout = "1" }',
     'optional "timeout" option must be a number'),
    ('{ shm = "worker_events", timeout = 0 }',
     '"timeout" must be greater than 0'),
    ('{ shm = "worker_events", interval = "1" }',
     'optional "interval" option must be a number'),
    ('{ shm = "worker_events", interval = -1 }',
     '"interval" must be greater than or equal to 0'),
    ('{ shm = "worker_events", wait_interval = {} }',
     'optional "wait_interval" option must be a number'),
    ('{ shm = "worker_events", wait_interval = -0.1 }',
     '"wait_interval" must be greater than or equal to 0'),
    ('{ shm = "worker_events", wait_max = "x" }',
     'optional "wait_max" option must be a number'),
    ('{ shm = "worker_events", wait_max = -1 }',
     '"wait_max" must be greater than or equal to 0'),
    ('{ shm = "worker_events", shm_retries = "x" }',
     'optional "shm_retries" option must be a number'),
    ('{ shm = "worker_events", shm_retries = -1 }',
     '"shm_retries" must be 0 or greater'),
    # taken by the peer, refused here: a timeout of NaN or inf made the
    # first claim of a unique key last for ever
    ('{ shm = "worker_events", timeout = 0/0 }',
     '"timeout" must be greater than 0'),
    ('{ shm = "worker_events", timeout = 1/0 }',
     '"timeout" must be a finite number'),
    ('{ shm = "worker_events", interval = 0/0 }',
     '"interval" must be greater than or equal to 0'),
    ('{ shm = "worker_events", wait_max = 1/0 }',
     '"wait_max" must be a finite number'),
]


def test_configure_options_validated_like_the_peer(nginx):
    """events.lua configure(): each bad option returns nil and the peer's
    message and leaves the module unconfigured; then every option is
    accepted, a second configure() with shm is refused, without shm it
    applies."""
    cases = "\n".join(
        'ngx.say(select(2, we.configure(%s)), " ", tostring(we.configured()))'
        % c for c, _ in CONFIGURE_CASES)
    server = """
    location = /t { content_by_lua_block {
        local we = require "resty.loom.compat.worker_events"
        ngx.say(select(2, pcall(function() we.configure("x") end)))
        %s
        ngx.say(tostring(we.configure{ shm = "worker_events", interval = 0,
            timeout = 5, wait_interval = 0.01, wait_max = 0.5,
            shm_retries = 10, debug = true }))
        ngx.say(select(2, we.configure{ shm = "worker_events" }))
        ngx.say(tostring(we.configure{ timeout = 1 }))
    } }
    """ % cases
    http = """
    lua_shared_dict worker_events 1m;
    init_by_lua_block {
        require("resty.loom.events").new({
            socket = ngx.config.prefix() .. "sock/bus.sock" })
    }
    server {
        listen unix:$PREFIX/sock/bus.sock;
        location / { content_by_lua_block {
            require("resty.loom.events").get():serve() } }
    }
    """
    n = nginx(workers=1, http=http, server=server)
    lines = n.get("/t").text.splitlines()
    assert re.match(r"content_by_lua\(nginx.conf:\d+\):\d+: "
                    r"Expected a table, got string$", lines[0])
    assert lines[1:-3] == ["%s false" % m for _, m in CONFIGURE_CASES]
    assert lines[-3:] == ["true", "Already started, cannot change shm",
                          "true"]


def test_post_validation_returns_errors(nginx):
    """post()/post_local() return nil and the peer's message for a missing
    source or event; register/unregister raise for a non-function."""
    server = """
    location = /t { content_by_lua_block {
        local we = require "resty.loom.compat.worker_events"
        ngx.say(select(2, we.post("", "e")))
        ngx.say(select(2, we.post("s", nil)))
        ngx.say(select(2, we.post_local(nil, "e")))
        ngx.say(select(2, we.post_local("s", "")))
        ngx.say((select(2, pcall(function() we.register("x") end))
                 :gsub("^[^ ]+:%d+: ", "")))
        ngx.say((select(2, pcall(function() we.unregister(nil) end))
                 :gsub("^[^ ]+:%d+: ", "")))
        ngx.say(select("#", we.register(print)))
    } }
    """
    n = nginx(workers=1, http=conf(register=False), server=server)
    assert n.get("/t").text.splitlines() == [
        "source is required", "event is required", "source is required",
        "event is required", "expected function, got: string",
        "expected function, got: nil", "0"]


def test_kong_style_require_resty_worker_events_through_shim_path(nginx):
    """Code requiring `resty.worker.events` runs unchanged with
    lib/compat/ on package.path."""
    server = """
    location = /t { content_by_lua_block {
        local we = require "resty.worker.events"
        ngx.say(we.post("balancer", "targets", "t1"))
    } }
    """
    n = nginx(workers=2, http=conf(mapping=True), server=server)
    settle(n, 4)
    assert n.get("/t").text == "true\n"
    got = [l for l in settle(n, 6) if "balancer" in l]
    assert sorted(re.search(r"by=(\d)", l).group(1) for l in got) == \
        ["0", "1"]


def test_started_and_stopping_own_events(nginx):
    """sanity.t 1: the library's own events: "started" once per worker
    at configure(), "stopping" when a worker exits (here on QUIT); each
    reaches the global handlers of every live worker."""
    n = nginx(workers=2, http=conf(), server="")
    got = settle(n, 4)
    assert sorted(re.search(r"event=(\w+).*by=(\d)", l).groups()
                  for l in got) == [("started", "0"), ("started", "0"),
                                    ("started", "1"), ("started", "1")]
    n.quit()
    stopping = [l for l in handler_lines(n) if "event=stopping" in l]
    # each exiting worker runs its own handlers for its own stopping
    # event; the other worker's may come too late for it
    bys = {re.search(r"by=(\d)", l).group(1) for l in stopping}
    assert bys == {"0", "1"}, handler_lines(n)


def test_interval_zero_still_delivers_without_poll(nginx):
    """interval = 0 (the peer then handles events only in poll()) is
    accepted; events are pushed, so handlers run without poll()."""
    server = """
    location = /t { content_by_lua_block {
        local we = require "resty.loom.compat.worker_events"
        ngx.say(we.post("content_by_lua", "request1", "x"))
    } }
    """
    n = nginx(workers=2, http=conf("interval = 0"), server=server)
    settle(n, 4)
    assert n.get("/t").text == "true\n"
    got = [l for l in settle(n, 6) if "request1" in l]
    assert sorted(re.search(r"by=(\d)", l).group(1) for l in got) == \
        ["0", "1"]


def test_many_large_posts_complete_and_arrive(nginx):
    """sanity.t 11 carried further: 100 posts of 500 KiB in one request,
    the shm filled beforehand, all return true within the request and
    reach both workers' handlers."""
    server = """
    location = /t { content_by_lua_block {
        local we = require "resty.loom.compat.worker_events"
        for i = 1, 1500000 do
            ngx.shared.worker_events:add(i, tostring(i))
        end
        local payload = ("y"):rep(1024):rep(500)
        local ok = 0
        for i = 1, 100 do
            if we.post("big", "event", payload) then
                ok = ok + 1
            end
        end
        ngx.say(ok)
    } }
    """
    n = nginx(workers=2, http=conf(), server=server)
    settle(n, 4)
    assert n.request("GET", "/t", timeout=60).text == "100\n"
    deadline = time.time() + 30
    while time.time() < deadline:
        got = [l for l in handler_lines(n) if "source=big" in l]
        if len(got) >= 200:
            break
        time.sleep(0.2)
    assert sorted(re.search(r"by=(\d)", l).group(1) for l in got) == \
        ["0"] * 100 + ["1"] * 100
    assert all(l.endswith("data=#512000") for l in got)


def test_event_list_refuses_unknown_names(nginx):
    """README's event_list(): the names given and _source; any other name
    raises "event '<name>' is an unknown event" at the caller's line; the
    library's own list holds started and stopping."""
    server = r"""
    location = /t { content_by_lua_block {
        local we = require "resty.loom.compat.worker_events"
        local list = we.event_list("my-source", "created", "deleted")
        ngx.say(list._source, " ", list.created, " ", list.deleted)
        local ok, err = pcall(function() return list.udpated end)
        ngx.say(ok, " ", err)
        ngx.say(we.events._source, " ", we.events.started, " ",
                we.events.stopping)
    } }
    """
    n = nginx(workers=1, http=conf(register=False), server=server)
    lines = n.get("/t").text.splitlines()
    assert lines[0] == "my-source created deleted"
    assert re.match(r"false content_by_lua\(nginx\.conf:\d+\):\d+: "
                    r"event 'udpated' is an unknown event$", lines[1]), lines
    assert lines[2] == "resty-worker-events started stopping"


def test_callback_error_table_logged_as_json_with_traceback(nginx):
    """A handler raising a table: the peer's line shows it as JSON with the
    traceback (it was "table: 0x..." and no traceback)."""
    server = """
    location = /t { content_by_lua_block {
        local we = require "resty.loom.compat.worker_events"
        local function fails() error({ code = 7 }) end
        we.register(function() fails() end, "content_by_lua")
        we.post("content_by_lua", "table_error")
        ngx.sleep(0.2)
        ngx.say("ok")
    } }
    """
    n = nginx(workers=1, http=conf(register=False), server=server)
    n.allow_log(r"event callback failed")
    assert n.get("/t").text == "ok\n"
    line = n.wait_log(r"event callback failed; source=content_by_lua, "
                      r"event=table_error, pid=\d+ error='[^\n]*")[0]
    assert 'error=\'{"code":7}' in line, line
    assert "table: 0x" not in line
    assert "in function 'fails'" in n.error_log()


def test_unknown_option_warned_not_refused(nginx):
    """configure() takes an option the peer does not know, as the peer
    does, and warns naming it."""
    n = nginx(workers=1, http=conf("interval = 0.1, timout = 5"),
              server="")
    assert started().match(settle(n, 1)[0])
    n.wait_log(r"\[warn\][^\n]*\[loom\.compat\] resty\.worker\.events: "
               r"opts\.timout is not an option \(ignored\)")
