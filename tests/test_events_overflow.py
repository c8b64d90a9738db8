"""Overflow policies, their counters and log lines."""

import os
import signal
import time

import pytest

import eventsconf as ec


def start(nginx, opts):
    n = nginx(workers=2, http=ec.http(opts), server=ec.SERVER)
    ec.wait_ready(n)
    return n


def test_reject_policy(nginx):
    n = start(nginx, 'max_queue = 100, overflow = "reject"')
    # one request publishes 1000 without yielding: the writer cannot drain
    r = n.get("/ev/pub?target=all&n=1000&settle=1").json()
    assert r["ok"] == 100
    assert r["errors"] == {"queue full": 900}
    st = ec.wait_totals(n, {0: 100, 1: 100})
    pub = st[r["worker"]]["stats"]
    # (a stats request right after the flood may be refused as well)
    assert list(pub["dropped"]) == ["queue full"]
    assert pub["dropped"]["queue full"] >= 900
    for s in st.values():
        assert s["order_errors"] == 0
    # logged once per interval, not once per event
    assert n.error_log().count("queue full: publish refused") == 1


def test_drop_oldest_policy(nginx):
    n = start(nginx, 'max_queue = 100, overflow = "drop_oldest"')
    # event 1 is delivered, then 2..1001 are published without yielding:
    # 2..901 are dropped to make room, 902..1001 arrive
    r = n.get("/ev/pub?target=all&n=1000&start=2&warm=1").json()
    assert r["ok"] == 1000
    st = ec.wait_totals(n, {0: 101, 1: 101})
    # (a stats request racing the flood may itself be refused: not counted)
    assert st[r["worker"]]["stats"]["dropped"]["oldest"] == 900
    for s in st.values():
        # every drop is visible to the subscribers as a gap
        assert s["stats"]["gaps"] == 900
        assert s["order_errors"] == 1
        # and the resync hook heard of it
        assert s["gap_calls"] == {str(r["worker"]): 900}
    assert n.error_log().count("queue full: dropped the oldest") == 1
    assert n.error_log().count("gap: 900 event(s)") == 2


def test_wait_policy_slows_the_publisher(nginx):
    n = start(nginx, 'max_queue = 100, overflow = "wait"')
    r = n.get("/ev/pub?target=all&n=5000").json()
    assert r["ok"] == 5000 and r["errors"] == {}
    st = ec.wait_totals(n, {0: 5000, 1: 5000})
    for s in st.values():
        assert s["order_errors"] == 0
        assert s["stats"]["gaps"] == 0


STALL = """
    if ngx.worker.id() == 1 then
        require("resty.loom.events").get():subscribe("slow", "e",
            function(data)
                if data.n == 50 then ngx.sleep(%s) end
            end)
    end
"""


def test_slow_handler_back_pressure_no_loss(nginx):
    """A handler that stalls for less than slow_timeout: everything waits,
    nothing is lost."""
    n = nginx(workers=2, http=ec.http('max_queue = 50, overflow = "wait",'
                                      ' wait_timeout = 10',
                                      extra_worker=STALL % "1.0"),
              server=ec.SERVER)
    ec.wait_ready(n)
    r = n.get("/ev/pub?target=1&n=600&source=slow&size=16384", timeout=30).json()
    assert r["ok"] == 600
    st = ec.wait_totals(n, {0: 0, 1: 600}, timeout=20)
    assert st[1]["stats"]["gaps"] == 0
    assert st[1]["order_errors"] == 0
    assert st[0]["stats"]["broker"]["dropped"] == {}



