"""resty.loom.status: one JSON document of every worker, gathered over the
events bus; workers that do not answer in time; modules absent; histogram
shapes; nothing secret in the output."""

import json
import os
import re
import signal
import threading
import time
from http.client import HTTPConnection

import pytest

from loomtest.nginx import ROOT
from pubsub.fake import FakePubSub

LE = [0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
      0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10]

BUS = """
    server {
        listen unix:$PREFIX/sock/bus.sock;
        lua_socket_buffer_size 64k;
        location / {
            content_by_lua_block { require("resty.loom.events").get():serve() }
        }
    }
"""


def http(init="", worker=""):
    return """
    lua_shared_dict loom_publish 1m;
    init_by_lua_block {
        require("resty.loom.events").new({
            socket = ngx.config.prefix() .. "sock/bus.sock" })
        require("resty.loom.status").register_collector()
        %s
    }
    init_worker_by_lua_block {
        local bus = require("resty.loom.events").get()
        assert(bus:init_worker())
        bus:subscribe("t", "*", function() end)
        require("resty.loom.status").init_worker()
        %s
    }
    """ % (init, worker) + BUS


SERVER = r"""
    location = /status {
        content_by_lua_block {
            local status = require "resty.loom.status"
            local doc = status.collect(tonumber(ngx.var.arg_timeout))
            if ngx.var.arg_only then
                doc = status.only(doc, ngx.var.arg_only)
            end
            ngx.say(require("cjson").encode(doc))
        }
    }
    location = /metrics {
        content_by_lua_block {
            local status = require "resty.loom.status"
            ngx.print(require("resty.loom.status.prometheus").render(
                status.collect()))
        }
    }
    location = /pub {
        content_by_lua_block {
            local bus = require("resty.loom.events").get()
            for i = 1, tonumber(ngx.var.arg_n) do
                assert(bus:publish("all", "t", "x",
                                   { i = i, secret = ngx.var.arg_data }))
            end
            ngx.say("ok")
        }
    }
    location = /spin {
        content_by_lua_block {
            ngx.update_time()
            local stop = ngx.now() + tonumber(ngx.var.arg_s)
            while ngx.now() < stop do
                ngx.update_time()
            end
            ngx.say(ngx.worker.id())
        }
    }
"""


def status(n, **args):
    q = "&".join("%s=%s" % kv for kv in args.items())
    r = n.get("/status" + ("?" + q if q else ""))
    assert r.status == 200, r.text
    return r.json()


def check_hist(h):
    assert sorted(h) == ["buckets", "count", "le", "sum"]
    assert h["le"] == LE
    assert len(h["buckets"]) == len(LE)
    assert all(a <= b for a, b in zip(h["buckets"], h["buckets"][1:]))
    assert h["buckets"][-1] <= h["count"]
    assert h["sum"] >= 0


def wait_for(fn, timeout=10):
    deadline = time.time() + timeout
    while True:
        v = fn()
        if v or time.time() > deadline:
            return v
        time.sleep(0.05)


def test_every_worker_in_one_document(nginx):
    n = nginx(workers=4, http=http(), server=SERVER)
    assert wait_for(lambda: all(
        not w.get("error") and w["events"]["connected"]
        for w in status(n)["workers"]))
    assert n.get("/pub?n=100&data=x").status == 200

    def delivered():
        doc = status(n)
        return doc if [w["events"]["delivered_total"]
                       for w in doc["workers"]] == [100] * 4 else None
    doc = wait_for(delivered)
    assert doc, status(n)
    assert doc["source"] == "events"
    assert doc["version"]
    assert doc["nginx"]["version"].count(".") == 2
    assert doc["nginx"]["worker_processes"] == 4
    assert [w["id"] for w in doc["workers"]] == [0, 1, 2, 3]
    assert sorted(w["pid"] for w in doc["workers"]) == \
        sorted(n.worker_pids())
    for w in doc["workers"]:
        assert w["uptime_s"] > 0 and w["lua_memory_bytes"] > 0
        # modules this nginx never loaded are absent, not errors
        assert "timers" not in w and "offload" not in w
        assert "watchdog" not in w and "publish" not in w
        check_hist(w["events"]["delivery_seconds"])
    assert doc["totals"]["events"]["delivered_total"] == 400
    # they went through the publisher's ring
    assert doc["totals"]["events"]["ring_events_total"] >= 100
    assert doc["totals"]["events"]["ring_overwritten_total"] == 0
    assert sorted(doc["totals"]) == ["events"]
    # the broker (worker 0) forwarded the 100 events
    assert doc["workers"][0]["events"]["broker"]["forwarded_total"] >= 100
    only = status(n, only="events")
    assert sorted(only["workers"][0]) == ["events", "id", "pid", "uptime_s"]


