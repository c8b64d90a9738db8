"""resty.loom.publish against the fake Pub/Sub: batching by count, bytes
and delay, ordering keys, validation of bad input, buffer bounds, stats."""

import json

import pytest

from pubsub import harness as H
from pubsub.fake import FakePubSub


@pytest.fixture
def fake():
    f = FakePubSub()
    yield f
    f.close()


def test_batches_cut_by_count(nginx, fake):
    n = H.publisher(nginx, {"emulator_host": fake.host,
                            "batch_max_messages": 100,
                            "batch_max_delay": 30}, workers=1)
    ok, errs = H.send(n, 1000, "c", per_request=1000)
    assert ok == 1000, errs
    assert fake.wait_messages(1000) == 1000
    assert [r["n"] for r in fake.requests] == [100] * 10
    assert sorted(fake.datas()) == sorted(H.expected_datas(1000, "c"))
    assert H.wait_for(lambda: n.get("/stats").json()["sent"] == 1000)
    st = n.get("/stats").json()
    assert st["batches"] == 10
    assert st["mean_batch_size"] == 100
    assert st["buffered_messages"] == 0 and st["failed"] == 0
    assert st["latency"]["count"] == 1000
    assert st["connections"] <= st["http_requests"] == 10


def test_batches_cut_by_bytes(nginx, fake):
    n = H.publisher(nginx, {"emulator_host": fake.host,
                            "batch_max_bytes": 20000,
                            "batch_max_delay": 30}, workers=1)
    ok, errs = H.send(n, 300, "b", size=1000, attrs={"k": "v"})
    assert ok == 300, errs
    # 300 messages of ~1.4 KB never reach the count limit: only the byte
    # limit cuts them (the last partial batch waits for its delay)
    n.get("/flush")
    assert fake.wait_messages(300) == 300
    sizes = [r["bytes"] for r in fake.requests]
    assert all(s <= 20000 for s in sizes), sizes
    assert len(sizes) >= 300 * 1400 // 20000
    assert all(r["n"] > 1 for r in fake.requests)
    assert sorted(fake.datas()) == sorted(H.expected_datas(300, "b", 1000))
    assert all(m["attributes"] == {"k": "v"} for m in fake.messages)


def test_quiet_topic_flushes_by_delay(nginx, fake):
    n = H.publisher(nginx, {"emulator_host": fake.host,
                            "batch_max_delay": 0.2}, workers=1)
    ok, _ = H.send(n, 3, "q")
    assert ok == 3
    # nothing else is sent: only the delay can cut this batch
    assert fake.wait_messages(3, timeout=10) == 3
    assert [r["n"] for r in fake.requests] == [3]


def test_ordering_keys_never_mixed_and_ordered(nginx, fake):
    n = H.publisher(nginx, {"emulator_host": fake.host,
                            "batch_max_messages": 40,
                            "batch_max_delay": 0.05,
                            "concurrency": 4}, workers=1)
    keys = ["k1", "k2", "", "k3", ""]
    ok, errs = H.send(n, 1000, "o", keys=keys, per_request=250)
    assert ok == 1000, errs
    assert fake.wait_messages(1000) == 1000
    assert fake.violations == []
    for r in fake.requests:
        assert len(r["keys"]) == 1
    expected = H.expected_datas(1000, "o", per_request=250)
    for key in ("k1", "k2", "k3"):
        want = [d for i, d in enumerate(expected)
                if keys[i % 250 % len(keys)] == key]
        got = [m["data"] for m in fake.messages if m["ordering_key"] == key]
        assert got == want
    unordered = [m["data"] for m in fake.messages if m["ordering_key"] == ""]
    assert len(unordered) == 400


BAD = [
    ({"data": 42}, "data must be a string"),
    ({"attributes": {}}, "message needs data or attributes"),
    ({"data": ""}, "message needs data or attributes"),
    ({"data": "x", "attributes": "a=b"}, "attributes must be a table"),
    ({"data": "x", "attributes": {"k": 1}},
     "attribute value must be a string"),
    ({"data": "x", "attributes": {"k" * 257: "v"}},
     "attribute key must be 1 to 256 bytes"),
    ({"data": "x", "attributes": {"": "v"}},
     "attribute key must be 1 to 256 bytes"),
    ({"data": "x", "attributes": {"googkey": "v"}},
     "attribute key must not start with goog"),
    ({"data": "x", "attributes": {"k": "v" * 1025}},
     "attribute value too long"),
    ({"data": "x", "attributes": {"k%d" % i: "v" for i in range(101)}},
     "too many attributes"),
    # send() takes the first four attributes and the rest by different
    # paths: a bad one among more than four
    ({"data": "x", "attributes": dict({"k%d" % i: "v" for i in range(6)},
                                      bad=1)},
     "attribute value must be a string"),
    ({"data": "x", "attributes": dict({"k%d" % i: "v" for i in range(6)},
                                      googx="v")},
     "attribute key must not start with goog"),
    ({"data": "x", "key": 7}, "ordering key must be a string"),
    ({"data": "x", "key": "k" * 1025}, "ordering key too long"),
]


