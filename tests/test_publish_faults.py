"""resty.loom.publish against a fault-injecting fake Pub/Sub: transient
errors are retried until delivered, permanent ones reach the error callback
with the messages and the reason, order per key survives retries."""

import collections

import pytest

from pubsub import harness as H
from pubsub.fake import FakePubSub

F = FakePubSub


@pytest.fixture
def fake():
    f = FakePubSub()
    yield f
    f.close()


# a generous timeout: the machine running the tests may be busy, and a
# slow answer from the fake must not turn into an unplanned retry
BASE = {"batch_max_messages": 50, "batch_max_delay": 0.05,
        "retry_initial_backoff": 0.02, "retry_max_backoff": 0.2,
        "timeout": 4, "concurrency": 2}


def conf(fake, **kw):
    c = dict(BASE, emulator_host=fake.host)
    c.update(kw)
    return c


def test_transient_failures_are_retried(nginx, fake):
    fake.script(
        F.error(429, "RESOURCE_EXHAUSTED"), F.error(500, "INTERNAL"),
        F.error(503, "UNAVAILABLE"), F.raw(502, b"<html>bad gateway</html>"),
        F.raw(504, b""), "reset", "close", ("hang", 6),
        ("slow", 0.3), F.error(500, "UNKNOWN"), F.error(409, "ABORTED"),
        "ok_then_reset")
    n = H.publisher(nginx, conf(fake), workers=1)
    n.allow_log(r"Connection reset by peer")
    sent = 0
    for i in range(10):
        ok, errs = H.send(n, 60, "t%d" % i)
        assert ok == 60, errs
        sent += ok
    expected = set(H.expected_datas(60, "t0"))
    for i in range(1, 10):
        expected |= set(H.expected_datas(60, "t%d" % i))
    assert H.wait_for(lambda: set(fake.datas()) >= expected, 30)
    assert fake.pending_script() == 0
    # at-least-once: only the batch whose answer was lost may repeat (one
    # batch of 50; on a busy machine an answer slower than the timeout can
    # add one more)
    counts = collections.Counter(fake.datas())
    dup = [d for d, c in counts.items() if c > 1]
    assert len(dup) <= 100
    assert all(c <= 2 for c in counts.values())
    assert set(counts) == expected
    res = H.results(n)
    assert res["err_msgs"] == 0 and not res["errors"]
    st = n.get("/stats").json()
    # every fault but the slow answer costs a retry, except that a reset or
    # close on a reused keep-alive connection may be re-sent at once by the
    # HTTP client
    assert 9 <= st["retried"] <= 13
    assert st["failed"] == 0 and st["sent"] == len(expected) == 600


@pytest.mark.parametrize("action,status,words", [
    (F.raw(400, b"<html>not json</html>"), 400, "not json"),
    (F.error(400, "INVALID_ARGUMENT", "bad thing"), 400, "INVALID_ARGUMENT"),
    (F.error(403, "PERMISSION_DENIED", "nope"), 403, "PERMISSION_DENIED"),
    (F.error(404, "NOT_FOUND", "Topic not found"), 404, "Topic not found"),
])
def test_permanent_failures_reach_error_callback(nginx, fake, action,
                                                 status, words):
    fake.script(action)
    n = H.publisher(nginx, conf(fake), workers=1)
    ok, _ = H.send(n, 30, "p", attrs={"a": "b"})
    assert ok == 30
    res = H.wait_for(lambda: (lambda r: r if r["err_msgs"] else None)(
        H.results(n)))
    assert res["err_msgs"] == 30
    err = res["errors"][0]
    assert err["status"] == status
    assert err["attempts"] == 1
    assert "status %d" % status in err["reason"]
    assert words in err["reason"]
    assert sorted(d.encode() for d in err["datas"]) == \
        sorted(H.expected_datas(30, "p"))
    assert err["attrs"] == {"a": "b"}
    # not retried, and the publisher carries on
    assert len(fake.requests) == 1
    ok, _ = H.send(n, 5, "after")
    assert fake.wait_messages(5) == 5
    st = n.get("/stats").json()
    assert st["failed"] == 30 and st["sent"] == 5


