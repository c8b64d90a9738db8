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
    assert sorted(st["workers"]) == ["0", "1"]
    for w in st["workers"].values():
        assert w["names"]["gateway.heartbeat"]["runs"] >= 1
        assert w["runners"]["alive"] >= 1
        assert w["timers"] >= 2
    hb = st["total"]["names"]["gateway.heartbeat"]
    assert hb["runs"] == sum(w["names"]["gateway.heartbeat"]["runs"]
                             for w in st["workers"].values())
    assert hb["pending"] == 2
    assert hb["lateness"]["count"] == hb["runs"]
    assert st["total"]["timers"] == sum(w["timers"]
                                        for w in st["workers"].values())


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
    assert total <= sum(s["runs"] for s in st["total"]["sites"].values())
    assert total > 0
