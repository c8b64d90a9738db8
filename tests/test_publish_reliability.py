"""resty.loom.publish under fast stops, bad options, permanent failures
and long outages: nothing accepted is lost without a report, bad options are
refused before anything is made, what cannot succeed is not retried, and
trouble shows in the error log without flooding it."""

import collections
import glob
import json
import os
import re
import signal
import threading
import time
import urllib.parse

import pytest

from pubsub import harness as H
from pubsub.dns import FakeDNS
from pubsub.fake import FakePubSub

F = FakePubSub
LEFT = re.compile(r"(\d+) messages not delivered at worker exit")


@pytest.fixture
def fake():
    f = FakePubSub()
    yield f
    f.close()


def reported(path):
    """(reason, data) of every message handed to on_error (err_file, one
    file per worker)."""
    out = []
    for name in glob.glob(path + ".*"):
        with open(name) as f:
            for line in f:
                e = json.loads(line)
                out += [(e["reason"], d.encode()) for d in e["datas"]]
    return out


def stop_fast(n, timeout=20):
    """nginx -s stop: SIGTERM to the master, wait until it is gone."""
    pid = n.master_pid
    n.signal(signal.SIGTERM)
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise RuntimeError("nginx did not stop")
    n.master_pid = None


# -- item: a fast stop reports every message not yet delivered -------------

def test_fast_stop_reports_every_buffered_message(nginx, fake, tmp_path):
    # the sink answers slowly: at the stop, batches are queued, some are in
    # flight and some were delivered
    fake.default = ("slow", 0.5)
    err_file = str(tmp_path / "errors.jsonl")
    n = H.publisher(nginx, {"emulator_host": fake.host,
                            "batch_max_delay": 60, "concurrency": 2,
                            "err_file": err_file}, workers=2)
    n.allow_log(LEFT.pattern)
    ok, _ = H.send(n, 30000, "fs", size=100, per_request=1000)
    assert ok == 30000
    time.sleep(0.6)
    stop_fast(n)
    log = n.error_log()
    want = H.expected_datas(30000, "fs", 100, per_request=1000)
    delivered = collections.Counter(fake.datas())
    rep = reported(err_file)
    got = collections.Counter(d for _, d in rep)
    # every message is delivered or reported; only a batch that was in
    # flight (sent, not confirmed) may be both
    assert set(delivered) | set(got) == set(want)
    assert all(c == 1 for c in got.values())
    assert all(c == 1 for c in delivered.values())
    both = set(delivered) & set(got)
    assert all("not confirmed" in r for r, d in rep if d in both)
    assert len(got) > 0 and all(r.startswith("worker exiting") for r, _ in rep)
    # one line per worker with the count
    left = [int(x) for x in LEFT.findall(log)]
    assert 1 <= len(left) <= 2 and sum(left) == len(rep), log[-2000:]


UNREPORTED = re.compile(r"\[error\] (\d+)#\d+: \[loom\.publish\] (\d+) "
                        r"messages lost at worker exit without a report "
                        r"\(loom-proj/topic-1\): call .*exit_worker\(\)")


def test_fast_stop_without_exit_hook_says_how_many_were_lost(nginx, fake):
    # no exit_worker_by_lua: nothing can report the buffer on a fast stop,
    # but the loss is not silent: one line per worker with its count
    fake.default = ("slow", 0.5)
    n = H.publisher(nginx, {"emulator_host": fake.host,
                            "batch_max_delay": 60, "concurrency": 2},
                    workers=2, exit_hook=False)
    n.allow_log(UNREPORTED.pattern)
    pids = set(n.worker_pids())
    ok, _ = H.send(n, 30000, "nh", size=100, per_request=1000)
    assert ok == 30000
    time.sleep(0.6)
    stop_fast(n)
    lines = UNREPORTED.findall(n.error_log())
    # (one line per worker that held messages: the sends may all have
    # gone to one of them)
    got = [int(p) for p, _ in lines]
    assert got and len(got) == len(set(got)) and set(got) <= pids, \
        n.error_log()[-2000:]
    lost = sum(int(c) for _, c in lines)
    # what the sink got plus what was declared lost covers every message
    # (a batch in flight at the stop may be in both)
    assert 0 < lost <= 30000
    assert lost + fake.message_count >= 30000


