"""Delivery by target, ordering, payload size limits."""

import time
import zlib

import pytest

import eventsconf as ec


def start(nginx, workers=4, opts="", **kw):
    n = nginx(workers=workers, http=ec.http(opts), server=ec.SERVER, **kw)
    ec.wait_ready(n)
    return n


def test_own_events_in_publish_order(nginx):
    """A worker's own copies of its "all" events and its events to itself
    skip the broker: its handlers still see them in the order published,
    also when the writer sends the queue in several writes."""
    n = start(nginx)
    r = n.get("/ev/pub?target=mixself&n=3000&source=trace&size=200").json()
    assert r["ok"] == 3000
    pub = r["worker"]
    deadline = time.time() + 15
    while True:
        st = ec.states(n)
        want = {w: (3000 if w == pub else 1500) for w in st}
        if all(len(s["trace"]) == want[w] for w, s in st.items()):
            break
        assert time.time() < deadline, {w: len(s["trace"])
                                        for w, s in st.items()}
        time.sleep(0.05)
    assert st[pub]["trace"] == list(range(1, 3001))
    for w, s in st.items():
        if w != pub:
            assert s["trace"] == list(range(1, 3001, 2))
    # nothing of it came back through the broker to the publisher
    assert st[pub]["stats"]["duplicates"] == 0


def test_own_unique_events_in_publish_order(nginx):
    """A unique event that lands on its publisher comes in publish order
    with the publisher's own copies of its "all" events and its events to
    itself (the broker only says whether to run it), on the broker worker
    (linked in-process) and on a worker with a socket; a suppressed one
    does not run. Before: the later own copies overtook it."""
    n = start(nginx)
    want = {w: [] for w in range(4)}
    for pub, first in ((0, 1), (2, 2001)):
        r = pub_from(n, pub, "target=mixunique&n=2000&source=trace"
                     "&start=%d" % first)
        assert r["ok"] == 2000 and r["worker"] == pub
        for w in want:
            want[w] += [i for i in range(first, first + 2000)
                        if i % 4 == 1 or (w == pub and i % 4 in (0, 2))]
        deadline = time.time() + 15
        while True:
            st = ec.states(n)
            if all(len(s["trace"]) >= len(want[w]) for w, s in st.items()):
                break
            assert time.time() < deadline, {w: len(s["trace"])
                                            for w, s in st.items()}
            time.sleep(0.05)
        time.sleep(0.2)
        st = ec.states(n)
        for w, s in st.items():
            assert s["trace"] == want[w], w
    b = st[0]["stats"]["broker"]
    assert b["unique_suppressed"] == 1000, b
    for s in st.values():
        assert s["stats"]["gaps"] == 0 and s["stats"]["duplicates"] == 0


def test_all_others_current_worker(nginx):
    n = start(nginx)
    r = n.get("/ev/pub?target=all&n=100&source=a").json()
    assert r["ok"] == 100
    pub = r["worker"]
    ec.wait_totals(n, {w: 100 for w in range(4)})

    r = n.get("/ev/pub?target=others&n=50&source=o").json()
    pub = r["worker"]
    expect = {w: (100 if w == pub else 150) for w in range(4)}
    st = ec.wait_totals(n, expect)
    assert all(s["order_errors"] == 0 for s in st.values())

    r = n.get("/ev/pub?target=2&n=30&source=d").json()
    expect[2] += 30
    ec.wait_totals(n, expect)

    r = n.get("/ev/pub?target=current&n=7&source=c").json()
    expect[r["worker"]] += 7
    st = ec.wait_totals(n, expect)
    for s in st.values():
        assert s["order_errors"] == 0
        assert s["stats"]["gaps"] == 0
        assert s["stats"]["duplicates"] == 0


def test_unique_delivered_once(nginx):
    n = start(nginx)
    # the same unique key from many requests (landing on any worker)
    for _ in range(20):
        assert n.get("/ev/pub?target=unique:k1&n=1&source=u").json()["ok"]
    st = ec.wait_totals(n, {})
    import time
    time.sleep(0.5)
    st = ec.states(n)
    assert sum(s["total"] for s in st.values()) == 1
    # different keys are each delivered once
    for i in range(10):
        n.get("/ev/pub?target=unique:key%d&n=1&source=u" % i)
    time.sleep(0.5)
    st = ec.states(n)
    assert sum(s["total"] for s in st.values()) == 11