def test_many_collects_at_once(nginx):
    n = nginx(workers=4, http=http(), server=SERVER)
    assert wait_for(lambda: all(not w.get("error")
                                for w in status(n)["workers"]))
    docs, errors = [], []

    def ask():
        try:
            for _ in range(5):
                docs.append(status(n, timeout=3))
        except Exception as e:      # reported below
            errors.append(e)
    threads = [threading.Thread(target=ask) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(docs) == 100
    # every collect got its own answers from every worker
    assert all([w["id"] for w in d["workers"] if not w.get("error")]
               == [0, 1, 2, 3] for d in docs)


def test_worker_that_does_not_answer(nginx):
    n = nginx(workers=2, http=http(), server=SERVER)
    assert wait_for(lambda: all(not w.get("error")
                                for w in status(n)["workers"]))
    spun = {}

    def spin():
        spun["worker"] = int(n.get("/spin?s=1.5").text)
    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.2)
    start = time.time()
    doc = status(n, timeout=0.3)
    took = time.time() - start
    t.join()
    # the answer came from the other worker while the first one spun
    assert took < 1.0, took
    bad = [w for w in doc["workers"] if w.get("error")]
    assert bad == [{"id": spun["worker"], "error": "timeout"}]
    good = [w for w in doc["workers"] if not w.get("error")]
    assert [w["id"] for w in good] == [1 - spun["worker"]]
    assert good[0]["events"]["connected"]
    m = n.get("/metrics").text
    assert 'loom_worker_up{worker="%d"} 1' % good[0]["id"] in m


def test_restarted_worker_shows_its_new_pid(nginx):
    n = nginx(workers=2, http=http(), server=SERVER)
    assert wait_for(lambda: all(not w.get("error")
                                for w in status(n)["workers"]))
    before = {w["id"]: w for w in status(n)["workers"]}
    time.sleep(1)
    n.allow_log(r"worker process %d exited on signal 9" % before[1]["pid"])
    n.kill(before[1]["pid"], signal.SIGKILL)
    n.wait_workers(2)

    def replaced():
        doc = status(n)
        w = doc["workers"][1]
        return doc if not w.get("error") and w["pid"] != before[1]["pid"] \
            and w["events"]["connected"] else None
    doc = wait_for(replaced)
    assert doc, status(n)
    new = doc["workers"][1]
    assert new["pid"] in n.worker_pids()
    assert new["uptime_s"] < doc["workers"][0]["uptime_s"] - 0.5
    # counters start again with the process
    assert new["events"]["delivered_total"] == 0
    assert doc["workers"][0]["pid"] == before[0]["pid"]


def test_without_a_bus_this_worker_only(nginx):
    n = nginx(workers=2, http="""
    init_worker_by_lua_block { require("resty.loom.status").init_worker() }
    """, server=SERVER)
    doc = status(n)
    assert doc["source"] == "local"
    assert len(doc["workers"]) == 1
    w = doc["workers"][0]
    assert w["pid"] in n.worker_pids()
    assert "events" not in w and doc["totals"] == {}
    assert "error" not in w


def test_bus_unusable_this_worker_and_the_others_unreachable(nginx):
    # a bus made but never started in the workers: collects cannot go out
    n = nginx(workers=2, http="""
    init_by_lua_block {
        require("resty.loom.events").new({
            socket = ngx.config.prefix() .. "sock/bus.sock" })
        require("resty.loom.status").register_collector()
    }
    """ + BUS, server=SERVER)
    doc = status(n)
    assert doc["source"] == "local"
    me = [w for w in doc["workers"] if not w.get("error")]
    assert len(me) == 1 and me[0]["pid"] in n.worker_pids()
    assert [w for w in doc["workers"] if w.get("error")] == [
        {"id": 1 - me[0]["id"], "error": "unreachable"}]
    assert "failed to collect" in n.error_log()


