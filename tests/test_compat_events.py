"""resty.loom.compat.events against lua-resty-events 0.3.x's behaviour:
each test ports one case of the peer's own t/*.t (named in its docstring)
and checks what the peer's test checks, in handler-call order and
messages."""

import re
import socket
import time
import zlib

from loomtest.nginx import ROOT

LINE = re.compile(r"compat-handler: ([^;]*);")


def handler_lines(n):
    return LINE.findall(n.error_log())


def wait_lines(n, count, timeout=10):
    deadline = time.time() + timeout
    while True:
        got = handler_lines(n)
        if len(got) >= count or time.time() > deadline:
            return got
        time.sleep(0.05)


def conf(opts="", before_init="", after_init="", server=True,
         mapping=False):
    """The peer's test setup: new() in init_by_lua, init_worker() and a
    "*" "*" subscriber in init_worker_by_lua, the broker's unix server.
    mapping: load the module as `resty.events` through the shim dir."""
    module = "resty.loom.compat.events"
    path = ""
    if mapping:
        module = "resty.events"
        path = 'package.path = "%s/lib/compat/?.lua;" .. package.path' % ROOT
    http = """
    init_by_lua_block {
        %s
        _G.ev = require("%s").new({
            listening = "unix:$PREFIX/sock/ev.sock", %s })
    }
    init_worker_by_lua_block {
        local ev = _G.ev
        local log = require "compat_log"
        %s
        local ok, err = ev:init_worker()
        if not ok then
            ngx.log(ngx.ERR, "failed to init_worker events: ", err)
        end
        if ev:is_ready() then
            ngx.log(ngx.ERR, "ready in init_worker")
        end
        %s
    }
    """ % (path, module, opts, before_init, after_init)
    if server:
        http += """
    server {
        listen unix:$PREFIX/sock/ev.sock;
        location / { content_by_lua_block { _G.ev:run() } }
    }
    """
    return http


SUBSCRIBE = 'ev:subscribe("*", "*", log.handler("h"))'

PUBLISH_MIX = """
    location = /test { content_by_lua_block {
        local ev = _G.ev
        assert(ev:is_ready())
        ev:publish("all", "content_by_lua", "request1", "01234567890")
        ev:publish("current", "content_by_lua", "request2", "01234567890")
        ev:publish("all", "content_by_lua", "request3", "01234567890")
        ngx.say("ok")
    } }
"""


READY = """
    location = /ready { content_by_lua_block {
        ngx.say(tostring(_G.ev:is_ready())) } }
"""


def start(nginx, workers, http, server):
    """nginx with the peer's setup; returns once every worker answered
    is_ready() true a few times in a row."""
    n = nginx(workers=workers, http=http, server=server + READY)
    deadline = time.time() + 10
    streak = 0
    while streak < 4 * workers:
        assert time.time() < deadline, "not ready"
        streak = streak + 1 if n.get("/ready").text == "true\n" else 0
    return n


def test_not_ready_in_init_worker_ready_in_request(nginx):
    """events.t 1: is_ready() false right after init_worker(), true in a
    request; "current" handled first with wid nil, "all" with the
    publisher's id, in the peer's order."""
    n = start(nginx, 1, http=conf(after_init=SUBSCRIBE),
              server=PUBLISH_MIX)
    assert n.get("/test").text == "ok\n"
    assert wait_lines(n, 3) == [
        "h source=content_by_lua, event=request2, who=nil, by=0, "
        "data=01234567890",
        "h source=content_by_lua, event=request1, who=0, by=0, "
        "data=01234567890",
        "h source=content_by_lua, event=request3, who=0, by=0, "
        "data=01234567890",
    ]


def test_publish_before_init_worker_is_queued(nginx):
    """events.t 4: published before init_worker(), before the connection is
    up and before the subscriber exists: delivered once up, in order."""
    after = """
        ev:publish("current", "content_by_lua", "request2", "01234567890")
        ev:subscribe("*", "*", log.handler("h"))
        ev:publish("all", "content_by_lua", "request3", "01234567890")
    """
    before = 'ev:publish("all", "content_by_lua", "request1", "01234567890")'
    n = start(nginx, 1, http=conf(before_init=before, after_init=after),
              server="location = /test { return 200 'ok'; }")
    assert [l.split(",")[1] for l in wait_lines(n, 3)] == [
        " event=request2", " event=request1", " event=request3"]
    got = handler_lines(n)
    assert "who=nil" in got[0] and "who=0" in got[1] and "who=0" in got[2]


