"""Delivery by target, ordering, payload size limits."""

import time

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
    try:
        n = nginx(workers=2, http=ec.http(
            "privileged_agent = true",
            extra_init='assert(require("ngx.process")'
                       '.enable_privileged_agent())'),
            server=ec.SERVER)
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
            { socket = "/tmp/x.sock", bogus = 1 },
            "not a table",
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
    expect = ["opts.socket must be a string",
              "opts.socket must be an absolute path",
              "opts.socket must be an absolute path",
              "opts.broker must be an integer >= 0",
              "opts.max_queue must be an integer >= 1",
              "opts.max_payload must be an integer >= 1 and <= 67108864",
              'opts.overflow must be "reject", "drop_oldest" or "wait"',
              "opts.privileged_agent must be a boolean",
              "opts.heartbeat must be a number > 0",
              "opts.bogus is not a known option",
              "opts must be a table"]
    assert len(errs) == len(expect)
    for got, want in zip(errs, expect):
        assert want in got, (got, want)
    out = n.get("/unsub").text.strip()
    assert out.startswith("1 ") and 'target must be "all"' in out