def test_bus_without_the_collector(nginx):
    # the bus is there but nobody registered the status collector: every
    # worker answers at once, with nothing
    n = nginx(workers=2, http=http().replace(
        'require("resty.loom.status").register_collector()', "").replace(
        'require("resty.loom.status").init_worker()', ""), server=SERVER)
    doc = wait_for(lambda: (lambda d: d if d["workers"] == [
        {"id": 0, "error": "no collector"},
        {"id": 1, "error": "no collector"}] else None)(status(n)))
    assert doc, status(n)
    assert doc["totals"] == {}


HIST_CHECK = r"""
    location = /hist {
        content_by_lua_block {
            -- values recorded by the modules' own histograms land in the
            -- status buckets that hold them
            local histogram = require "resty.loom.histogram"
            local status = require "resty.loom.status"
            local timer = require "resty.loom.timer"
            local out = {}
            local h = histogram.new()
            h:record(0.0004)
            h:record(0.003)
            h:record(0.003)
            h:record(7)
            out.lh = status.from_histogram(h)
            local function spin(ms)
                ngx.update_time()
                local stop = ngx.now() + ms / 1000
                while ngx.now() < stop do
                    ngx.update_time()
                end
            end
            assert(timer.at(0, function() spin(15) end))
            assert(timer.at(0, function() spin(150) end))
            ngx.sleep(0.3)
            out.timers = status.snapshot().timers
            ngx.say(require("cjson").encode(out))
        }
    }
"""


def test_histograms_from_the_modules(nginx):
    n = nginx(workers=1, http="", server=HIST_CHECK)
    out = n.get("/hist").json()
    lh = out["lh"]
    check_hist(lh)
    cum = dict(zip(LE, lh["buckets"]))
    assert (cum[0.00025], cum[0.0005], cum[0.0025], cum[0.005],
            cum[5], cum[10]) == (0, 1, 1, 3, 3, 4)
    assert lh["count"] == 4 and abs(lh["sum"] - 7.0064) < 1e-9
    rt = out["timers"]["run_seconds"]
    check_hist(rt)
    cum = dict(zip(LE, rt["buckets"]))
    # 15 ms and 150 ms, with room for a busy machine's preemptions
    assert (cum[0.01], cum[0.025], cum[0.1], cum[0.25]) == (0, 1, 1, 2)
    assert 0.16 <= rt["sum"] < 0.3     # ngx.now() has 1 ms steps
    assert out["timers"]["runs_total"] == 2
    check_hist(out["timers"]["lateness_seconds"])
    assert out["timers"]["lateness_seconds"]["count"] == 2


SECRET_TOKEN = "tok-SECRET-5b1f0c"
SECRET_QUERY = "qry-SECRET-77ad02"
SECRET_PAYLOAD = "pay-SECRET-c03e99"
SECRET_HEADER = "hdr-SECRET-9e41aa"