def test_quit_without_exit_hook_reports_nothing_twice(nginx, fake):
    # a graceful exit drains (or reports) by itself: no "lost" line
    n = H.publisher(nginx, {"emulator_host": fake.host,
                            "batch_max_delay": 60}, workers=2,
                    exit_hook=False)
    ok, _ = H.send(n, 3000, "nq", per_request=1000)
    assert ok == 3000
    n.quit()
    assert fake.message_count == 3000
    assert "messages lost at worker exit" not in n.error_log()


# -- item: options refused before anything is made -------------------------

NUMBERS = ["timeout", "concurrency", "batch_max_messages", "batch_max_bytes",
           "batch_max_delay", "buffer_max_messages", "buffer_max_bytes",
           "retry_deadline", "retry_initial_backoff", "retry_max_backoff",
           "flush_timeout", "warn_interval"]

OPTIONS_LUA = """
location = /bad { content_by_lua_block {
    local cjson = require "cjson"
    local publish = require "resty.loom.publish"
    local base = { project = "p", topic = "topic-x",
                   emulator_host = "127.0.0.1:1" }
    local function with(extra)
        local o = {}
        for k, v in pairs(base) do o[k] = v end
        for k, v in pairs(extra) do o[k] = v end
        return o
    end
    local cases = {
        { "batch_size", with({ batch_size = 10 }) },
        { "concurrency 1.5", with({ concurrency = 1.5 }) },
        { "backoff order", with({ retry_initial_backoff = 20,
                                  retry_max_backoff = 10 }) },
        { "ssl_verify", with({ ssl_verify = "no" }) },
        { "empty credentials", { project = "p", topic = "topic-x",
                                 emulator_host = false, credentials = {} } },
        { "misspelled credentials", { project = "p", topic = "topic-x",
                                      emulator_host = false,
                                      credentials = { tokn = "abc" } } },
        { "credentials with emulator", with({ credentials = {
                                                  key_fle = "/x" } }) },
        { "credentials margin", { project = "p", topic = "topic-x",
                                  emulator_host = false,
                                  credentials = { token = "abc",
                                                  refresh_margin = 0/0 } } },
    }
    for _, name in ipairs(cjson.decode(ngx.unescape_uri(ngx.var.arg_numbers))) do
        for _, v in ipairs({ 0/0, 1/0, -1/0, 0, -1, "1" }) do
            cases[#cases + 1] = { name .. "=" .. tostring(v),
                                  with({ [name] = v }) }
        end
    end
    local out = {}
    for _, c in ipairs(cases) do
        local ok, err = pcall(publish.new, c[2])
        out[#out + 1] = { c[1], ok, ok and "" or tostring(err) }
    end
    ngx.say(cjson.encode({ results = out,
        publishers = publish.stats_all(1).publishers }))
} }
"""


def test_bad_options_refused_before_anything_is_made(nginx):
    n = nginx(workers=1, server=OPTIONS_LUA)
    r = n.get("/bad?numbers=" + urllib.parse.quote(json.dumps(NUMBERS)))
    assert r.status == 200, r
    out = r.json()
    res = {name: (ok, err) for name, ok, err in out["results"]}
    accepted = [name for name, (ok, _) in res.items() if ok]
    assert accepted == []

    def says(case, text):
        err = res[case][1]
        assert text in err, (case, err)
    says("batch_size", "opts.batch_size is not an option")
    says("concurrency 1.5", "opts.concurrency must be a whole number")
    says("backoff order", "opts.retry_initial_backoff must be at most "
                          "opts.retry_max_backoff")
    says("ssl_verify", "opts.ssl_verify must be a boolean")
    says("empty credentials", "opts.credentials must be a table with key, "
                              "key_file, token or type")
    says("misspelled credentials", "opts.credentials.tokn is not an option")
    says("credentials margin", "opts.credentials.refresh_margin must be")
    # unused with the emulator, still checked
    says("credentials with emulator",
         "opts.credentials.key_fle is not an option")
    for name in NUMBERS:
        for v in ("nan", "inf", "-inf", "0", "-1", "1"):
            case = [c for c in res if c.startswith(name + "=")
                    and c.split("=", 1)[1].replace("-nan", "nan") == v]
            assert case, (name, v, list(res))
            says(case[0], "opts.%s must be" % name)
    # nothing was registered by the refused calls
    assert out["publishers"] == {}