def test_payload_16mib_and_too_large(nginx):
    n = start(nginx, workers=2, opts="max_payload = 20 * 1024 * 1024,"
              " max_queue_bytes = 128 * 1024 * 1024")
    size = 16 * 1024 * 1024
    r = n.get("/ev/pub?target=all&n=1&size=%d" % size, timeout=30).json()
    assert r["ok"] == 1
    st = ec.wait_totals(n, {0: 1, 1: 1}, timeout=30)
    for s in st.values():
        assert s["sizes"] == [size]
    r = n.get("/ev/pub?target=all&n=1&size=%d" % (21 * 1024 * 1024),
              timeout=30).json()
    assert r["ok"] == 0 and r["errors"] == {"payload too large": 1}


def connected_to(path):
    """Connections the listener at path accepted (the kernel's list)."""
    count = 0
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            cols = line.split()
            # Num RefCount Protocol Flags Type St Inode Path; St 03: connected
            if len(cols) == 8 and cols[7] == path and cols[5] == "03":
                count += 1
    return count


def pub_from(n, wid, query, within=30):
    """Publishes from worker wid: asks until a request lands there (a
    worker busy with the megabytes published just before takes no new
    connections for a while on a loaded machine: a deadline, not a count)"""
    deadline = time.time() + within
    while time.time() < deadline:
        r = n.get("/ev/pub?only=%d&%s" % (wid, query), timeout=30)
        if r.status != 409:
            return r.json()
    raise AssertionError("no request reached worker %d in %d s"
                         % (wid, within))


def test_broker_worker_link(nginx):
    """The broker worker reaches the broker in its own process, with no
    socket: its events, chunked ones and unique ones included, reach every
    worker in order, and other workers' events reach it the same way."""
    n = start(nginx, opts="max_payload = 4 * 1024 * 1024")
    expect = {w: 0 for w in range(4)}
    for wid, source in ((0, "b0"), (1, "b1")):
        r = pub_from(n, wid, "target=all&n=2000&source=" + source)
        assert r["ok"] == 2000 and r["worker"] == wid
        for w in expect:
            expect[w] += 2000
    big = 3 * 1024 * 1024          # 12 chunks on the wire
    for wid in (0, 2):
        r = pub_from(n, wid, "target=all&n=1&source=big&size=%d" % big)
        assert r["ok"] == 1
        for w in expect:
            expect[w] += 1
    # a unique key that lands on the broker worker, published there
    key = next("k%d" % i for i in range(100)
               if zlib.crc32(b"k%d" % i) % 4 == 0)
    assert pub_from(n, 0, "target=unique:%s&source=u" % key)["ok"] == 1
    # to the broker worker by id: from itself, and from another worker
    assert pub_from(n, 0, "target=0&n=5&source=self")["ok"] == 5
    assert pub_from(n, 3, "target=0&n=7&source=to0")["ok"] == 7
    expect[0] += 1 + 5 + 7
    st = ec.wait_totals(n, expect, timeout=30)
    for w, s in st.items():
        assert s["sizes"] == [big, big], w
        assert s["order_errors"] == 0, w
        assert s["stats"]["gaps"] == 0 and s["stats"]["duplicates"] == 0
        assert s["stats"]["reconnects"] == 0
    b = st[0]["stats"]["broker"]
    # three sockets and the broker worker's own link
    assert b["connections"] == 4 and b["accepted"] == 4, b
    # (each of the three with its lane for collect)
    assert connected_to(n.prefix + "/sock/bus.sock") == 3 * 2
    assert all(q["connected"] for q in b["queues"].values()), b
    assert st[0]["stats"]["queue"]["unacked"] == 0


def test_handler_error_logged_with_site_and_delivery_goes_on(nginx):
    n = nginx(workers=2, http=ec.http(extra_worker="""
        local bus = require("resty.loom.events").get()
        bus:subscribe("test", "e", function(data)
            if data.n %% 2 == 0 then error("even numbers hurt") end
        end)
    """.replace("%%", "%")), server=ec.SERVER)
    n.allow_log(r"even numbers hurt")
    ec.wait_ready(n)
    r = n.get("/ev/pub?target=all&n=10").json()
    assert r["ok"] == 10
    st = ec.wait_totals(n, {0: 10, 1: 10})
    for s in st.values():
        assert s["stats"]["handler_errors"] == 5
    lines = [x for x in n.error_log().splitlines() if "even numbers" in x]
    assert len(lines) == 10
    # the traceback and where the handler was subscribed
    assert all("subscribed at init_worker_by_lua" in x for x in lines)
    assert "stack traceback" in n.error_log()