FLOOD = """
    local bus = require("resty.loom.events").get()
    bus:subscribe("ctl", "go", function()
        if ngx.worker.id() == 3 then
            return
        end
        ngx.timer.at(0, function()
            local blob = string.rep("x", 65536)
            local ok, refused = 0, 0
            for i = 1, 600 do
                if bus:publish("all", "flood", "e",
                               { n = i, pid = ngx.worker.pid(),
                                 blob = blob }) then
                    ok = ok + 1
                else
                    refused = refused + 1
                end
            end
            ngx.shared.flood:set("ok:" .. ngx.worker.id(), ok)
            ngx.shared.flood:set("refused:" .. ngx.worker.id(), refused)
        end)
    end)
    if ngx.worker.id() == 3 then
        local stalled = false
        bus:subscribe("flood", "e", function(data)
            if data.n == 20 and not stalled then
                stalled = true
                ngx.sleep(%s)
            end
        end)
    end
"""

FLOOD_SERVER = ec.SERVER + """
    location = /flood {
        content_by_lua_block {
            local d = ngx.shared.flood
            for _, k in ipairs(d:get_keys()) do
                ngx.say(k, " ", d:get(k))
            end
        }
    }
"""


def test_stalled_subscriber_does_not_hold_back_other_publishers(nginx):
    """Three publishers flood "all" with 64 KiB events while worker 3's
    handler stalls for longer than slow_timeout: the broker drops for
    worker 3 alone (counted, a gap there) and the other publishers keep
    going; no publish is refused and the other workers get everything."""
    n = nginx(workers=4,
              http="lua_shared_dict flood 1m;\n"
              + ec.http('max_queue = 100, overflow = "wait", '
                        'wait_timeout = 3',
                        extra_worker=FLOOD % "8"),
              server=FLOOD_SERVER)
    ec.wait_ready(n)
    n.allow_log("dropping events for worker 3")
    n.allow_log("gap: ")
    assert n.get("/ev/pub?target=all&source=ctl&event=go&n=1").status == 200
    deadline = time.time() + 60
    while True:
        got = dict(line.split() for line in
                   n.get("/flood").text.splitlines())
        if len(got) == 6:
            break
        assert time.time() < deadline, got
        time.sleep(0.2)
    assert all(got["refused:%d" % w] == "0" for w in (0, 1, 2)), got
    want = {w: 0 for w in (0, 1, 2)}
    while True:
        st = ec.states(n)
        flood = {w: sum(v for k, v in st[w]["received"].items()
                        if ":flood:" in k) for w in (0, 1, 2)}
        if all(c == 3 * 600 for c in flood.values()):
            break
        assert time.time() < deadline, flood
        time.sleep(0.2)
    for w in want:
        assert st[w]["stats"]["gaps"] == 0
        assert st[w]["order_errors"] == 0
    # worker 3: what it did not get was dropped for it alone, counted by
    # the broker (it sees a gap only once a later event of the same
    # publisher reaches it, and these floods end with drops)
    while True:
        st = ec.states(n)
        got3 = sum(v for k, v in st[3]["received"].items()
                   if ":flood:" in k)
        dropped = st[0]["stats"]["broker"]["dropped"]
        if got3 + sum(dropped.values()) >= 3 * 600:
            break
        assert time.time() < deadline, (got3, st[3]["stats"], dropped)
        time.sleep(0.2)
    # (a publisher holding more than its share of worker 3's full queue
    # has its events dropped at once, the others wait, then all drop)
    assert set(dropped) <= {"subscriber too slow", "publisher over share"}
    assert "subscriber too slow" in dropped
    assert 0 < got3 < 3 * 600
    assert st[3]["stats"]["gaps"] <= sum(dropped.values())
    assert "dropping events for worker 3: subscriber too slow" \
        in n.error_log()


BURST = ec.SERVER + """
    location = /burst { content_by_lua_block {
        local bus = require("resty.loom.events").get()
        local ran = false
        ngx.thread.spawn(function() ngx.sleep(0); ran = true end)
        local first_seen
        for i = 1, 3000 do
            assert(bus:publish("others", "t", "burst", i))
            if ran and not first_seen then
                first_seen = i
            end
        end
        ngx.say(first_seen or "never")
    } }
"""