# -- item: permanent failures are not retried --------------------------------

def first_error(n, timeout=10):
    return H.wait_for(lambda: (lambda r: r if r["err_msgs"] else None)(
        H.results(n)), timeout)


def test_unresolvable_host_fails_at_once(nginx, fake):
    dns = FakeDNS({"known.test": "127.0.0.1"})
    try:
        n = H.publisher(nginx, {"endpoint": "http://unknown.test:%d"
                                % fake.port,
                                "credentials": {"type": "none"},
                                "batch_max_delay": 0.05},
                        workers=1, http="resolver %s ipv6=off;" % dns.addr)
        n.allow_log(r"could not be resolved")
        ok, _ = H.send(n, 20, "nx")
        assert ok == 20
        res = first_error(n)
        assert res and res["err_msgs"] == 20, res
        err = res["errors"][0]
        assert err["attempts"] == 1
        assert "could not be resolved (3: " in err["reason"]
        assert n.get("/stats").json()["retried"] == 0
        n.wait_log(r"publish failed: failed to connect: unknown.test could "
                   r"not be resolved .* \(20 messages given up\)")
    finally:
        dns.close()


def test_no_resolver_fails_at_once(nginx, fake):
    n = H.publisher(nginx, {"endpoint": "http://pubsub.test:%d" % fake.port,
                            "credentials": {"type": "none"},
                            "batch_max_delay": 0.05}, workers=1)
    n.allow_log(r"no resolver defined to resolve")
    ok, _ = H.send(n, 10, "nores")
    assert ok == 10
    res = first_error(n)
    assert res and res["err_msgs"] == 10, res
    assert res["errors"][0]["attempts"] == 1
    assert "no resolver defined" in res["errors"][0]["reason"]


def test_servfail_is_retried(nginx, fake):
    # a resolver in trouble is not the name missing: retried until the
    # deadline
    dns = FakeDNS("servfail")
    try:
        n = H.publisher(nginx, {"endpoint": "http://pubsub.test:%d"
                                % fake.port,
                                "credentials": {"type": "none"},
                                "batch_max_delay": 0.05,
                                "retry_deadline": 1,
                                "retry_initial_backoff": 0.05,
                                "retry_max_backoff": 0.1},
                        workers=1, http="resolver %s ipv6=off;" % dns.addr)
        n.allow_log(r"could not be resolved")
        ok, _ = H.send(n, 10, "sf")
        assert ok == 10
        res = first_error(n)
        assert res and res["errors"][0]["attempts"] > 2, res
        assert "retry deadline" in res["errors"][0]["reason"]
    finally:
        dns.close()


# -- item: long outages are logged, throttled ------------------------------

def test_outage_is_logged_throttled(nginx, fake):
    fake.default = F.error(503, "UNAVAILABLE")
    fake.script(*[F.error(429, "RESOURCE_EXHAUSTED")] * 3)
    n = H.publisher(nginx, {"emulator_host": fake.host,
                            "batch_max_delay": 0.05,
                            "retry_initial_backoff": 0.05,
                            "retry_max_backoff": 0.1,
                            "warn_interval": 1}, workers=1)
    ok, _ = H.send(n, 20, "out")
    assert ok == 20
    time.sleep(3.5)
    fake.default = "ok"
    assert fake.wait_messages(20, 10) == 20
    n.wait_log(r"publish recovered after \d+ s")
    log = n.error_log()
    first = re.findall(r"publish failed: status 429 RESOURCE_EXHAUSTED.* "
                       r"\(retrying\)", log)
    assert len(first) == 1
    summaries = re.findall(r"publish failing for \d+ s; in the last 1 s: "
                           r"(\d+) failed attempts \(([^)]*)\)", log)
    # about one per second over 3.5 s, never one per attempt
    assert 2 <= len(summaries) <= 4, log
    attempts = sum(int(a) for a, _ in summaries)
    assert attempts > len(summaries) * 3
    assert "status 503: " in summaries[-1][1]
    assert any("status 429: 2" in k for _, k in summaries)
    st = n.get("/stats").json()
    assert st["sent"] == 20 and st["failed"] == 0
    # lines for one batch: first + summaries + recovery, far below attempts
    lines = [l for l in log.splitlines() if "[loom.publish]" in l]
    assert len(lines) <= len(summaries) + 2 < st["retried"]