def test_handler_error_table_logged_as_json_with_traceback(nginx):
    # error({...}) in a handler: the log shows the table, not "table: 0x"
    n = nginx(workers=2, http=ec.http(extra_worker="""
        local bus = require("resty.loom.events").get()
        bus:subscribe("test", "e", function(data)
            error({ code = 42, why = "tabled" })
        end)
    """), server=ec.SERVER)
    n.allow_log(r"tabled")
    ec.wait_ready(n)
    assert n.get("/ev/pub?target=all&n=2").json()["ok"] == 2
    n.wait_log(r"tabled", count=4)
    lines = [x for x in n.error_log().splitlines() if "tabled" in x]
    assert len(lines) == 4
    assert all('"why":"tabled"' in x and '"code":42' in x for x in lines)
    assert "table: 0x" not in n.error_log()
    assert "stack traceback" in n.error_log()


def test_latency_and_stats_shape(nginx):
    n = start(nginx, workers=2)
    n.get("/ev/pub?target=all&n=200")
    st = ec.wait_totals(n, {0: 200, 1: 200})
    for s in st.values():
        lat = s["stats"]["latency"]
        # sampled: at least every 8th event
        assert 25 <= lat["count"] <= 200
        assert 0 < lat["p50"] <= lat["p99"] <= lat["max"] < 5
    pub = [s for s in st.values() if s["stats"]["published"]]
    assert sum(s["stats"]["published"]["all"] for s in pub) >= 200


def test_privileged_agent_target(nginx):
    import pytest
    n = nginx(start=False, workers=2, http=ec.http(
        "privileged_agent = true",
        extra_init='assert(require("ngx.process")'
                   '.enable_privileged_agent())'),
        server=ec.SERVER)
    # an nginx whose default error log is <prefix>/logs/error.log (nginx's
    # and OpenResty's default; Debian's is stderr) writes the failed
    # init_by_lua there
    n.allow_log(r"missing privileged agent process patch")
    try:
        n.start()
    except RuntimeError as e:
        if "missing privileged agent process patch" in str(e):
            pytest.skip("this nginx lacks OpenResty's privileged agent "
                        "patch (Debian's nginx does)")
        raise
    deadline = __import__("time").time() + 10
    while True:
        r = n.get("/ev/collect")
        if r.status == 200 and len(r.json()) == 3 and \
                all(v["ready"] for v in r.json().values()):
            break
        assert __import__("time").time() < deadline, r.text
    r = n.get("/ev/pub?target=agent&n=3&source=ag").json()
    assert r["ok"] == 3
    r = n.get("/ev/pub?target=all&n=2&source=al").json()
    deadline = __import__("time").time() + 10
    while True:
        got = n.get("/ev/collect").json()
        if got["-1"]["total"] == 5 or __import__("time").time() > deadline:
            break
    assert got["-1"]["total"] == 5
    assert got["0"]["total"] == 2 and got["1"]["total"] == 2


def test_publish_from_every_phase(nginx):
    pub = 'require("resty.loom.events").get():publish("all", "phase", "%s",' \
          ' { n = 1 })'
    server = ec.SERVER + """
    location /phases {
        set_by_lua_block $x { %s return "1" }
        rewrite_by_lua_block { %s }
        access_by_lua_block { %s }
        content_by_lua_block {
            %s
            ngx.timer.at(0, function() %s end)
            ngx.say("ok")
        }
        header_filter_by_lua_block { %s }
        body_filter_by_lua_block { if ngx.arg[2] then %s end }
        log_by_lua_block { %s }
    }
    """ % tuple(pub % p for p in ("set", "rewrite", "access", "content",
                                  "timer", "header_filter", "body_filter",
                                  "log"))
    n = nginx(workers=2, http=ec.http(), server=server)
    ec.wait_ready(n)
    assert n.get("/phases").text.strip() == "ok"
    st = ec.wait_totals(n, {0: 8, 1: 8})
    for s in st.values():
        assert sorted(k.split(":")[2] for k in s["received"]) == sorted(
            ["set", "rewrite", "access", "content", "timer",
             "header_filter", "body_filter", "log"])


