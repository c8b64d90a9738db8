"""The example gateway as a user puts it in front of traffic (issue 19,
section 3): large bodies, configuration that outlives HUP and restarts,
JSON errors with the right status, flame graphs that are valid SVG."""

import os
import signal
import socket
import time
import xml.etree.ElementTree as ET

from loomtest.gateway import Gateway
from loomtest.nginx import ROOT

MiB = 1024 * 1024


def raw(gateway, data):
    """Sends raw bytes, returns (status, headers, body) of the answer."""
    with socket.create_connection(("127.0.0.1", gateway.port), 10) as s:
        s.sendall(data)
        buf = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def json_error(r, status):
    assert r.status == status, (r.status, r.text)
    assert r.headers["Content-Type"] == "application/json"
    err = r.json()["error"]
    assert isinstance(err, str) and err
    return err


def seen_by_every_worker(gateway, key, value, workers=2, timeout=10):
    seen = set()
    deadline = time.time() + timeout
    while len(seen) < workers:
        assert time.time() < deadline, "seen by %r only" % sorted(seen)
        r = gateway.get("/config/" + key)
        if r.status == 200:
            body = r.json()
            if body["value"] == value:
                seen.add(body["worker"])
        time.sleep(0.02)
    return body["version"]


def test_config_of_1_mib_reaches_every_worker(gateway):
    value = (b"0123456789abcdef" * (MiB // 16)).decode()
    r = gateway.request("PUT", "/config/big", body=value.encode())
    assert r.status == 200, r.text
    seen_by_every_worker(gateway, "big", value)


def test_body_over_the_limit_is_413_json(gateway):
    gateway.allow_log(r"client intended to send too large body")
    status, headers, body = raw(
        gateway, b"PUT /config/huge HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n"
                 % (5 * MiB))
    assert status == 413
    assert headers["Content-Type"] == "application/json"
    assert b'"error"' in body


def test_version_answers_as_the_readme_says(gateway):
    # the README's curl right after `make run`
    r = gateway.get("/version")
    from test_packaging import VERSION
    assert (r.status, r.text) == (200, VERSION + "\n")


def test_unknown_path_is_404_json(gateway):
    assert json_error(gateway.get("/loom/nope"), 404) == "not found"
    json_error(gateway.get("/config/missing"), 404)


def test_wrong_method_is_405_with_allow(gateway):
    r = gateway.request("POST", "/loom/events", body=b"x")
    json_error(r, 405)
    assert r.headers["Allow"] == "GET"
    r = gateway.request("DELETE", "/config/a")
    json_error(r, 405)
    assert r.headers["Allow"] == "GET, PUT"
    r = gateway.request("GET", "/loom/publish/send")
    json_error(r, 405)
    assert r.headers["Allow"] == "POST"
    assert gateway.request("HEAD", "/loom/events").status == 200


def test_bad_requests_are_400_json(gateway):
    json_error(gateway.get("/offload/hash?data=x&rounds=0"), 400)
    json_error(gateway.get("/loom/demo/block?socket_ms=-1"), 400)
    # nginx's own 400: a request with two Host headers
    status, headers, body = raw(
        gateway, b"GET /loom/events HTTP/1.1\r\nHost: a\r\nHost: b\r\n"
                 b"Connection: close\r\n\r\n")
    assert status == 400
    assert headers["Content-Type"] == "application/json"
    assert b'{"error":"bad request"}' in body


def wait_new_workers(gateway, old, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        pids = [p for p in gateway.worker_pids() if p not in old]
        if len(pids) == 2:
            return pids
        time.sleep(0.05)
    raise AssertionError("no new workers: %r" % gateway.worker_pids())


def test_config_survives_hup_and_restart():
    g = Gateway().start()
    try:
        g.request("PUT", "/config/upstream", body=b"10.0.0.1:80")
        r = g.request("PUT", "/config/upstream", body=b"10.0.0.2:80")
        assert r.json()["version"] == 2
        seen_by_every_worker(g, "upstream", "10.0.0.2:80")
        time.sleep(0.2)           # worker 0 saves after it applied it
        old = g.worker_pids()
        os.kill(g.proc.pid, signal.SIGHUP)
        wait_new_workers(g, old)
        assert seen_by_every_worker(g, "upstream", "10.0.0.2:80") == 2
    finally:
        g.stop()
    assert not g.bad_log_lines()

    # a restart on the same prefix: the value and its version go on
    again = Gateway()
    again.prefix = g.prefix
    again.env["LOOM_GATEWAY_PREFIX"] = g.prefix
    again.start()
    try:
        assert seen_by_every_worker(again, "upstream", "10.0.0.2:80") == 2
        r = again.request("PUT", "/config/upstream", body=b"10.0.0.3:80")
        assert r.json()["version"] == 3
        seen_by_every_worker(again, "upstream", "10.0.0.3:80")
    finally:
        again.stop()
    assert not again.bad_log_lines()


def test_flame_graphs_are_valid_svg(gateway):
    # both workers block once, so whichever answers has a report
    for _ in range(4):
        gateway.get("/loom/demo/block?cpu_ms=120&socket_ms=0")
    time.sleep(0.3)
    for path in ("/loom/blocking?format=svg", "/loom/timers/flamegraph.svg"):
        r = gateway.get(path)
        assert r.status == 200, (path, r.status)
        assert r.headers["Content-Type"] == "image/svg+xml"
        root = ET.fromstring(r.body)          # raises on anything after </svg>
        assert root.tag == "{http://www.w3.org/2000/svg}svg", root.tag
    gateway.allow_log(r"event loop blocked")


def test_lua_error_is_500_json(nginx):
    n = nginx(workers=1, http="""
    init_by_lua_block {
        package.path = "%(root)s/examples/gateway/lua/?.lua;" .. package.path
    }""" % {"root": ROOT}, server="""
    include %s/examples/gateway/conf.d/errors.server.conf;
    location = /boom { content_by_lua_block { error("boom") } }
    """ % ROOT)
    n.allow_log(r"boom")
    r = n.get("/boom")
    assert json_error(r, 500) == "internal server error"