def test_no_secret_in_json_or_metrics(nginx):
    fake = FakePubSub()
    try:
        n = nginx(workers=2, http=http(worker="""
            require("resty.loom.watchdog").start({ threshold = 50 })
            P = require("resty.loom.publish").new({
                project = "proj", topic = "topic", endpoint = "%s",
                credentials = { type = "token", token = "%s" },
                batch_max_delay = 0.01 })
        """ % (fake.url, SECRET_TOKEN)), server=SERVER + """
    location = /send {
        content_by_lua_block {
            assert(P:send(ngx.var.arg_data, { note = ngx.var.arg_data }))
        }
    }
""")
        for _ in range(5):
            assert n.get("/send?data=" + SECRET_PAYLOAD).status == 200
        assert n.get("/pub?n=3&data=" + SECRET_PAYLOAD).status == 200
        assert n.get("/spin?s=0.2&key=" + SECRET_QUERY,
                     headers={"Authorization": "Bearer " + SECRET_HEADER,
                              "Cookie": "s=" + SECRET_HEADER}).status == 200
        fake.wait_messages(5)

        def ready():
            doc = status(n)
            pubs = [w.get("publish", {}).get("publishers", {}).get("proj/topic")
                    for w in doc["workers"]]
            sent = sum(p["sent_total"] for p in pubs if p)
            stalls = [r for w in doc["workers"]
                      for r in w.get("watchdog", {}).get("reports", [])]
            return doc if sent == 5 and stalls else None
        doc = wait_for(ready)
        assert doc, status(n)
        # the figures are there, the secrets are not
        rep = [r for w in doc["workers"]
           for r in w["watchdog"].get("reports", [])][0]
        assert rep["request"] == {"method": "GET", "path": "/spin"}
        assert rep["duration_seconds"] >= 0.15
        assert rep["backtrace"]
        text = json.dumps(doc) + n.get("/metrics").text
        assert "loom_publish_sent_total" in text
        for s in (SECRET_TOKEN, SECRET_QUERY, SECRET_PAYLOAD, SECRET_HEADER):
            assert s not in text
    finally:
        fake.close()


OFFLOAD_LIB = os.path.join(ROOT, "runtimes", "c", "libloom_offload_c.so")


@pytest.mark.skipif(not os.path.exists(OFFLOAD_LIB),
                    reason="the example C runtime is not built (make runtimes)")
def test_offload_histograms(nginx):
    # one thread, three 20 ms calls at once: they run one after the other,
    # so they take about 20, 40 and 60 ms and wait about 0, 20 and 40 ms
    n = nginx(workers=1, http="""
    init_worker_by_lua_block {
        RT = assert(require("resty.loom.offload").load("%s", "",
                                                       { threads = 1 }))
    }
    """ % OFFLOAD_LIB, server="""
    location = /calls {
        content_by_lua_block {
            local th = {}
            for i = 1, 3 do
                th[i] = ngx.thread.spawn(function()
                    return assert(RT:call("sleep 20"))
                end)
            end
            for i = 1, 3 do
                assert(ngx.thread.wait(th[i]))
            end
            local s = require "resty.loom.status"
            ngx.say(require("cjson").encode(s.snapshot().offload))
        }
    }
    """)
    rt = n.get("/calls").json()["runtimes"]["libloom_offload_c.so"]
    assert rt["completed_total"] == 3
    call, wait = rt["call_seconds"], rt["queue_wait_seconds"]
    check_hist(call)
    check_hist(wait)
    cum = dict(zip(LE, call["buckets"]))
    assert call["count"] == 3 and (cum[0.01], cum[0.1]) == (0, 3), call
    assert 0.115 <= call["sum"] < 0.3
    cum = dict(zip(LE, wait["buckets"]))
    assert wait["count"] == 3 and cum[0.01] <= 1 and cum[0.1] == 3, wait
    assert 0.055 <= wait["sum"] < 0.2


def test_gateway_loom_endpoints_loopback_only(gateway):
    # the same gateway, asked from another local address: a proxy or a
    # wider listen address must not open /loom/ to others
    def get(path, source):
        c = HTTPConnection("127.0.0.1", gateway.port, timeout=5,
                                       source_address=(source, 0))
        try:
            c.request("GET", path)
            r = c.getresponse()
            r.read()
            return r.status
        finally:
            c.close()
    paths = ["/loom/", "/loom/status", "/loom/metrics", "/loom/events",
             "/loom/timers", "/loom/offload", "/loom/blocking",
             "/loom/publish"]
    if os.path.exists("/usr/share/javascript/chart.js/chart.min.js"):
        paths.append("/loom/chart.js")      # Debian package libjs-chart.js
    # every /loom/ location the gateway ships, the demo that blocks a
    # worker and the one that publishes a body included
    shipped = set()
    conf_d = os.path.join(ROOT, "examples", "gateway", "conf.d")
    for name in os.listdir(conf_d):
        with open(os.path.join(conf_d, name)) as f:
            shipped.update(re.findall(r"^location = (/loom/\S*) \{",
                                      f.read(), re.M))
    assert set(paths) <= shipped and "/loom/demo/block" in shipped
    assert {p: get(p, "127.0.0.2") for p in sorted(shipped)} == \
        {p: 403 for p in sorted(shipped)}
    assert get("/", "127.0.0.2") == 200
    assert [get(p, "127.0.0.1") for p in paths] == [200] * len(paths)
    gateway.allow_log(r"access forbidden by rule")