def test_unique_once_within_unique_timeout(nginx):
    """events.t 3: a unique target runs once within unique_timeout, again
    after it."""
    server = """
    location = /test { content_by_lua_block {
        local ev = _G.ev
        ev:publish("all", "content_by_lua", "request1", "01234567890")
        ev:publish("unique_value", "content_by_lua", "request2", "x")
        ev:publish("unique_value", "content_by_lua", "request3", "x")
        ngx.sleep(0.1) -- wait for unique timeout to expire
        ev:publish("unique_value", "content_by_lua", "request4", "x")
        ev:publish("unique_value", "content_by_lua", "request5", "x")
        ev:publish("all", "content_by_lua", "request6", "01234567890")
        ngx.say("ok")
    } }
    """
    n = start(nginx, 1, http=conf("unique_timeout = 0.04",
                                   after_init=SUBSCRIBE), server=server)
    assert n.get("/test").status == 200
    got = wait_lines(n, 4)
    time.sleep(0.3)
    # the peer's log, line by line (the unique events land on their
    # publisher, the only worker)
    assert handler_lines(n) == [
        "h source=content_by_lua, event=request%d, who=0, by=0, data=%s"
        % (i, d) for i, d in ((1, "01234567890"), (2, "x"), (4, "x"),
                              (6, "01234567890"))]


def test_unique_handled_exactly_once_across_workers(nginx):
    """broadcast.t 3: with 4 workers, "all" reaches each worker once, a
    unique target one worker once per unique_timeout, each worker's
    handlers in the peer's order. Published from worker 0, where
    "unique_value" lands (crc32 % 4), so that the unique events land on
    their publisher."""
    server = """
    location = /test { content_by_lua_block {
        local ev = _G.ev
        if ngx.worker.id() ~= 0 then
            return ngx.exit(409)
        end
        ev:publish("all", "content_by_lua", "request1", "01234567890")
        ev:publish("unique_value", "content_by_lua", "request2", "ABC")
        ev:publish("unique_value", "content_by_lua", "request3", "LMN")
        ngx.sleep(0.1) -- wait for unique timeout to expire
        ev:publish("unique_value", "content_by_lua", "request4", "WXY")
        ev:publish("unique_value", "content_by_lua", "request5", "HIJ")
        ev:publish("all", "content_by_lua", "request6", "STU")
        ngx.say("ok")
    } }
    """
    assert zlib.crc32(b"unique_value") % 4 == 0
    n = start(nginx, 4, http=conf("unique_timeout = 0.04, broker_id = 3",
                                   after_init=SUBSCRIBE), server=server)
    deadline = time.time() + 10
    while n.get("/test").status == 409:
        assert time.time() < deadline, "no request reached worker 0"
    wait_lines(n, 10)
    time.sleep(0.3)
    got = handler_lines(n)
    data = {1: "01234567890", 2: "ABC", 4: "WXY", 6: "STU"}
    for w in range(4):
        mine = [l for l in got if "by=%d," % w in l]
        assert mine == [
            "h source=content_by_lua, event=request%d, who=0, by=%d, "
            "data=%s" % (i, w, data[i])
            for i in ((1, 2, 4, 6) if w == 0 else (1, 6))], w


def test_broadcast_mix_of_current_and_all_across_workers(nginx):
    """broadcast.t 2: two "current" events run in the publisher with wid
    nil, then "all" in each of 4 workers with the publisher's wid."""
    server = """
    location = /test { content_by_lua_block {
        local ev = _G.ev
        ev:publish("current", "content_by_lua", "request1", "ABCDEFGHIJK")
        ev:publish("current", "content_by_lua", "request2", "LMNOPQRSTUV")
        ngx.sleep(0.05)
        ev:publish("all", "content_by_lua", "request3", "01234567890")
        ngx.say(ngx.worker.id())
    } }
    """
    n = start(nginx, 4, http=conf("broker_id = 3", after_init=SUBSCRIBE),
              server=server)
    r = n.get("/test")
    me = r.text.strip()
    got = wait_lines(n, 6)
    mine = [l for l in got if "by=%s," % me in l]
    assert mine[:3] == [
        "h source=content_by_lua, event=request1, who=nil, by=%s, "
        "data=ABCDEFGHIJK" % me,
        "h source=content_by_lua, event=request2, who=nil, by=%s, "
        "data=LMNOPQRSTUV" % me,
        "h source=content_by_lua, event=request3, who=%s, by=%s, "
        "data=01234567890" % (me, me),
    ]
    for w in "0123":
        assert ("h source=content_by_lua, event=request3, who=%s, by=%s, "
                "data=01234567890" % (me, w)) in got


