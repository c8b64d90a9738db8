"""Delivery by target, ordering, payload size limits."""

import eventsconf as ec


def start(nginx, workers=4, opts="", **kw):
    n = nginx(workers=workers, http=ec.http(opts), server=ec.SERVER, **kw)
    ec.wait_ready(n)
    return n


def test_all_others_current_worker(nginx):
    n = start(nginx)
    r = n.get("/ev/pub?target=all&n=100&source=a").json()
    assert r["ok"] == 100
    pub = r["worker"]
    ec.wait_totals(n, {w: 100 for w in range(4)})

    r = n.get("/ev/pub?target=others&n=50&source=o").json()
    pub = r["worker"]
    expect = {w: (100 if w == pub else 150) for w in range(4)}
    st = ec.wait_totals(n, expect)
    assert all(s["order_errors"] == 0 for s in st.values())

    r = n.get("/ev/pub?target=2&n=30&source=d").json()
    expect[2] += 30
    ec.wait_totals(n, expect)

    r = n.get("/ev/pub?target=current&n=7&source=c").json()
    expect[r["worker"]] += 7
    st = ec.wait_totals(n, expect)
    for s in st.values():
        assert s["order_errors"] == 0
        assert s["stats"]["gaps"] == 0
        assert s["stats"]["duplicates"] == 0


def test_unique_delivered_once(nginx):
    n = start(nginx)
    # the same unique key from many requests (landing on any worker)
    for _ in range(20):
        assert n.get("/ev/pub?target=unique:k1&n=1&source=u").json()["ok"]
    st = ec.wait_totals(n, {})
    import time
    time.sleep(0.5)
    st = ec.states(n)
    assert sum(s["total"] for s in st.values()) == 1
    # different keys are each delivered once
    for i in range(10):
        n.get("/ev/pub?target=unique:key%d&n=1&source=u" % i)
    time.sleep(0.5)
    st = ec.states(n)
    assert sum(s["total"] for s in st.values()) == 11


def test_payload_16mib_and_too_large(nginx):
    n = start(nginx, workers=2, opts="max_payload = 20 * 1024 * 1024,"
              " max_queue_bytes = 128 * 1024 * 1024")
    size = 16 * 1024 * 1024
    r = n.get("/ev/pub?target=all&n=1&size=%d" % size, timeout=30).json()
    assert r["ok"] == 1
    st = ec.wait_totals(n, {0: 1, 1: 1}, timeout=30)
    for s in st.values():
        assert s["sizes"] == [size]
    r = n.get("/ev/pub?target=all&n=1&size=%d" % (21 * 1024 * 1024),
              timeout=30).json()
    assert r["ok"] == 0 and r["errors"] == {"payload too large": 1}
