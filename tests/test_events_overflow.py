"""Overflow policies, their counters and log lines."""

import time

import eventsconf as ec


def start(nginx, opts):
    n = nginx(workers=2, http=ec.http(opts), server=ec.SERVER)
    ec.wait_ready(n)
    return n


def test_reject_policy(nginx):
    n = start(nginx, 'max_queue = 100, overflow = "reject"')
    # one request publishes 1000 without yielding: the writer cannot drain
    r = n.get("/ev/pub?target=all&n=1000&settle=1").json()
    assert r["ok"] == 100
    assert r["errors"] == {"queue full": 900}
    st = ec.wait_totals(n, {0: 100, 1: 100})
    pub = st[r["worker"]]["stats"]
    # (a stats request right after the flood may be refused as well)
    assert list(pub["dropped"]) == ["queue full"]
    assert pub["dropped"]["queue full"] >= 900
    for s in st.values():
        assert s["order_errors"] == 0
    # logged once per interval, not once per event
    assert n.error_log().count("queue full: publish refused") == 1


def test_drop_oldest_policy(nginx):
    n = start(nginx, 'max_queue = 100, overflow = "drop_oldest"')
    # event 1 is delivered, then 2..1001 are published without yielding:
    # 2..901 are dropped to make room, 902..1001 arrive
    r = n.get("/ev/pub?target=all&n=1000&start=2&warm=1").json()
    assert r["ok"] == 1000
    st = ec.wait_totals(n, {0: 101, 1: 101})
    # (a stats request racing the flood may itself be refused: not counted)
    assert st[r["worker"]]["stats"]["dropped"]["oldest"] == 900
    for s in st.values():
        # every drop is visible to the subscribers as a gap
        assert s["stats"]["gaps"] == 900
        assert s["order_errors"] == 1
        # and the resync hook heard of it
        assert s["gap_calls"] == {str(r["worker"]): 900}
    assert n.error_log().count("queue full: dropped the oldest") == 1
    assert n.error_log().count("gap: 900 event(s)") == 2


def test_wait_policy_slows_the_publisher(nginx):
    n = start(nginx, 'max_queue = 100, overflow = "wait"')
    r = n.get("/ev/pub?target=all&n=5000").json()
    assert r["ok"] == 5000 and r["errors"] == {}
    st = ec.wait_totals(n, {0: 5000, 1: 5000})
    for s in st.values():
        assert s["order_errors"] == 0
        assert s["stats"]["gaps"] == 0


STALL = """
    if ngx.worker.id() == 1 then
        require("resty.loom.events").get():subscribe("slow", "e",
            function(data)
                if data.n == 50 then ngx.sleep(%s) end
            end)
    end
"""


def test_slow_handler_back_pressure_no_loss(nginx):
    """A handler that stalls for less than slow_timeout: everything waits,
    nothing is lost."""
    n = nginx(workers=2, http=ec.http('max_queue = 50, overflow = "wait",'
                                      ' wait_timeout = 10',
                                      extra_worker=STALL % "1.0"),
              server=ec.SERVER)
    ec.wait_ready(n)
    r = n.get("/ev/pub?target=1&n=600&source=slow&size=16384", timeout=30).json()
    assert r["ok"] == 600
    st = ec.wait_totals(n, {0: 0, 1: 600}, timeout=20)
    assert st[1]["stats"]["gaps"] == 0
    assert st[1]["order_errors"] == 0
    assert st[0]["stats"]["broker"]["dropped"] == {}