def test_new_rejects_bad_options_like_the_peer(nginx):
    """events.t 5: new() raises, with the peer's text after `file:line: `,
    for each wrong option; NaN, infinities and a fractional broker_id
    (which the peer takes) are refused as well."""
    server = r"""
    location = /test { content_by_lua_block {
        local ev = require("resty.loom.compat.events")
        for _, opts in ipairs({
            {broker_id = "1"}, {broker_id = -1}, {broker_id = 2},
            {broker_id = 1}, {}, {listening = 123},
            {listening = "/tmp/xxx.sock"},
            {listening = "unix:x", unique_timeout = '1'},
            {listening = "unix:x", unique_timeout = -1},
            {listening = "unix:x", max_queue_len = "1"},
            {listening = "unix:x", max_queue_len = -1},
            {listening = "unix:x", max_payload_len = "1"},
            {listening = "unix:x", max_payload_len = -1},
            {listening = "unix:x", max_payload_len = 2^24 + 1},
            {listening = "unix:x", enable_privileged_agent = "invalid"},
            {listening = "unix:x", testing = "yes"},
            -- taken by the peer, refused here (NaN turned the bus's
            -- unique window off, inf suppressed a unique target forever)
            {broker_id = 0/0}, {broker_id = 0.5},
            {listening = "unix:x", unique_timeout = 0/0},
            {listening = "unix:x", unique_timeout = 1/0},
            {listening = "unix:x", max_queue_len = 0/0},
            {listening = "unix:x", max_queue_len = 1/0},
            {listening = "unix:x", max_payload_len = 0/0},
            -- the bus's own check, at the caller's line too
            {listening = "unix:x"},
        }) do
            local ok, err = pcall(function() ev.new(opts) end)
            assert(not ok)
            ngx.say(err)
        end
        local ok, err = pcall(function() ev.new("x") end)
        ngx.say(err)
    } }
    """
    n = nginx(workers=1, server=server)
    lines = n.get("/test").text.splitlines()
    prefix = re.compile(r"^content_by_lua\(nginx.conf:\d+\):\d+: ")
    assert all(prefix.match(l) for l in lines), lines
    assert [prefix.sub("", l) for l in lines] == [
        '"broker_id" option must be a number',
        '"broker_id" option is invalid',
        '"broker_id" option is invalid',
        '"broker_id" option is invalid',
        '"listening" option required to start',
        '"listening" option must be a string',
        '"listening" option must start with unix:',
        'optional "unique_timeout" option must be a number',
        '"unique_timeout" must be greater than 0',
        '"max_queue_len" option must be a number',
        '"max_queue_len" option is invalid',
        '"max_payload_len" option must be a number',
        '"max_payload_len" option is invalid',
        '"max_payload_len" option is invalid',
        '"enable_privileged_agent" option must be a boolean',
        '"testing" option must be a boolean',
        '"broker_id" option is invalid',
        '"broker_id" option is invalid',
        '"unique_timeout" must be greater than 0',
        '"unique_timeout" option must be a finite number',
        '"max_queue_len" option is invalid',
        '"max_queue_len" option must be a finite number',
        '"max_payload_len" option is invalid',
        "opts.socket must be an absolute path shorter than 108 bytes",
        'Expected a table, got string',
    ]


def test_publish_and_subscribe_raise_on_bad_arguments(nginx):
    """worker.lua's asserts: publish, subscribe and unsubscribe raise with
    the peer's messages."""
    server = r"""
    location = /test { content_by_lua_block {
        local ev = _G.ev
        for _, f in ipairs({
            function() ev:publish("", "s", "e") end,
            function() ev:publish("all", nil, "e") end,
            function() ev:publish("all", "s", "") end,
            function() ev:subscribe("", "e", print) end,
            function() ev:subscribe("s", nil, print) end,
            function() ev:subscribe("s", "e", "nope") end,
            function() ev:unsubscribe(1) end,
        }) do
            local ok, err = pcall(f)
            -- raised at the caller's line, as the peer's asserts
            ngx.say(ok, " ", (err:gsub("^content_by_lua%(nginx%.conf:%d+%):%d+: ", "")))
        end
    } }
    """
    n = start(nginx, 1, http=conf(), server=server)
    assert n.get("/test").text.splitlines() == [
        "false target is required", "false source is required",
        "false event is required", "false source is required",
        "false event is required", "false expected function, got: string",
        "false id is required"]