VALIDATION = """
    init_by_lua_block {
        local events = require "resty.loom.events"
        local cases = {
            { socket = 1 },
            { socket = "relative/path.sock" },
            { socket = "/tmp/" .. string.rep("x", 120) },
            { socket = "/tmp/x.sock", broker = -1 },
            { socket = "/tmp/x.sock", max_queue = 0 },
            { socket = "/tmp/x.sock", max_payload = 100 * 1024 * 1024 },
            { socket = "/tmp/x.sock", overflow = "explode" },
            { socket = "/tmp/x.sock", privileged_agent = "yes" },
            { socket = "/tmp/x.sock", heartbeat = 0 },
            { socket = "/tmp/x.sock", wait_timeout = 0.0005 },
            { socket = "/tmp/x.sock", max_payload = 65536,
              max_queue_bytes = 66560 },
            { socket = "/tmp/x.sock", bogus = 1 },
            "not a table",
            { socket = "/tmp/x.sock", max_backlog = 0 },
            { socket = "/tmp/x.sock", max_backlog = 1.5 },
            { socket = "/tmp/x.sock", max_queue = 1e300 },
            { socket = "/tmp/x.sock", heartbeat = 0/0 },
            { socket = "/tmp/x.sock", exit_timeout = math.huge },
            { socket = "/tmp/x.sock", unique_window = 1e308 },
            { heartbeat = 1 },
            { socket = "/tmp/x.sock", heartbeat = 1, slow_timeout = 3 },
            { socket = "/tmp/x.sock", broker = 1024 },
            { socket = "/tmp/x.sock", ring_bytes = 4096 },
            { socket = "/tmp/x.sock", ring_bytes = 1048577 },
            { socket = "/tmp/x.sock", ring_bytes = 0/0 },
            { socket = "/tmp/x.sock", ring_bytes = "4m" },
            { socket = ngx.config.prefix() .. "sock/bus.sock",
              slow_timeout = false, max_backlog = false },
        }
        local errs = {}
        for i, opts in ipairs(cases) do
            local ok, err = pcall(events.new, opts)
            errs[i] = ok and "accepted" or err
        end
        package.loaded.validation_errors = errs
        require("events_helper").init()
    }
    init_worker_by_lua_block { require("events_helper").init_worker() }
    server {
        listen unix:$PREFIX/sock/bus.sock;
        lua_socket_buffer_size 64k;
        location / { content_by_lua_block {
            require("resty.loom.events").get():serve() } }
    }
"""


def test_option_validation_and_unsubscribe(nginx):
    n = nginx(workers=1, http=VALIDATION, server=ec.SERVER + """
        location /errs { content_by_lua_block {
            ngx.say(table.concat(package.loaded.validation_errors, "\\n"))
        } }
        location /unsub { content_by_lua_block {
            local bus = require("resty.loom.events").get()
            local calls = 0
            local id = bus:subscribe("u", "*", function() calls = calls + 1 end)
            bus:publish("current", "u", "x")
            ngx.sleep(0.1)
            assert(bus:unsubscribe(id))
            assert(not bus:unsubscribe(id))
            bus:publish("current", "u", "x")
            ngx.sleep(0.1)
            local ok, err = pcall(bus.publish, bus, "nowhere", "u", "x")
            ngx.say(calls, " ", err)
        } }
    """)
    errs = n.get("/errs").text.strip().split("\n")
    expect = ["opts.socket must be an absolute path shorter than 108 bytes",
              "opts.socket must be an absolute path",
              "opts.socket must be an absolute path",
              "opts.broker must be a whole number from 0 to 1023",
              "opts.max_queue must be a whole number from 1 to 100000000",
              "opts.max_payload must be a whole number from 1 to 67108864",
              'opts.overflow must be "reject", "drop_oldest" or "wait"',
              "opts.privileged_agent must be a boolean",
              "opts.heartbeat must be a number from 0.01 to 86400",
              "opts.wait_timeout must be a number from 0.001 to 86400",
              "opts.max_queue_bytes must be at least opts.max_payload + 8192",
              "opts.bogus is not an option",
              "opts must be a table",
              "opts.max_backlog must be a whole number from 1 to 100000000, "
              "or false",
              "opts.max_backlog must be a whole number from 1 to 100000000, "
              "or false",
              "opts.max_queue must be a whole number from 1 to 100000000",
              "opts.heartbeat must be a number from 0.01 to 86400",
              "opts.exit_timeout must be a number from 0.001 to 86400",
              "opts.unique_window must be a number from 0.001 to 86400",
              "opts.socket is required",
              "opts.slow_timeout must be less than 3 * opts.heartbeat",
              "opts.broker must be a whole number from 0 to 1023",
              ] + ["opts.ring_bytes must be a multiple of 4096 from 262144 "
                   "to 1073741824, or false"] * 4 + ["accepted"]
    assert len(errs) == len(expect)
    for got, want in zip(errs, expect):
        assert want in got, (got, want)
    out = n.get("/unsub").text.strip()
    assert out.startswith("1 ") and 'target must be "all"' in out