def test_wait_policy_lets_requests_in_during_a_burst(nginx):
    """With overflow = "wait", a long run of publishes yields every 64
    events; with "reject" publish never yields."""
    n = nginx(workers=2, http=ec.http('overflow = "wait"'), server=BURST)
    ec.wait_ready(n)
    first = n.get("/burst").text.strip()
    assert first != "never" and 1 <= int(first) <= 64, first

    m = nginx(workers=2, http=ec.http('overflow = "reject"'), server=BURST)
    ec.wait_ready(m)
    assert m.get("/burst").text.strip() == "never"


# worker 1 answers every "flood" event with a "reply" to worker 0, from
# the handler, and records how long its longest publish waited
REPLY = """
    if ngx.worker.id() == 1 then
        local bus = require("resty.loom.events").get()
        _G.reply_wait, _G.reply_refused = 0, 0
        bus:subscribe("flood", "e", function(data)
            ngx.update_time()
            local t0 = ngx.now()
            local ok = bus:publish(0, "reply", "r", { n = data.n })
            ngx.update_time()
            _G.reply_wait = math.max(_G.reply_wait, ngx.now() - t0)
            if not ok then
                _G.reply_refused = _G.reply_refused + 1
            end
        end)
    end
"""

REPLY_SERVER = ec.SERVER + """
    location = /reply {
        content_by_lua_block {
            ngx.say(ngx.worker.id(), " ", _G.reply_wait, " ",
                    _G.reply_refused)
        }
    }
"""


def test_handler_publishing_with_wait_policy_does_not_stall(nginx):
    """A handler that publishes waits for the broker's acks, which come in
    on the socket its worker stops reading when its handlers are behind:
    the reader goes on while a handler waits, so the two never wait for
    each other (until wait_timeout, refusing the publish, while the broker
    dropped the worker's events as too slow)."""
    n = nginx(workers=2, http=ec.http(
        'max_queue = 20, overflow = "wait", wait_timeout = 2',
        extra_worker=REPLY), server=REPLY_SERVER)
    ec.wait_ready(n)
    for _ in range(400):
        r = n.get("/ev/pub?only=0&target=1&source=flood&n=2000&size=2000",
                  timeout=30)
        if r.status == 200:
            break
    assert r.json()["ok"] == 2000
    deadline = time.time() + 20
    while True:
        st = ec.states(n)
        replies = st[0]["received"].get("1:reply:r", 0)
        if replies == 2000 or time.time() > deadline:
            break
        time.sleep(0.1)
    assert st[1]["received"].get("0:flood:e") == 2000, st[1]["stats"]
    assert replies == 2000, st[0]["stats"]
    assert st[0]["stats"]["broker"]["dropped"] == {}
    for _ in range(400):
        wid, wait, refused = n.get("/reply").text.split()
        if wid == "1":
            break
    assert refused == "0"
    assert float(wait) < 1, wait


# worker 1 publishes to worker 0 with max_queue = 1: each publish waits for
# the previous event's ack
SPIN = """
    if ngx.worker.id() == 1 then
        local bus = require("resty.loom.events").get()
        ngx.timer.at(0.5, function()
            local i = 0
            while not ngx.worker.exiting() do
                i = i + 1
                if bus:publish(0, "spin", "e", { n = i }) then
                    ngx.sleep(0.005)
                end
            end
        end)
    end
"""