MISUSE_LIB = os.path.join(ROOT, "runtimes", "c", "libloom_offload_misuse.so")


@pytest.mark.skipif(not os.path.exists(MISUSE_LIB),
                    reason="the C runtimes are not built (make runtimes)")
def test_offload_losses_are_exported(nginx):
    # every way an offload call or answer is lost shows in the JSON and as
    # a counter an alert can fire on: rejected (queue full), late (an
    # answer after its call gave up), misused (an answer the ABI refuses),
    # reclaimed (a task never answered)
    n = nginx(workers=1, http="""
    init_worker_by_lua_block {
        local offload = require "resty.loom.offload"
        RT = assert(offload.load("%s", "", { threads = 1, queue = 1 }))
        MIS = assert(offload.load("%s", "", { threads = 1, reclaim = 1 }))
    }
    """ % (OFFLOAD_LIB, MISUSE_LIB), server=SERVER + """
    location = /lose {
        content_by_lua_block {
            local th = {}
            for i = 1, 3 do
                th[i] = ngx.thread.spawn(RT.call, RT, "stuck 300",
                                         { timeout = 0.1 })
            end
            local errs = {}
            for i = 1, 3 do
                local _, _, err = ngx.thread.wait(th[i])
                errs[#errs + 1] = err
            end
            table.sort(errs)
            assert(MIS:call("twice"))
            local _, err = MIS:call("never", { timeout = 0.1 })
            errs[#errs + 1] = err
            ngx.say(table.concat(errs, ","))
        }
    }
    """)
    n.allow_log(r"answer\(\) for a task the runtime does not hold")
    n.allow_log(r"a task was not answered within 1000 ms")
    # the first call runs; the others are queued or refused, depending on
    # whether the thread took the first one yet
    errs = n.get("/lose").text.strip().split(",")
    full = errs.count("queue full")
    assert full in (1, 2) and errs[full:] == ["timeout"] * (4 - full), errs

    def lost():
        doc = status(n)
        rts = doc["workers"][0]["offload"]["runtimes"]
        c, m = rts["libloom_offload_c.so"], rts["libloom_offload_misuse.so"]
        return doc if (c["rejected_total"], c["late_total"] >= 1,
                       m["misused_total"], m["reclaimed_total"]) \
            == (full, True, 1, 1) else None
    doc = wait_for(lost)
    assert doc, status(n)["workers"][0]["offload"]
    m = n.get("/metrics").text
    for fam, rt, v in [
            ("rejected", "c", str(full)), ("misused", "misuse", "1"),
            ("reclaimed", "misuse", "1"), ("closed", "c", "0")]:
        assert 'loom_offload_%s_total{worker="0",runtime=' \
            '"libloom_offload_%s.so"} %s\n' % (fam, rt, v) in m, (fam, m)
    assert re.search(r'loom_offload_late_total\{worker="0",runtime='
                     r'"libloom_offload_c.so"\} [1-9]', m), m
    assert doc["totals"]["offload"]["runtimes"]["libloom_offload_misuse.so"][
        "misused_total"] == 1