def test_bad_input_rejected_alone(nginx, fake):
    n = H.publisher(nginx, {"emulator_host": fake.host,
                            "batch_max_delay": 0.05}, workers=1)
    good = [
        {"data": "good-1"},
        {"data": "good-2", "attributes": {"k" * 256: "v" * 1024,
                                          "quote\"\\": "é\n\t",
                                          "uni": "snow \u2603"}},
        {"attributes": {"only": "attrs"}},
        {"data": "good-4", "key": "k" * 1024,
         "attributes": {"k%d" % i: "v" for i in range(100)}},
    ]
    messages = []
    for i, (m, _) in enumerate(BAD):
        messages.append(m)
        if i < len(good):
            messages.append(good[i])
    res = H.send_messages(n, messages)
    assert res["ok"] == len(good)
    want = {}
    for _, err in BAD:
        want[err] = want.get(err, 0) + 1
    assert res["errors"] == want
    assert fake.wait_messages(len(good)) == len(good)
    assert fake.violations == []
    got = {m["data"]: m for m in fake.messages}
    assert got[b"good-2"]["attributes"] == good[1]["attributes"]
    assert got[b""]["attributes"] == {"only": "attrs"}
    assert got[b"good-4"]["ordering_key"] == "k" * 1024
    assert len(got[b"good-4"]["attributes"]) == 100


def test_bad_lua_values_and_utf8(nginx, fake):
    n = H.publisher(nginx, {"emulator_host": fake.host,
                            "batch_max_delay": 0.05}, workers=1,
                    server="""
    location = /lua { content_by_lua_block {
        local p = require("publish_helper").publisher()
        local out = {}
        local function try(...)
            local ok, err = p:send(...)
            out[#out + 1] = ok and "ok" or err
        end
        try({}, nil)
        try("x", { [1] = "v" })
        try("x", { k = { "nested" } })
        try("x", { k = "bad \\255 utf8" })
        try("x", { ["bad \\192\\128"] = "v" })
        try("x", nil, "bad \\237\\160\\128 surrogate")
        try("x", { k = true })
        try(string.rep("z", 10000001))
        try(string.rep("z", 7600000))
        try("binary \\0\\1\\255 is fine in data", nil, "")
        ngx.say(require("cjson").encode(out))
    } }""")
    out = n.get("/lua").json()
    assert out == [
        "data must be a string",
        "attribute key must be a string",
        "attribute value must be a string",
        "attribute value must be valid UTF-8",
        "attribute key must be valid UTF-8",
        "ordering key must be valid UTF-8",
        "attribute value must be a string",
        "message too large",
        "message too large",
        "ok",
    ]
    assert fake.wait_messages(1) == 1
    assert fake.messages[0]["data"] == b"binary \0\1\xff is fine in data"


def test_buffer_full_reject(nginx, fake):
    n = H.publisher(nginx, {"emulator_host": fake.host,
                            "buffer_max_messages": 100,
                            "batch_max_delay": 30}, workers=1)
    ok, errs = H.send(n, 150, "r")
    assert ok == 100 and errs == {"buffer full": 50}
    st = n.get("/stats").json()
    assert st["rejected"] == 50 and st["buffered_messages"] == 100
    n.get("/flush")
    assert fake.wait_messages(100) == 100
    assert sorted(fake.datas()) == sorted(H.expected_datas(100, "r"))


def test_buffer_bytes_drop_oldest(nginx, fake):
    n = H.publisher(nginx, {"emulator_host": fake.host,
                            "buffer_max_messages": 1000,
                            "buffer_max_bytes": 100 * 1400,
                            "overflow": "drop_oldest",
                            "batch_max_messages": 30,
                            "batch_max_delay": 30}, workers=1)
    # batches fill to 30 and are sealed, but the fake holds them back so
    # the buffer overflows by bytes while batches wait
    fake.default = ("slow", 1.5)
    ok, errs = H.send(n, 400, "d", size=1000)
    assert ok == 400, errs
    st = n.get("/stats").json()
    assert st["dropped"] > 0
    assert st["buffered_bytes"] <= 100 * 1400
    fake.default = "ok"
    n.get("/flush")
    total = 400 - st["dropped"]
    assert H.wait_for(
        lambda: n.get("/stats").json()["buffered_messages"] == 0, 20)
    assert fake.message_count == total
    # what was dropped is the oldest of what was still queued: every
    # delivered message is unique, and the newest ones all made it
    datas = fake.datas()
    assert len(set(datas)) == len(datas) == total
    assert set(H.expected_datas(400, "d", 1000)[-50:]) <= set(datas)


def test_stats_all_and_callbacks(nginx, fake):
    n = H.publisher(nginx, {"emulator_host": fake.host,
                            "batch_max_delay": 0.05, "record_ids": True},
                    workers=2)
    total = 0
    for i in range(20):
        ok, _ = H.send(n, 50, "s%d" % i)
        total += ok
    assert total == 1000
    assert fake.wait_messages(1000) == 1000
    res = H.wait_for(lambda: (lambda r: r if r["ok_ids"] == 1000 else None)(
        H.results(n)))
    assert res, H.results(n)
    ids = [i for entry in res["ids"] for i in entry["ids"]]
    assert sorted(ids, key=int) == sorted(fake.ids, key=int)
    st = n.get("/stats_all").json()
    pub = st["publishers"]["loom-proj/topic-1"]
    # without an events bus the figures are this worker's; with one, all
    if st["workers"] == 2:
        assert pub["sent"] == 1000
    else:
        assert 0 < pub["sent"] <= 1000
    assert pub["latency"]["count"] == pub["sent"]
    assert pub["latency"]["p50"] <= pub["latency"]["p99"]
