"""GET /loom/metrics of the example gateway, checked by the real tools:
promtool's linter and a Prometheus server that scrapes it every second."""

import http.client
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request

import pytest

from loomtest.gateway import Gateway
from loomtest.nginx import free_port
from pubsub.fake import FakePubSub

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$')


@pytest.fixture
def gw():
    """The example gateway publishing to a fake Pub/Sub (as its emulator)."""
    fake = FakePubSub()
    g = Gateway(env={"PUBSUB_EMULATOR_HOST": fake.host})
    # the fake has no topic admin API: the gateway says so and goes on
    g.allow_log(r"cannot create topic")
    g.start()
    try:
        yield g
    finally:
        g.stop()
        fake.close()
    bad = g.bad_log_lines()
    assert not bad, "\n".join(bad[:20])


def put_config(g, count):
    conn = http.client.HTTPConnection("127.0.0.1", g.port, timeout=10)
    try:
        for i in range(count):
            conn.request("PUT", "/config/k", body=b"%d" % i)
            r = conn.getresponse()
            r.read()
            assert r.status == 200
    finally:
        conn.close()


def workload(g):
    put_config(g, 20)
    assert g.get("/offload/hash?data=x&rounds=5").status in (200, 503)
    assert g.get("/loom/demo/block?cpu_ms=120&socket_ms=10").status == 200
    time.sleep(1.2)     # heartbeats, a batch published


def parse(text):
    """{family: type}, [(name, labels, value)]; asserts the format's rules."""
    assert text.endswith("\n")
    types, helps, samples, seen = {}, set(), [], set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helps.add(line.split(" ")[2])
        elif line.startswith("# TYPE "):
            _, _, name, typ = line.split(" ")
            assert name not in types, "two TYPE lines for " + name
            types[name] = typ
        else:
            m = SAMPLE.match(line)
            assert m, line
            key = (m.group(1), m.group(2))
            assert key not in seen, "duplicate series " + line
            seen.add(key)
            samples.append((m.group(1), m.group(2) or "", float(m.group(3))))
    assert set(types) == helps
    return types, samples


def test_metrics_pass_promtool(gw):
    if not PROMTOOL:
        pytest.skip("promtool not found (Debian package prometheus)")
    workload(gw)
    r = gw.get("/loom/metrics")
    assert r.status == 200
    assert r.headers["Content-Type"] == \
        "text/plain; version=0.0.4; charset=utf-8"
    p = subprocess.run([PROMTOOL, "check", "metrics"], input=r.body,
                       capture_output=True, timeout=30)
    assert (p.returncode, p.stdout, p.stderr) == (0, b"", b""), p
    types, samples = parse(r.text)
    for fam, typ in [
            ("loom_events_delivery_seconds", "histogram"),
            ("loom_timers_lateness_seconds", "histogram"),
            ("loom_timers_run_seconds", "histogram"),
            ("loom_watchdog_iteration_seconds", "histogram"),
            ("loom_publish_latency_seconds", "histogram"),
            ("loom_offload_call_seconds", "histogram"),
            ("loom_offload_queue_wait_seconds", "histogram"),
            ("loom_events_dropped_total", "counter"),
            ("loom_events_gaps_total", "counter"),
            ("loom_events_ring_events_total", "counter"),
            ("loom_events_ring_held_bytes", "gauge"),
            ("loom_timers_dropped_total", "counter"),
            ("loom_offload_rejected_total", "counter"),
            ("loom_offload_late_total", "counter"),
            ("loom_offload_reclaimed_total", "counter"),
            ("loom_offload_misused_total", "counter"),
            ("loom_events_broker_dropped_total", "counter"),
            ("loom_events_broker_urgent_missed_total", "counter"),
            ("loom_watchdog_stalls_total", "counter"),
            ("loom_watchdog_reports_dropped_total", "counter"),
            ("loom_publish_failed_total", "counter"),
            ("loom_publish_dropped_total", "counter")]:
        assert types.get(fam) == typ, fam
    for name, labels, _ in samples:
        assert name.startswith("loom_")
        assert re.search(r'worker="[01]"', labels), (name, labels)
    # values as a person reads them: at most 15 significant digits (no
    # float noise such as 17.886000156402588), uptime in milliseconds
    for line in r.text.splitlines():
        if not line.startswith("#"):
            value = line.rsplit(" ", 1)[1]
            digits = re.sub(r"e.*$", "", value).lstrip("-").replace(".", "")
            assert len(digits.lstrip("0")) <= 15, line
            if line.startswith("loom_worker_uptime_seconds"):
                assert re.match(r"^\d+(\.\d{1,3})?$", value), line
    # histograms: cumulative buckets, +Inf equal to _count
    by = {}
    for name, labels, v in samples:
        if name.endswith("_bucket"):
            key = (name[:-7], re.sub(r',le="[^"]*"', "", labels))
            by.setdefault(key, []).append(v)
    counts = {(n[:-6], lab): v for n, lab, v in samples
              if n.endswith("_count")}
    assert by
    for key, vals in by.items():
        assert vals == sorted(vals), key
        assert vals[-1] == counts[key], key
    stalls = sum(v for n, _, v in samples
                 if n == "loom_watchdog_stalls_total")
    assert stalls >= 1