def cpu_seconds(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_wait_for_room_sleeps_to_its_deadline(nginx):
    """With the broker frozen, a publisher waiting for room waits: it does
    not spin once less than a millisecond is left (a semaphore wait of 0 ms
    returns at once, and ngx.now() only moves when the worker yields)."""
    n = nginx(workers=2, http=ec.http(
        'max_queue = 1, overflow = "wait", wait_timeout = 0.01, '
        'heartbeat = 5', extra_worker=SPIN), server=ec.SERVER)
    n.allow_log("queue full")
    st = ec.wait_ready(n)
    broker, publisher = st[0]["pid"], st[1]["pid"]
    time.sleep(1)
    n.kill(broker, signal.SIGSTOP)
    try:
        time.sleep(1)
        c0 = cpu_seconds(publisher)
        time.sleep(2)
        busy = cpu_seconds(publisher) - c0
    finally:
        n.kill(broker, signal.SIGCONT)
    # waits of 10 ms, each refused, then tried again: a few % of a core
    assert busy < 0.5, busy
    # and the worker is alive: it answers
    st = ec.states(n)
    assert st[1]["pid"] == publisher
    assert st[1]["stats"]["dropped"].get("queue full", 0) > 10


# worker 1's handler stalls until the test releases it; worker 0 publishes
# small events to worker 1 as fast as the bus takes them, and records the
# largest backlog for worker 1 at the broker and who the broker says is slow
BACKLOG = """
    local bus = require("resty.loom.events").get()
    local d = ngx.shared.backlog
    if ngx.worker.id() == 1 then
        bus:subscribe("slow", "e", function()
            while not d:get("release") do
                ngx.sleep(0.05)
            end
        end)
        ngx.timer.every(0.01, function()
            local inbox = bus:stats().queue.inbox
            if inbox > (d:get("inbox") or 0) then
                d:set("inbox", inbox)
            end
        end)
    else
        ngx.timer.at(0.5, function()
            local sent = 0
            local deadline = ngx.now() + 30
            while sent < 300000 and ngx.now() < deadline
                  and not d:get("release") do
                for _ = 1, 500 do
                    if not bus:publish(1, "slow", "e", sent) then
                        break
                    end
                    sent = sent + 1
                end
                local b = bus:stats().broker
                local q = b.queues["1"]
                if q and q.events > (d:get("broker") or 0) then
                    d:set("broker", q.events)
                end
                if b.dropped["subscriber too slow"] and not d:get("slow") then
                    d:set("slow", require("cjson").encode(b.slow or {}))
                    d:set("at_drop", (d:get("broker") or 0)
                                     + (d:get("inbox") or 0))
                end
                d:set("sent", sent)
                ngx.sleep(0.001)
            end
        end)
    end
"""

BACKLOG_SERVER = ec.SERVER + """
    location = /backlog { content_by_lua_block {
        if ngx.var.arg_release then
            ngx.shared.backlog:set("release", true)
        end
        require("events_helper").dump_dict("backlog")
    } }
"""


def test_slow_subscriber_backlog_bounded_by_default(nginx):
    """A handler stalls while another worker publishes to it as fast as it
    can, with the default options: the events waiting for it (at the
    broker and in its inbox) stay within 2 x max_backlog (10,000) plus what
    the sockets hold before the broker drops for it, and the broker's
    stats name it as slow."""
    n = nginx(workers=2, http="lua_shared_dict backlog 1m;\n"
              + ec.http(extra_worker=BACKLOG), server=BACKLOG_SERVER)
    n.allow_log("dropping events for worker 1: subscriber too slow")
    ec.wait_ready(n)
    deadline = time.time() + 40
    while True:
        d = n.get("/backlog").json()
        if "slow" in d or time.time() > deadline:
            break
        time.sleep(0.2)
    n.get("/backlog?release=1")
    assert "slow" in d, d
    assert d["slow"] == "[1]", d
    # (the reader stops at the bound: plus one read of 64 KiB)
    assert d["inbox"] <= 11000, d
    # (queued and written to it, unconfirmed)
    assert d["broker"] <= 20000, d
    # (plus what the socket buffers between them hold)
    assert d["at_drop"] <= 25000, d


# a handler that re-posts the event it handles: in every worker, or in
# worker 1 only; /canary publishes one event from a request and reports
# how it went, /loopstats what the loop did
LOOP = """
    local bus = require("resty.loom.events").get()
    if %(everywhere)s or ngx.worker.id() == 1 then
        bus:subscribe("loop", "e", function(data)
            bus:publish("all", "loop", "e", data)
        end)
    end
    bus:subscribe("canary", "e", function(data)
        ngx.shared.canary:set(ngx.worker.id() .. ":" .. data, ngx.now())
    end)
"""

LOOP_SERVER = ec.SERVER + """
    location = /canary { content_by_lua_block {
        local bus = require("resty.loom.events").get()
        local id = ngx.var.arg_id
        ngx.shared.canary:set("sent:" .. id, ngx.now())
        local ok, err = bus:publish("all", "canary", "e", id)
        ngx.say(ok and "ok" or err)
    } }
    location = /canarystate { content_by_lua_block {
        require("events_helper").dump_dict("canary")
    } }
"""


@pytest.mark.parametrize("everywhere", [True, False])
def test_feedback_loop_does_not_starve_the_bus(nginx, everywhere):
    """A handler re-posts its own event, in every worker or in one: a
    canary published from a request is accepted and reaches every worker,
    collect() answers with every worker within 2 s, and the loop is
    counted and named in a warning. (collect and its answers take the
    workers' lanes: over the connections they waited behind the loop's
    events, which back-pressure holds in both directions, and one round
    in two missed a worker on a loaded machine.)"""
    rounds = 10
    n = nginx(workers=4, http="lua_shared_dict canary 1m;\n"
              + ec.http(extra_worker=LOOP % {
                  "everywhere": str(everywhere).lower()}),
              server=LOOP_SERVER)
    n.allow_log("feedback")
    n.allow_log("queue full")
    n.allow_log("dropping events for worker")
    ec.wait_ready(n)
    r = n.get("/ev/pub?target=all&source=loop&event=e&n=1")
    assert r.status == 200
    time.sleep(2)
    for i in range(rounds):
        assert n.get("/canary?id=%d" % i).text.strip() == "ok"
        start = time.time()
        r = n.get("/ev/collect?name=loom.events&timeout=2", timeout=10)
        took = time.time() - start
        assert r.status == 200, r.text
        assert sorted(r.json()) == ["0", "1", "2", "3"], (took, r.json())
        # the loop is visible: counted where it runs
        assert r.json()["1"]["feedback"] > 0
        time.sleep(0.2)
    deadline = time.time() + 10
    while True:
        d = n.get("/canarystate").json()
        got = [k for k in d if not k.startswith("sent:")]
        if len(got) == 4 * rounds or time.time() > deadline:
            break
        time.sleep(0.1)
    # a canary may only be missing where the broker counted drops (a
    # worker it found too slow under the flood)
    r = n.get("/ev/collect?name=loom.events&timeout=5", timeout=10).json()
    queues = r["0"]["broker"]["queues"]
    for w in range(4):
        mine = [k for k in got if k.startswith("%d:" % w)]
        assert len(mine) == rounds or queues[str(w)]["dropped"] > 0, (
            w, mine)
    if not everywhere:
        assert len(got) == 4 * rounds, sorted(got)
    assert "feedback" in n.error_log()


def test_feedback_loop_with_drop_oldest_evicts_no_one_else(nginx):
    """With overflow = "drop_oldest", a handler beyond its half of the
    queue is refused like with "reject": its publishes must not drop the
    oldest events of the queue (those of requests and timers) to make
    room for a feedback loop."""
    n = nginx(workers=4, http="lua_shared_dict canary 1m;\n"
              + ec.http('max_queue = 100, overflow = "drop_oldest"',
                        extra_worker=LOOP % {"everywhere": "true"}),
              server=LOOP_SERVER)
    n.allow_log("feedback")
    n.allow_log("handlers fill their half")
    n.allow_log("dropping events for worker")
    ec.wait_ready(n)
    assert n.get("/ev/pub?target=all&source=loop&event=e&n=1").status == 200
    time.sleep(1.5)
    r = n.get("/ev/collect?name=loom.events&timeout=5", timeout=10)
    assert r.status == 200, r.text
    st = r.json()
    assert sorted(st) == ["0", "1", "2", "3"], st
    for w, s in st.items():
        # the loop ran into its share everywhere, and took nobody's room
        assert s["dropped"].get("handler share", 0) > 0, (w, s["dropped"])
        assert s["dropped"].get("oldest", 0) == 0, (w, s["dropped"])