@pytest.mark.parametrize("action", [
    # an HTTP status worth retrying with a canonical status Pub/Sub never
    # sends (a proxy's or load balancer's own error body)
    F.error(502, "BAD_GATEWAY"),
    F.error(503, "SERVICE_UNAVAILABLE"),
])
def test_transient_http_status_retried_whatever_the_body(nginx, fake,
                                                         action):
    fake.script(action)
    n = H.publisher(nginx, conf(fake), workers=1)
    ok, _ = H.send(n, 30, "t")
    assert ok == 30
    assert fake.wait_messages(30) == 30
    assert sorted(fake.datas()) == sorted(H.expected_datas(30, "t"))
    st = H.wait_for(lambda: (lambda s: s if s["sent"] == 30 else None)(
        n.get("/stats").json()))
    assert st and st["failed"] == 0 and st["retried"] == 1, st
    assert H.results(n)["err_msgs"] == 0


def test_retry_deadline_reports(nginx, fake):
    fake.default = F.error(503, "UNAVAILABLE")
    n = H.publisher(nginx, conf(fake, retry_deadline=1), workers=1)
    ok, _ = H.send(n, 20, "dl")
    assert ok == 20
    res = H.wait_for(lambda: (lambda r: r if r["err_msgs"] else None)(
        H.results(n)), 10)
    err = res["errors"][0]
    assert res["err_msgs"] == 20
    assert err["attempts"] > 2
    assert "retry deadline" in err["reason"] and "UNAVAILABLE" in err["reason"]
    assert len(fake.requests) == err["attempts"]
    assert fake.message_count == 0


def test_order_per_key_holds_across_retries(nginx, fake):
    fake.script(*([F.error(503, "UNAVAILABLE"), "ok", "reset", "ok",
                   ("slow", 0.2), F.raw(502, b"x")] * 4))
    n = H.publisher(nginx, conf(fake, batch_max_messages=20, concurrency=4),
                    workers=1)
    n.allow_log(r"Connection reset by peer")
    keys = ["a", "b", "c"]
    ok, errs = H.send(n, 600, "ord", keys=keys, per_request=200)
    assert ok == 600, errs
    assert fake.wait_messages(600, 30) >= 600
    expected = H.expected_datas(600, "ord", per_request=200)
    for idx, key in enumerate(keys):
        want = [d for i, d in enumerate(expected) if i % 200 % 3 == idx]
        got = [m["data"] for m in fake.messages if m["ordering_key"] == key]
        assert got == want
    assert fake.violations == []


def test_failed_ordering_key_pauses_until_resume(nginx, fake):
    n = H.publisher(nginx, conf(fake), workers=1, server="""
    location = /resume { content_by_lua_block {
        require("publish_helper").publisher():resume("k1")
        ngx.say("ok") } }""")
    fake.script(F.error(400, "INVALID_ARGUMENT", "poison"))
    ok, _ = H.send(n, 10, "first", keys=["k1"])
    assert ok == 10
    res = H.wait_for(lambda: (lambda r: r if r["err_msgs"] else None)(
        H.results(n)))
    assert res["errors"][0]["key"] == "k1"
    ok, errs = H.send(n, 5, "second", keys=["k1"])
    assert ok == 0 and errs == {"ordering key paused": 5}
    ok, _ = H.send(n, 5, "other", keys=["k2"])
    assert ok == 5
    assert fake.wait_messages(5) == 5
    n.get("/resume")
    ok, _ = H.send(n, 5, "third", keys=["k1"])
    assert ok == 5
    assert fake.wait_messages(10) == 10
    assert [m["data"] for m in fake.messages
            if m["ordering_key"] == "k1"] == H.expected_datas(5, "third")
