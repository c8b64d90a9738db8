"""resty.loom.publish at worker exit: QUIT and HUP reload with a full
buffer deliver everything, or report what they could not."""

import re

import pytest

from pubsub import harness as H
from pubsub.fake import FakePubSub

FLUSHED = re.compile(r"flushed at exit: sent (\d+), failed (\d+), "
                     r"dropped (\d+)")
LEFT = re.compile(r"(\d+) messages not delivered at worker exit")


@pytest.fixture
def fake():
    f = FakePubSub()
    yield f
    f.close()


def held(fake, **kw):
    # batches only leave by count (1000) or at exit: the delay is 60 s
    c = {"emulator_host": fake.host, "batch_max_delay": 60,
         "flush_timeout": 3}
    c.update(kw)
    return c


def test_quit_flushes_full_buffer(nginx, fake):
    n = H.publisher(nginx, held(fake), workers=2)
    ok, _ = H.send(n, 2500, "q", size=200, per_request=100)
    assert ok == 2500
    fake.default = ("slow", 0.2)
    n.quit()
    assert fake.message_count == 2500
    assert sorted(fake.datas()) == sorted(
        H.expected_datas(2500, "q", 200, per_request=100))
    sent = [int(m[0]) for m in FLUSHED.findall(n.error_log())]
    assert len(sent) == 2 and sum(sent) == 2500


def test_hup_reload_flushes_and_keeps_serving(nginx, fake):
    n = H.publisher(nginx, held(fake), workers=2)
    ok, _ = H.send(n, 1500, "h1", per_request=100)
    assert ok == 1500
    n.reload()
    # the old generation flushed on its way out
    assert fake.wait_messages(1500, 10) == 1500
    n.wait_log(FLUSHED.pattern, count=2)
    # and the new one publishes
    ok, _ = H.send(n, 300, "h2", per_request=100)
    assert ok == 300
    n.quit()
    assert fake.message_count == 1800
    want = H.expected_datas(1500, "h1", per_request=100) + \
        H.expected_datas(300, "h2", per_request=100)
    assert sorted(fake.datas()) == sorted(want)


def test_quit_with_sink_down_reports_everything(nginx, fake):
    fake.default = FakePubSub.error(503, "UNAVAILABLE")
    n = H.publisher(nginx, held(fake, flush_timeout=1,
                               retry_initial_backoff=0.05,
                               retry_max_backoff=0.2), workers=2)
    n.allow_log(r"messages not delivered at worker exit")
    ok, _ = H.send(n, 2300, "down", per_request=100)
    assert ok == 2300
    n.quit()
    log = n.error_log()
    flushed = FLUSHED.findall(log)
    assert len(flushed) == 2
    assert sum(int(s) for s, _, _ in flushed) == 0
    # every message was either handed to the error callback (failed) or,
    # once the budget was spent, counted in the exit report
    failed = sum(int(f) for _, f, _ in flushed)
    assert failed == 2300
    assert fake.message_count == 0
    assert len(fake.requests) >= 2


def test_quit_budget_spent_reports_leftovers(nginx, fake):
    # the sink hangs longer than the flush budget: what is still queued
    # when the budget runs out is reported, not silently lost
    fake.default = ("hang", 3)
    n = H.publisher(nginx, held(fake, flush_timeout=0.5, timeout=1,
                               concurrency=1, batch_max_messages=100),
                    workers=1)
    n.allow_log(r"messages not delivered at worker exit")
    ok, _ = H.send(n, 1000, "left", per_request=100)
    assert ok == 1000
    n.quit()
    log = n.error_log()
    sent, failed, _ = (int(x) for x in FLUSHED.search(log).groups())
    left = sum(int(x) for x in LEFT.findall(log))
    assert sent == 0 and failed == 1000
    assert 0 < left <= 1000


def test_hup_reload_flushes_30000(nginx, fake):
    # 30,000 messages held in two workers (the sink slow): a reload sends
    # them all within the flush budget
    fake.default = ("slow", 0.1)
    n = H.publisher(nginx, held(fake), workers=2)
    ok, _ = H.send(n, 30000, "big", size=100, per_request=1000)
    assert ok == 30000
    n.reload()
    assert fake.wait_messages(30000, 20) == 30000
    n.wait_log(FLUSHED.pattern, count=2)
    sent = [int(m[0]) for m in FLUSHED.findall(n.error_log())]
    assert sum(sent) == 30000
    assert sorted(fake.datas()) == sorted(
        H.expected_datas(30000, "big", 100, per_request=1000))
