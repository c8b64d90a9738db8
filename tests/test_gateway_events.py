"""The example gateway's events features: replicated config and stats."""

import json
import time


def test_config_replicated_to_every_worker(gateway):
    r = gateway.request("PUT", "/config/upstream", body=b"10.0.0.1:80")
    assert r.status == 200, r.text
    version = r.json()["version"]
    seen = {}
    deadline = time.time() + 10
    while len(seen) < 2 and time.time() < deadline:
        r = gateway.get("/config/upstream")
        if r.status == 200:
            body = r.json()
            assert body["value"] == "10.0.0.1:80"
            assert body["version"] == version
            seen[body["worker"]] = body
    assert sorted(seen) == [0, 1]
    r = gateway.request("PUT", "/config/upstream", body=b"10.0.0.2:80")
    assert r.json()["version"] == version + 1
    assert gateway.get("/config/missing").status == 404
    assert gateway.request("DELETE", "/config/upstream").status == 405


def test_events_stats_from_all_workers(gateway):
    gateway.request("PUT", "/config/a", body=b"1")
    time.sleep(0.2)
    r = gateway.get("/loom/events")
    assert r.status == 200
    workers = r.json()["workers"]
    assert [w["id"] for w in workers] == [0, 1]
    assert all(w["events"]["connected"] for w in workers)
    assert workers[0]["events"]["broker"]["accepted_total"] >= 2
    json.dumps(workers)