def test_event_drops_by_reason(nginx):
    # each reason a drop is counted under is its own series, there at 0
    # before the first drop (else increase() misses that first drop)
    n = nginx(workers=2, http=http(), server=SERVER + """
    location = /big {
        content_by_lua_block {
            local bus = require("resty.loom.events").get()
            ngx.say(select(2, bus:publish("all", "t", "x",
                                          string.rep("x", 2 * 1024 * 1024))))
        }
    }
    """)
    # (a worker late for a collect has no figures in it: ask again)
    def metrics():
        m = n.get("/metrics").text
        up = re.findall(r'^loom_worker_up\{worker="\d"\} (\d)$', m, re.M)
        return m if up == ["1", "1"] else None

    def everyone():
        doc = status(n)
        return doc if all(not w.get("error")
                          for w in doc["workers"]) else None
    m = wait_for(metrics)
    assert m
    for w in ("0", "1"):
        for reason in ("queue full", "handler share", "closed", "exit"):
            assert 'loom_events_dropped_total{worker="%s",reason="%s"} 0\n' \
                % (w, reason) in m, m
    assert 'loom_events_broker_dropped_total{worker="0",reason="worker ' \
        'gone"} 0\n' in m
    assert n.get("/big").text == "payload too large\n"
    doc = wait_for(everyone)
    assert doc
    by = [w["events"]["dropped_by_reason"] for w in doc["workers"]]
    assert sorted(b["payload too large"] for b in by) == [0, 1]
    assert all(b["closed"] == 0 for b in by)
    assert sum(w["events"]["dropped_total"] for w in doc["workers"]) == 1
    assert doc["totals"]["events"]["dropped_by_reason"][
        "payload too large"] == 1
    m = wait_for(metrics)
    assert sorted(re.findall(r'loom_events_dropped_total\{worker="\d",'
                             r'reason="payload too large"\} (\d+)', m)) \
        == ["0", "1"]


def test_gateway_module_endpoints_are_the_collectors_shape(gateway):
    # /loom/events, /timers, /offload, /blocking, /publish: the /loom/status
    # document cut to one module, not five shapes of their own
    # once every worker answers (just after the start, one may still be
    # connecting to the bus: its entry is an error)
    full = wait_for(lambda: (lambda d: d if all(
        "pid" in w for w in d["workers"]) else None)(
        gateway.get("/loom/status").json()))
    assert full and [w["id"] for w in full["workers"]] == [0, 1], full
    for path, module in [("/loom/events", "events"),
                         ("/loom/timers", "timers"),
                         ("/loom/offload", "offload"),
                         ("/loom/blocking", "watchdog"),
                         ("/loom/publish", "publish")]:
        doc = gateway.get(path).json()
        assert sorted(doc) == sorted(full), path
        assert doc["source"] == "events"
        # the same nginx fields (the connection counts move between the
        # two requests: a client's previous connection may still close)
        assert sorted(doc["nginx"]) == sorted(full["nginx"]), path
        assert doc["nginx"]["version"] == full["nginx"]["version"], path
        assert sorted(doc["totals"]) == sorted(
            m for m in full["totals"] if m == module), path
        for w, fw in zip(doc["workers"], full["workers"]):
            assert w["id"] == fw["id"] and w["pid"] == fw["pid"]
            assert sorted(w) == sorted(k for k in fw if k in (
                "id", "pid", "uptime_s", "error", module)), (path, w)
            if module in w:
                # the same fields as in /loom/status
                assert sorted(w[module]) == sorted(fw[module]), path


def test_many_timer_names(nginx):
    # the timer module keeps figures for up to 1000 names (its default
    # max_names): every worker still answers, with the first 100 names
    n = nginx(workers=2, http=http(worker="""
        local timer = require "resty.loom.timer"
        for i = 1, 1000 do
            assert(timer.every({ interval = 0.5, name = ("job-%04d"):format(i) },
                               function() end))
        end
    """), server=SERVER)
    doc = wait_for(lambda: (lambda d: d if all(
        not w.get("error") and w["timers"]["runs_total"] >= 1000
        for w in d["workers"]) else None)(status(n, timeout=2)))
    assert doc, status(n)
    for w in doc["workers"]:
        t = w["timers"]
        assert sorted(t["names"]) == ["job-%04d" % i for i in range(1, 101)]
        assert t["names_omitted"] == 900
        assert t["names"]["job-0001"]["runs_total"] >= 1

    def named_series():
        # (a worker late for this collect has no series: ask again)
        m = n.get("/metrics").text
        return m if len(re.findall(r'^loom_timers_named_runs_total\{', m,
                                   re.M)) == 200 else None
    m = wait_for(named_series)
    assert m, n.get("/metrics").text
    assert 'loom_timers_names_omitted{worker="1"} 900\n' in m