def query(port, q):
    url = "http://127.0.0.1:%d/api/v1/query?%s" % (
        port, urllib.parse.urlencode({"query": q}))
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_query(port, q, want, timeout=20):
    deadline = time.time() + timeout
    got = None
    while time.time() < deadline:
        try:
            got = query(port, q)
        except OSError:
            got = None          # still starting
        if got is not None and want(got):
            return got
        time.sleep(0.25)
    raise AssertionError("%s: %r" % (q, got))


def test_prometheus_scrapes_the_gateway(gw):
    if not PROMETHEUS:
        pytest.skip("prometheus not found (Debian package prometheus)")
    data = tempfile.mkdtemp(prefix="loom-prom-")
    port = free_port()
    conf = os.path.join(data, "prometheus.yml")
    with open(conf, "w") as f:
        f.write("""
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: loom
    metrics_path: /loom/metrics
    static_configs:
      - targets: ["127.0.0.1:%d"]
""" % gw.port)
    log = open(os.path.join(data, "prometheus.log"), "w")
    prom = subprocess.Popen(
        [PROMETHEUS, "--config.file=" + conf,
         "--storage.tsdb.path=" + os.path.join(data, "tsdb"),
         "--web.listen-address=127.0.0.1:%d" % port],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        put_config(gw, 1000)
        # every worker handled the 1,000 config events
        res = wait_query(port, "loom_events_delivered_total",
                         lambda r: len(r) == 2 and all(
                             s["value"][1] == "1000" for s in r))
        assert sorted(s["metric"]["worker"] for s in res) == ["0", "1"]
        assert all(s["metric"]["job"] == "loom" for s in res)
        wait_query(port, "count(loom_worker_up == 1)",
                   lambda r: r and r[0]["value"][1] == "2")
        # one message published per request: the 1,000 PUTs at least
        wait_query(port, "sum(loom_publish_sent_total)",
                   lambda r: r and float(r[0]["value"][1]) >= 1000)
        wait_query(port, "sum(loom_publish_failed_total)",
                   lambda r: r and r[0]["value"][1] == "0")
        res = wait_query(
            port, "histogram_quantile(0.99, sum by (le) "
                  "(loom_events_delivery_seconds_bucket))",
            lambda r: r and r[0]["value"][1] not in ("NaN", "+Inf"))
        assert 0 < float(res[0]["value"][1]) <= 10
        # named timers: the gateway's heartbeat runs every second
        wait_query(port, 'loom_timers_named_runs_total'
                         '{name="gateway.heartbeat"} >= 1',
                   lambda r: len(r) == 2)
        # bucket bounds are written as they are read: selectors match
        res = query(port, 'loom_events_delivery_seconds_bucket{le="0.0025"}')
        assert len(res) == 2
        up = query(port, 'up{job="loom"}')
        assert up and up[0]["value"][1] == "1"
    finally:
        prom.terminate()
        try:
            prom.wait(10)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()
        log.close()
        shutil.rmtree(data, ignore_errors=True)


RENDER = r"""
    location = /render {
        content_by_lua_block {
            local prom = require "resty.loom.status.prometheus"
            local hist = require "resty.loom.status.hist"
            local h = hist.rebin(function(i) return i end, 1, 3,
                function(i) return i / 1000 end,
                function(i) return (i + 1) / 1000 end)
            ngx.print(prom.render({ workers = {
                { id = 0, uptime_s = 1.5, lua_memory_bytes = 0 / 0,
                  publish = { publishers = {
                      ['a "quoted\\ name\nwith a newline'] = {
                          sent_total = 7, latency_seconds = h },
                      -- not UTF-8: a byte alone, a cut sequence, a
                      -- surrogate; then a valid two-byte character
                      ["x\255y\226\130z\237\160\128 \195\169"] = {
                          sent_total = 1 } } } },
                { id = 1, error = "timeout" },
            } }))
        }
    }
"""


def test_render_escapes_labels_and_odd_values(nginx):
    if not PROMTOOL:
        pytest.skip("promtool not found (Debian package prometheus)")
    n = nginx(workers=1, server=RENDER)
    body = n.get("/render").body
    text = body.decode("utf-8")         # strict: the format is UTF-8
    p = subprocess.run([PROMTOOL, "check", "metrics"], input=body,
                       capture_output=True, timeout=30)
    assert (p.returncode, p.stderr) == (0, b""), (p, text)
    name = r'publisher="a \"quoted\\ name\nwith a newline"'
    assert 'loom_publish_sent_total{worker="0",%s} 7' % name in text
    bad = "x\ufffdy\ufffd\ufffdz\ufffd\ufffd\ufffd \u00e9"
    assert 'loom_publish_sent_total{worker="0",publisher="%s"} 1' % bad \
        in text
    assert 'loom_worker_lua_memory_bytes{worker="0"} NaN' in text
    assert 'loom_worker_up{worker="1"} 0' in text
    # values 1, 2, 3 (x1, x2, x3) in the buckets around 1.5, 2.5, 3.5 ms
    assert ('loom_publish_latency_seconds_bucket{worker="0",%s,le="0.0025"}'
            ' 3' % name) in text
    assert ('loom_publish_latency_seconds_bucket{worker="0",%s,le="0.005"}'
            ' 6' % name) in text
    assert 'loom_publish_latency_seconds_count{worker="0",%s} 6' % name \
        in text
    # families with no series are left out
    assert "loom_events_" not in text and "loom_timers" not in text