def test_payload_over_65535_bytes_with_max_payload_len(nginx):
    """events.t 6: max_payload_len = 2 MiB carries 64 KiB + 2, 640 KiB
    (unique) and 1 MiB."""
    server = """
    location = /test { content_by_lua_block {
        local ev = _G.ev
        ngx.say(require("compat_log").err(ev:publish("all", "content_by_lua", "request1",
                                     string.rep("a", 65537))))
        ngx.say(require("compat_log").err(ev:publish("unique_hash", "content_by_lua",
                                     "request2", string.rep("a", 10 * 65535))))
        ngx.say(require("compat_log").err(ev:publish("all", "content_by_lua", "request3",
                                     string.rep("a", 1024 * 1024))))
        ngx.say(require("compat_log").err(ev:publish("all", "content_by_lua", "request4",
                                     "01234567890")))
    } }
    """
    n = start(nginx, 1, http=conf("max_payload_len = 1024 * 1024 * 2",
                                   after_init=SUBSCRIBE), server=server)
    assert n.get("/test").text == "nil\nnil\nnil\nnil\n"
    got = [re.search(r"event=(\w+).*data=(\S+)", l).groups()
           for l in wait_lines(n, 4)]
    assert got == [
        ("request1", "#65537"), ("request2", "#655350"),
        ("request3", "#1048576"), ("request4", "01234567890")]


def test_default_max_payload_len_refuses_over_64_kib(nginx):
    """Kong's worker_events_max_payload: with the default (64 KiB) a 70 KiB
    payload fails with the peer's message; nothing is delivered."""
    server = """
    location = /test { content_by_lua_block {
        ngx.say(require("compat_log").err(_G.ev:publish("all", "s", "e",
                                        string.rep("a", 70 * 1024))))
    } }
    """
    n = start(nginx, 1, http=conf(after_init=SUBSCRIBE), server=server)
    assert n.get("/test").text == (
        "failed to publish event: payload exceeds the limitation (65536)\n")
    time.sleep(0.2)
    assert handler_lines(n) == []


def test_max_payload_len_customised(nginx):
    """events.t 7: max_payload_len = 200 refuses 200 bytes of data with
    "payload exceeds the limitation (200)" and carries small events."""
    server = """
    location = /test { content_by_lua_block {
        local ev = _G.ev
        ngx.say(require("compat_log").err(ev:publish("all", "content_by_lua", "request1",
                                     string.rep("a", 200))))
        ngx.say(require("compat_log").err(ev:publish("unique_hash", "content_by_lua",
                                     "request2", string.rep("a", 200))))
        ngx.say(require("compat_log").err(ev:publish("unique_hash", "content_by_lua",
                                     "request3", "01234567890")))
    } }
    """
    n = start(nginx, 1, http=conf("max_payload_len = 200",
                                   after_init=SUBSCRIBE), server=server)
    assert n.get("/test").text == (
        "failed to publish event: payload exceeds the limitation (200)\n"
        "failed to publish event: payload exceeds the limitation (200)\n"
        "nil\n")
    got = wait_lines(n, 1)
    time.sleep(0.2)
    assert handler_lines(n) == [
        "h source=content_by_lua, event=request3, who=0, by=0, "
        "data=01234567890"]


TESTING_SERVER = """
    location = /test { content_by_lua_block {
        local ev = _G.ev
        assert(ev:is_ready())
        ev:publish("all", "content_by_lua", "request1", "01234567890")
        ev:publish("current", "content_by_lua", "request2", "01234567890")
        ev:publish("unique_value", "content_by_lua", "request3", "x")
        ev:publish("unique_value", "content_by_lua", "request4", "x")
        ngx.say("ok")
    } }
"""


def test_testing_mode_runs_without_socket_synchronously(nginx):
    """listening-off.t 1-3: testing = true needs no `listen unix:` server;
    not ready in init_worker, ready in a request; every target runs
    synchronously in the publisher with wid nil, unique not suppressed."""
    n = start(nginx, 2, http=conf("testing = true", after_init=SUBSCRIBE,
                                   server=False), server=TESTING_SERVER)
    r = n.get("/test")
    assert r.text == "ok\n"
    got = handler_lines(n)
    assert [re.sub(r"by=\d", "by=W", l) for l in got] == [
        "h source=content_by_lua, event=request%d, who=nil, by=W, data=%s"
        % (i, d) for i, d in ((1, "01234567890"), (2, "01234567890"),
                              (3, "x"), (4, "x"))]