POLL_RACE = ec.SERVER + """
    location = /pollrace {
        content_by_lua_block {
            local bus = require("resty.loom.events").get()
            local order = {}
            local id = bus:subscribe("race", "e", function(data)
                order[#order + 1] = "start " .. data.n
                if data.n == 1 then
                    ngx.sleep(0.3)
                end
                order[#order + 1] = "end " .. data.n
            end)
            bus:publish("current", "race", "e", { n = 1 })
            bus:publish("current", "race", "e", { n = 2 })
            -- runs the handlers here, as lua-resty-worker-events users do;
            -- the handler loop must not start event 2 meanwhile
            local res = bus:poll()
            ngx.sleep(0.1)
            bus:unsubscribe(id)
            ngx.say(res, ": ", table.concat(order, ", "))
        }
    }
"""


def test_poll_and_the_handler_loop_take_turns(nginx):
    n = nginx(workers=1, http=ec.http(), server=POLL_RACE)
    ec.wait_ready(n)
    assert n.get("/pollrace").text.strip() == \
        "done: start 1, end 1, start 2, end 2"


POLL_KILLED = ec.SERVER + """
    location = /pollkilled {
        content_by_lua_block {
            local bus = require("resty.loom.events").get()
            local order = {}
            local id = bus:subscribe("race", "e", function(data)
                order[#order + 1] = "start " .. data.n
                if data.n == 1 then
                    ngx.sleep(30)
                end
                order[#order + 1] = "end " .. data.n
            end)
            bus:publish("current", "race", "e", { n = 1 })
            local t = ngx.thread.spawn(function() return bus:poll() end)
            ngx.sleep(0.05)
            -- the thread running handlers in poll() dies in event 1's
            ngx.thread.kill(t)
            t = nil
            collectgarbage()
            collectgarbage()
            bus:publish("current", "race", "e", { n = 2 })
            ngx.sleep(0.2)
            bus:unsubscribe(id)
            ngx.say(table.concat(order, ", "))
        }
    }
"""


def test_poll_killed_in_a_handler_holds_nothing_up(nginx):
    n = nginx(workers=1, http=ec.http(), server=POLL_KILLED)
    ec.wait_ready(n)
    assert n.get("/pollkilled").text.strip() == \
        "start 1, start 2, end 2"


# a publish from worker 2 to worker 1, timed until the broker acknowledged
# it (which needs worker 1 to confirm it received it)
ACK_TIMED = ec.SERVER + """
    location /acktime { content_by_lua_block {
        if ngx.worker.id() ~= 2 then ngx.status = 409 return end
        local bus = require("resty.loom.events").get()
        ngx.sleep(0.3)  -- every writer idle, in its long wait
        ngx.update_time()
        local t0 = ngx.now()
        assert(bus:publish(1, "acktime", "e", { n = 1 }))
        while true do
            local q = bus:stats().queue
            if q.unsent == 0 and q.unacked == 0 then break end
            ngx.sleep(0.001)
        end
        ngx.update_time()
        ngx.say(ngx.now() - t0)
    } }
"""

# worker 1 publishes every 3 ms: its writer is never idle for 10 ms
BUSY_WRITER = """
    if ngx.worker.id() == 1 then
        local bus = require("resty.loom.events").get()
        ngx.timer.every(0.003, function(premature)
            if not premature then
                bus:publish(0, "busy", "e", { x = 1 })
            end
        end)
    end
"""


@pytest.mark.parametrize("writer", ["idle", "busy"])
def test_receivers_confirm_promptly(nginx, writer):
    """A worker confirms what it received within ACK_DELAY, whether its
    writer sat in its long wait or keeps sending its own events; the
    publisher's acknowledgement waits for that, so it comes in ms, not
    after half a heartbeat (or never, when the broker ends up treating the
    silent worker as too slow)."""
    n = nginx(workers=3, http=ec.http(
        "heartbeat = 4", extra_worker=BUSY_WRITER if writer == "busy"
        else ""), server=ACK_TIMED)
    ec.wait_ready(n)
    took = []
    while len(took) < 3:
        r = n.get("/acktime", timeout=15)
        if r.status == 200:
            took.append(float(r.text))
    assert max(took) < 0.2, took
