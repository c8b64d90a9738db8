"""The example gateway's publish area: publishes to the emulator when
PUBSUB_EMULATOR_HOST is set, and says publishing is off otherwise."""

import os
import time

import pytest

from pubsub import emulator as E

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
GW = os.path.join(ROOT, "examples", "gateway")

HTTP = """
include %s/conf.d/publish.http.conf;
init_by_lua_block {
    package.path = "%s/lua/?.lua;" .. package.path
}
init_worker_by_lua_block {
    require("gateway.publish").init_worker()
}
""" % (GW, GW)
SERVER = """
include %s/conf.d/publish.server.conf;
location /page { content_by_lua_block { ngx.say("page") } }
""" % GW


def test_gateway_without_emulator_says_off(nginx):
    n = nginx(workers=2, http=HTTP, server=SERVER)
    r = n.get("/loom/publish")
    assert r.status == 200
    # no publisher: absent from the figures, not an error
    assert r.json()["totals"] == {}
    assert all("publish" not in w for w in r.json()["workers"])
    r = n.post("/loom/publish/send", b"x")
    assert r.status == 503 and r.json()["enabled"] is False


@pytest.mark.skipif(E.unavailable() is not None,
                    reason=E.unavailable() or "")
def test_gateway_publishes_to_emulator(nginx):
    emu = E.shared()
    topic_url = emu.url + "/v1/projects/loom-gateway/topics/gateway-requests"
    emu.session.delete(topic_url, timeout=5)
    emu.session.delete(emu.url + "/v1/projects/loom-gateway/subscriptions/"
                       "gw-sub", timeout=5)
    n = nginx(workers=2, http=HTTP, server=SERVER,
              env={"PUBSUB_EMULATOR_HOST": emu.host})
    # the gateway creates its topic at start
    deadline = time.time() + 10
    while time.time() < deadline:
        r = emu.session.get(topic_url, timeout=5)
        if r.ok:
            break
        time.sleep(0.1)
    assert r.ok, r.text
    emu.create_subscription("loom-gateway", "gateway-requests", "gw-sub")
    for i in range(40):
        r = n.post("/loom/publish/send", b"event-%d" % i,
                   headers={"User-Agent": "loom-test"})
        assert r.status == 202 and r.json()["queued"] is True
    msgs = emu.pull("loom-gateway", "gw-sub", 40)
    assert sorted(m["data"] for m in msgs) == \
        sorted(b"event-%d" % i for i in range(40))
    assert all(m["attributes"]["user_agent"] == "loom-test"
               and m["attributes"]["method"] == "POST"
               and m["attributes"]["path"] == "/loom/publish/send"
               for m in msgs)
    # every other request publishes one message from the log phase
    for i in range(10):
        assert n.get("/page?n=%d" % i).status == 200
    msgs = emu.pull("loom-gateway", "gw-sub", 10)
    assert sorted(m["data"] for m in msgs) == \
        sorted(b"/page?n=%d" % i for i in range(10))
    assert all(m["attributes"]["method"] == "GET" for m in msgs)
    st = n.get("/loom/publish").json()
    pub = st["totals"]["publish"]["publishers"][
        "loom-gateway/gateway-requests"]
    assert pub["sent_total"] >= 1 and pub["failed_total"] == 0
    n.quit()