def test_testing_mode_publish_before_init_worker(nginx):
    """listening-off.t 4: in testing mode a publish before init_worker()
    runs the handlers at once."""
    before = """
        ev:subscribe("*", "*", log.handler("h"))
        ev:publish("all", "content_by_lua", "request1", "01234567890")
    """
    after = """
        ev:publish("current", "content_by_lua", "request2", "01234567890")
        ev:publish("all", "content_by_lua", "request3", "01234567890")
    """
    n = start(nginx, 1, http=conf("testing = true", before_init=before,
                                   after_init=after, server=False),
              server="location = /test { return 200 'ok'; }")
    assert [l.split(",")[1] for l in handler_lines(n)] == [
        " event=request1", " event=request2", " event=request3"]


def test_subscribe_levels_and_unsubscribe(nginx):
    """callback.t 1: global, then source, then event callbacks; each
    unsubscribe(id) removes exactly that subscription."""
    after = """
        local function cb(tag)
            return function(data, event, source)
                ngx.log(ngx.NOTICE, "compat-handler: ", event, " ", data,
                        " ", tag, ";")
            end
        end
        _G.ids = {
            ev:subscribe("*", "*", cb("global")),
            ev:subscribe("content_by_lua", "*", cb("source")),
            ev:subscribe("content_by_lua", "request1", cb("event12")),
            ev:subscribe("content_by_lua", "request2", cb("event12")),
            ev:subscribe("content_by_lua", "request3", cb("event3")),
        }
    """
    server = """
    location = /test { content_by_lua_block {
        local ev, ids = _G.ev, _G.ids
        local function post(d)
            for i = 1, 3 do
                ev:publish("all", "content_by_lua", "request" .. i, d)
            end
            ngx.sleep(0.1)
        end
        post("123")
        ev:unsubscribe(ids[1])
        post("124")
        ev:unsubscribe(ids[2])
        post("125")
        ev:unsubscribe(ids[3])
        ev:unsubscribe(ids[4])
        post("126")
        ev:unsubscribe(ids[5])
        post("127")
        ngx.say("ok")
    } }
    """
    n = start(nginx, 1, http=conf(after_init=after), server=server)
    assert n.get("/test").text == "ok\n"
    expect = []
    for d, tags in (("123", ["global", "source", "event"]),
                    ("124", ["source", "event"]), ("125", ["event"]),
                    ("126", ["event3only"]), ("127", [])):
        for i in (1, 2, 3):
            for t in tags:
                if t == "event":
                    t = "event3" if i == 3 else "event12"
                if t == "event3only":
                    if i != 3:
                        continue
                    t = "event3"
                expect.append("request%d %s %s" % (i, d, t))
    assert handler_lines(n) == expect


def test_callback_error_logged_with_stack_trace(nginx):
    """callback.t 2-3: a failing callback is logged with the peer's line
    and a traceback through the nested calls; the next callback runs."""
    after = """
        local function error_func() error("something went wrong here!") end
        local function in_between() error_func() end
        ev:subscribe("*", "*", function() in_between() end)
        ev:subscribe("*", "*", log.handler("after"))
    """
    server = """
    location = /test { content_by_lua_block {
        _G.ev:publish("all", "content_by_lua", "test_event")
        ngx.say("ok")
    } }
    """
    n = start(nginx, 1, http=conf(after_init=after), server=server)
    n.allow_log(r"event callback failed")
    assert n.get("/test").status == 200
    wait_lines(n, 1)
    log = n.error_log()
    assert re.search(r"\[error\].*worker-events: event callback failed; "
                     r"source=content_by_lua, event=test_event, wid=0 "
                     r"error='.*something went wrong here!", log)
    assert "in function 'error_func'" in log
    assert "in function 'in_between'" in log
    assert handler_lines(n) == [
        "after source=content_by_lua, event=test_event, who=0, by=0, "
        "data=nil"]


