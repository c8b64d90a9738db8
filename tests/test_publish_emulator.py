"""resty.loom.publish against Google's real Pub/Sub emulator: nginx
publishes, the test pulls and checks every message."""

import collections
import json
import uuid

import pytest

from pubsub import emulator as E
from pubsub import harness as H

REASON = E.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

PROJECT = "loom-proj"


@pytest.fixture
def emu():
    return E.shared()


@pytest.fixture
def topic(emu):
    name = "topic-" + uuid.uuid4().hex[:10]
    emu.create_topic(PROJECT, name)
    emu.create_subscription(PROJECT, name, name + "-sub")
    return name


SEND = """
location = /seq { content_by_lua_block {
    -- every worker numbers its messages per ordering key
    local p = require("publish_helper").publisher()
    local args = ngx.req.get_uri_args()
    local keys = { "alpha", "beta", "gamma", "" }
    local w = tostring(ngx.worker.id())
    _G.seq = _G.seq or {}
    local ok = 0
    for i = 1, tonumber(args.n) do
        local key = keys[i % #keys + 1]
        local s = (_G.seq[key] or 0) + 1
        _G.seq[key] = s
        local data = string.format("w%s|%s|%06d|", w, key, s)
            .. string.rep(string.char(i % 256), i % 300)
        if p:send(data, { worker = w, seq = tostring(s), kind = "t\\"q",
                          ["uni-ключ"] = "значение" }, key) then
            ok = ok + 1
        end
    end
    ngx.say(ok)
} }
"""


def test_publish_and_pull_everything(nginx, emu, topic):
    n = H.publisher(nginx, {"topic": topic, "emulator_host": emu.host,
                            "batch_max_messages": 100,
                            "batch_max_delay": 0.05, "record_ids": True},
                    workers=2, server=SEND)
    total = 0
    for _ in range(20):
        r = n.get("/seq?n=100")
        assert r.status == 200
        total += int(r.text)
    assert total == 2000
    msgs = emu.pull(PROJECT, topic + "-sub", total)
    assert len(msgs) == total
    assert len({m["messageId"] for m in msgs}) == total

    per = collections.defaultdict(list)
    for m in msgs:
        w, key, seq, rest = m["data"].split(b"|", 3)
        seq = int(seq)
        i_byte = rest[:1]
        assert rest == i_byte * len(rest)
        a = m["attributes"]
        assert a["worker"] == w.decode()[1:]
        assert a["seq"] == str(seq)
        assert a["kind"] == 't"q'
        assert a["uni-ключ"] == "значение"
        assert m.get("orderingKey", "") == key.decode()
        per[(w, key)].append((int(m["messageId"]), seq))
    # per worker and key: every number once, and in publish order
    for (w, key), items in per.items():
        seqs = [s for _, s in sorted(items)]
        assert sorted(seqs) == list(range(1, len(seqs) + 1))
        if key:
            assert seqs == sorted(seqs), (w, key)
    # the success callbacks saw exactly the emulator's message IDs
    res = H.wait_for(lambda: (lambda r: r if r["ok_ids"] == total else None)(
        H.results(n)))
    assert res, H.results(n)
    ids = {i for e in res["ids"] for i in e["ids"]}
    assert ids == {m["messageId"] for m in msgs}


def test_missing_topic_reports_not_found(nginx, emu):
    n = H.publisher(nginx, {"topic": "no-such-topic",
                            "emulator_host": emu.host,
                            "batch_max_delay": 0.05}, workers=1)
    ok, _ = H.send(n, 5, "nf")
    assert ok == 5
    res = H.wait_for(lambda: (lambda r: r if r["err_msgs"] else None)(
        H.results(n)))
    assert res["err_msgs"] == 5
    err = res["errors"][0]
    assert err["status"] == 404 and "NOT_FOUND" in err["reason"]
    assert err["attempts"] == 1


def test_large_messages_split_by_bytes(nginx, emu, topic):
    # 40 messages of 300 KB: far below the count limit, so only the byte
    # limit keeps each request under Pub/Sub's 10 MB
    n = H.publisher(nginx, {"topic": topic, "emulator_host": emu.host,
                            "batch_max_bytes": 2000000,
                            "batch_max_delay": 0.05}, workers=1)
    ok, errs = H.send(n, 40, "big", size=300000, per_request=10)
    assert ok == 40, errs
    msgs = emu.pull(PROJECT, topic + "-sub", 40)
    assert sorted(m["data"] for m in msgs) == \
        sorted(H.expected_datas(40, "big", 300000, per_request=10))
    st = n.get("/stats").json()
    assert st["batches"] >= 40 * 400000 // 2000000
    assert st["failed"] == 0
    assert json.dumps(st)
