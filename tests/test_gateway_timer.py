"""The example gateway's timer endpoints: /loom/timers and its flame graph."""

import time
import xml.etree.ElementTree as ET


def test_timer_stats_from_all_workers(gateway):
    time.sleep(1.3)                 # one heartbeat per worker at least
    r = gateway.get("/loom/timers")
    assert r.status == 200
    assert r.headers["Content-Type"] == "application/json"
    st = r.json()
    assert st["source"] == "events"
    workers = [w["timers"] for w in st["workers"]]
    assert [w["id"] for w in st["workers"]] == [0, 1]
    for w in workers:
        assert w["names"]["gateway.heartbeat"]["runs_total"] >= 1
        assert w["timers"] >= 2
    hb = st["totals"]["timers"]["names"]["gateway.heartbeat"]
    assert hb["runs_total"] == sum(w["names"]["gateway.heartbeat"]
                                   ["runs_total"] for w in workers)
    assert hb["pending"] == 2
    assert hb["lateness_seconds"]["count"] == hb["runs_total"]
    assert st["totals"]["timers"]["timers"] == sum(w["timers"]
                                                   for w in workers)


def test_timer_flamegraph(gateway):
    time.sleep(1.2)
    r = gateway.get("/loom/timers/flamegraph.svg?metric=runs")
    assert r.status == 200
    assert r.headers["Content-Type"] == "image/svg+xml"
    root = ET.fromstring(r.body)
    ns = "{http://www.w3.org/2000/svg}"
    titles = [t.text for t in root.iter(ns + "title")]
    assert any("gateway/timer.lua" in t for t in titles), titles
    folded = gateway.get("/loom/timers/flamegraph.svg?format=folded"
                         "&metric=runs").text
    total = sum(int(ln.rsplit(" ", 1)[1]) for ln in folded.splitlines())
    st = gateway.get("/loom/timers").json()
    assert total <= st["totals"]["timers"]["runs_total"]
    assert total > 0