def _unix_get(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    s.connect(path)
    s.sendall(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
    data = b""
    while True:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    s.close()
    return data.decode()


def test_disable_listening_helper(nginx):
    """disable-listening.t 2-3: workers but #1 call disable_listening, so
    only worker 1 accepts on the socket; a name with no listener fails
    with "failed to disable listening: <name>"."""
    http = """
    init_worker_by_lua_block {
        if ngx.worker.id() ~= 1 then
            assert(require("resty.loom.compat.disable_listening")(
                "unix:$PREFIX/u.sock"))
        end
    }
    server {
        listen unix:$PREFIX/u.sock;
        location / { content_by_lua_block {
            ngx.say("unix ok #", ngx.worker.id()) } }
    }
    """
    server = """
    location = /test { content_by_lua_block {
        local disable = require("resty.loom.compat.disable_listening")
        ngx.say(require("compat_log").err(disable("unix:")))
        ngx.say(require("compat_log").err(disable("unix:/tmp/xxx.sock")))
    } }
    """
    n = nginx(workers=3, http=http, server=server)
    assert n.get("/test").text == (
        "failed to disable listening: unix:\n"
        "failed to disable listening: unix:/tmp/xxx.sock\n")
    answers = {_unix_get(n.prefix + "/u.sock").splitlines()[-1]
               for _ in range(30)}
    assert answers == {"unix ok #1"}


def test_slow_client_on_startup_gets_earlier_events(nginx):
    """slow-client-on-startup.t: worker 1 disables listening and calls
    init_worker() 2 s late; an event published before still reaches it."""
    before = """
        local id = ngx.worker.id()
        local function initialize()
            assert(ev:init_worker())
            ev:subscribe("content_by_lua", "first", log.handler("first"))
        end
        if id == 1 then
            assert(require("resty.loom.compat.disable_listening")(
                ev.opts.listening))
            ngx.timer.at(2, initialize)
            return
        end
        initialize()
        do return end
    """
    server = """
    location = /test { content_by_lua_block {
        if ngx.worker.id() ~= 1 then
            _G.ev:publish("all", "content_by_lua", "first")
        end
        ngx.say(ngx.worker.id())
    } }
    """
    n = nginx(workers=3, http=conf("broker_id = 2", before_init=before),
              server=server)
    deadline = time.time() + 5
    while n.get("/test").text.strip() == "1":
        assert time.time() < deadline
    got = wait_lines(n, 3, timeout=10)
    time.sleep(0.2)
    assert sorted(re.search(r"by=(\d)", l).group(1)
                  for l in handler_lines(n)) == ["0", "1", "2"]


KONG_STYLE = """
    init_by_lua_block {
        package.path = "%s/lib/compat/?.lua;" .. package.path
        -- a module as Kong's code base writes it, untouched
        package.preload["kong_style"] = function()
            local events = require "resty.events"
            local disable = require "resty.events.disable_listening"
            assert(type(disable) == "function")
            local _M = {}
            function _M.init()
                _M.ev = events.new({
                    listening = "unix:" .. ngx.config.prefix() ..
                                "sock/we",
                    unique_timeout = 5, broker_id = 0,
                    max_queue_len = 1024 * 50, max_payload_len = 65535,
                })
            end
            function _M.init_worker()
                assert(_M.ev:init_worker())
                _M.ev:subscribe("mlcache", "*", function(data, event,
                                                         source, wid)
                    ngx.log(ngx.NOTICE, "compat-handler: ", event, " ",
                            data, " by ", ngx.worker.id(), ";")
                end)
            end
            return _M
        end
        require("kong_style").init()
    }
    init_worker_by_lua_block { require("kong_style").init_worker() }
    server {
        listen unix:$PREFIX/sock/we;
        location / { content_by_lua_block {
            require("kong_style").ev:run() } }
    }
""" % ROOT


def test_kong_style_require_resty_events_through_shim_path(nginx):
    """A module requiring `resty.events` and
    `resty.events.disable_listening` runs unchanged with lib/compat/ on
    package.path."""
    server = """
    location = /test { content_by_lua_block {
        local ev = require("kong_style").ev
        ngx.say(ev:publish("all", "mlcache", "purge", "k1"))
    } }
    """
    n = nginx(workers=2, http=KONG_STYLE, server=server)
    assert n.get("/test").text == "true\n"
    got = wait_lines(n, 2)
    assert sorted(got) == ["purge k1 by 0", "purge k1 by 1"]


KONG_COMPAT = """
    init_by_lua_block {
        package.path = "%s/lib/compat/?.lua;" .. package.path
    }
    init_worker_by_lua_block {
        -- as Kong's kong/global.lua init_worker_events() does
        local we = require "resty.events.compat"
        local ok, err = we.configure({
            unique_timeout = 0.04, broker_id = 0,
            -- (Kong creates its sockets directory before nginx starts;
            -- logs/ exists here)
            listening = "unix:" .. ngx.config.prefix() .. "logs/we",
            max_queue_len = 1024 * 50, max_payload_len = 65535,
            enable_privileged_agent = false,
        })
        if not ok then
            ngx.log(ngx.ERR, "failed to configure events: ", err)
        end
        assert(we.configured())
        we.register(require("compat_log").handler("h"))
        local gone = require("compat_log").handler("gone")
        we.register(gone, "content_by_lua", "request1", "request3")
        we.register(gone, "other")
        we.unregister(gone)
    }
    server {
        listen unix:$PREFIX/logs/we;
        location / { content_by_lua_block {
            require("resty.events.compat").run() } }
    }
""" % ROOT


def test_resty_events_compat_post_order_and_unique(nginx):
    """events-compat.t 1-3 through `require "resty.events.compat"`: post
    and post_local return "done"; the local event runs first with wid nil;
    a unique post runs once per unique_timeout; unregister(cb) removes
    every subscription of cb."""
    server = """
    location = /test { content_by_lua_block {
        local we = require "resty.events.compat"
        local r = {}
        r[1] = we.post("content_by_lua", "request1", "01234567890")
        r[2] = we.post_local("content_by_lua", "request2", "01234567890")
        r[3] = we.post("content_by_lua", "request3", "01234567890")
        ngx.sleep(0.1)
        r[4] = we.post("content_by_lua", "request4", "x", "unique_value")
        r[5] = we.post("content_by_lua", "request5", "x", "unique_value")
        ngx.sleep(0.1) -- wait for unique timeout to expire
        r[6] = we.post("content_by_lua", "request6", "x", "unique_value")
        r[7] = we.poll()
        ngx.say(table.concat(r, " "))
    } }
    """
    n = nginx(workers=1, http=KONG_COMPAT, server=server)
    assert n.get("/test").text == "done done done done done done done\n"
    time.sleep(0.3)
    assert handler_lines(n) == [
        "h source=content_by_lua, event=request2, who=nil, by=0, "
        "data=01234567890",
        "h source=content_by_lua, event=request1, who=0, by=0, "
        "data=01234567890",
        "h source=content_by_lua, event=request3, who=0, by=0, "
        "data=01234567890",
        "h source=content_by_lua, event=request4, who=0, by=0, data=x",
        "h source=content_by_lua, event=request6, who=0, by=0, data=x",
    ]


def test_long_unique_target_suppressed_like_a_short_one(nginx):
    """A unique target longer than the bus's key limit (1 KiB) is taken
    as the peer takes any string: once per unique_timeout."""
    server = """
    location = /test { content_by_lua_block {
        local key = string.rep("k", 2000)
        for i = 1, 3 do
            assert(_G.ev:publish(key, "s", "long" .. i, "x"))
        end
        ngx.say("ok")
    } }
    """
    n = start(nginx, 2, http=conf(after_init=SUBSCRIBE), server=server)
    assert n.get("/test").text == "ok\n"
    wait_lines(n, 1)
    time.sleep(0.3)
    assert [re.search(r"event=(\w+)", l).group(1)
            for l in handler_lines(n)] == ["long1"]


def test_enable_privileged_agent_accepted_on_stock_nginx(nginx):
    """enable_privileged_agent = true (Kong's dedicated config processing)
    starts on stock nginx, which has no agent, and delivers to the
    workers."""
    server = """
    location = /test { content_by_lua_block {
        ngx.say(_G.ev:publish("all", "s", "e", "x"))
    } }
    """
    n = start(nginx, 2, http=conf("enable_privileged_agent = true",
                                  after_init=SUBSCRIBE), server=server)
    assert n.get("/test").text == "true\n"
    assert sorted(re.search(r"by=(\d)", l).group(1)
                  for l in wait_lines(n, 2)) == ["0", "1"]


def test_publish_before_init_worker_bounded_by_max_queue_len(nginx):
    """Before init_worker() the peer's publisher queue holds
    max_queue_len events, then "queue overflow"; init_worker() twice is
    harmless and the queued events arrive once."""
    before = """
        for i = 1, 3 do
            local ok, err = ev:publish("all", "s", "early" .. i, "x")
            if not ok then
                ngx.log(ngx.NOTICE, "compat-handler: refused ", i, " ",
                        err, ";")
            end
        end
    """
    after = """
        assert(ev:init_worker())
        ev:subscribe("*", "*", log.handler("h"))
    """
    n = nginx(workers=1, http=conf("max_queue_len = 2", before_init=before,
                                   after_init=after),
              server="location = /test { return 200 'ok'; }")
    got = wait_lines(n, 3)
    time.sleep(0.3)
    assert handler_lines(n) == [
        "refused 3 failed to publish event: queue overflow",
        "h source=s, event=early1, who=0, by=0, data=x",
        "h source=s, event=early2, who=0, by=0, data=x"]


def test_resty_events_compat_poll_before_configure(nginx):
    """events-compat: poll() answers "done" before configure(), as the
    peer's does (it raised "attempt to index a nil value")."""
    server = """
    location = /test { content_by_lua_block {
        ngx.say(require("resty.loom.compat.events_compat").poll())
    } }
    """
    n = nginx(workers=1, server=server)
    assert n.get("/test").text == "done\n"


def test_broker_killed_while_handlers_sleep_no_deadlock(nginx):
    """deadlock.t: handlers in workers 0 and 1 hold a semaphore across a
    sleep when the broker is killed (-9, by worker 2's handler; the peer
    uses the privileged agent); they are not cut short: the next event's
    handlers get the semaphore, none logs [crit]."""
    after = """
        local id = ngx.worker.id()
        local sema = require("ngx.semaphore").new(1)
        if id == 3 then
            ngx.shared.pids:set("broker", ngx.worker.pid())
        end
        local function take(what)
            return function()
                ngx.sleep(0)
                ngx.log(ngx.NOTICE, "compat-handler: ", id, " ", what,
                        " handler;")
                local ok, err = sema:wait(0)
                if not ok then
                    ngx.log(ngx.CRIT, id, " ", what,
                            " did not get the semaphore: ", err)
                    return
                end
                ngx.log(ngx.NOTICE, "compat-handler: ", id, " ", what,
                        " got the semaphore;")
                if what == "first" then
                    ngx.sleep(2)
                end
                sema:post()
            end
        end
        if id == 0 or id == 1 then
            ev:subscribe("content_by_lua", "first", take("first"))
            ev:subscribe("content_by_lua", "third", take("third"))
        end
        if id == 2 then
            ev:subscribe("content_by_lua", "second", function()
                ngx.log(ngx.NOTICE, "compat-handler: killer;")
                ngx.timer.at(0, function()
                    os.execute("kill -9 " .. ngx.shared.pids:get("broker"))
                end)
            end)
        end
    """
    server = """
    location = /test { content_by_lua_block {
        local ev = _G.ev
        for _, e in ipairs({ "first", "second", "third" }) do
            assert(ev:publish("all", "content_by_lua", e))
            ngx.sleep(0)
        end
        ngx.say("ok")
    } }
    """
    n = start(nginx, 4, http="lua_shared_dict pids 1m;\n" +
              conf("broker_id = 3", after_init=after), server=server)
    n.allow_log(r"exited on signal 9")
    # nginx's own line for the killed broker's connections
    n.allow_log(r"\((104: Connection reset by peer|32: Broken pipe)\)")
    assert n.get("/test").text == "ok\n"
    n.wait_log(r"exited on signal 9", timeout=10)
    wait_lines(n, 9, timeout=15)
    time.sleep(0.5)
    got = handler_lines(n)
    # each handler once: nothing lost or run twice across the broker's end
    assert sorted(got) == sorted(
        ["%s %s" % (w, what) for w in "01" for what in (
            "first handler", "first got the semaphore", "third handler",
            "third got the semaphore")] + ["killer"]), got
    assert "[crit]" not in n.error_log()


def test_unknown_option_warned_not_refused(nginx):
    """The peer ignores an unknown option; so does new() (code written for
    it still starts), with a warning naming it, so that a misspelt one is
    seen."""
    n = start(nginx, 1, http=conf("unique_timout = 1", after_init=SUBSCRIBE),
              server="""
    location = /test { content_by_lua_block {
        ngx.say(_G.ev:publish("all", "s", "e", "x")) } }
    """)
    assert n.get("/test").text == "true\n"
    assert wait_lines(n, 1) == [
        "h source=s, event=e, who=0, by=0, data=x"]
    n.wait_log(r"\[warn\][^\n]*\[loom\.compat\] resty\.events: "
               r"opts\.unique_timout is not an option \(ignored\)")