# -- item: the drain at exit keeps to its own budget ------------------------

def test_exit_drain_keeps_to_flush_timeout(nginx, fake, tmp_path):
    # the numbers of the docs' example: worker_shutdown_timeout 10 s,
    # flush_timeout 3 s, timeout 10 s; the sink never answers
    fake.default = ("hang", 30)
    err_file = str(tmp_path / "errors.jsonl")
    n = H.publisher(nginx, {"emulator_host": fake.host,
                            "batch_max_delay": 60, "timeout": 10,
                            "flush_timeout": 3, "err_file": err_file},
                    workers=1, shutdown_timeout="10s")
    ok, _ = H.send(n, 500, "ex")
    assert ok == 500
    t0 = time.time()
    n.quit()
    took = time.time() - t0
    # the drain ended on its own budget (3 s), well before nginx's 10 s
    assert took < 7, took
    n.wait_log(r"flushed at exit: sent 0, failed 500, dropped 0")
    rep = reported(err_file)
    assert sorted(d for _, d in rep) == sorted(H.expected_datas(500, "ex"))


def test_shutdown_timeout_cutting_the_drain_loses_nothing_silently(
        nginx, fake, tmp_path):
    # worker_shutdown_timeout (1 s) ends the graceful exit before the
    # flush budget (3 s) does: nginx closes the connections in flight and
    # the worker exits; what it still held is reported
    fake.default = ("hang", 30)
    err_file = str(tmp_path / "errors.jsonl")
    n = H.publisher(nginx, {"emulator_host": fake.host,
                            "batch_max_delay": 60, "flush_timeout": 3,
                            "concurrency": 2, "err_file": err_file},
                    workers=2, shutdown_timeout="1s")
    n.allow_log(LEFT.pattern)
    ok, _ = H.send(n, 5000, "cut", per_request=1000)
    assert ok == 5000
    n.quit()
    rep = reported(err_file)
    assert sorted(d for _, d in rep) == sorted(
        H.expected_datas(5000, "cut", per_request=1000))
    assert fake.message_count == 0
    # every worker says what it failed to deliver
    failed = re.findall(r"flushed at exit: sent 0, failed (\d+)",
                        n.error_log())
    assert len(failed) == 2 and sum(int(f) for f in failed) == 5000


# -- a callback that raises a table is logged readably ----------------------

def test_callback_error_table_logged_as_json_with_traceback(nginx, fake):
    n = nginx(workers=1, http="""
        exit_worker_by_lua_block {
            require("resty.loom.publish").exit_worker()
        }
        init_worker_by_lua_block {
            PUB = require("resty.loom.publish").new({
                project = "loom-proj", topic = "topic-1",
                emulator_host = "%s", batch_max_delay = 0.01,
                on_success = function(ids)
                    error({ code = 7, why = "tabled" })
                end,
            })
        }
    """ % fake.host, server="""
        location = /s { content_by_lua_block {
            ngx.say(PUB:send("x")) } }
    """)
    n.allow_log(r"callback failed")
    assert n.get("/s").text.strip() == "true"
    n.wait_log(r"callback failed: ")
    log = n.error_log()
    assert '"why":"tabled"' in log and '"code":7' in log, log[-2000:]
    assert "table: 0x" not in log
    assert "stack traceback" in log
