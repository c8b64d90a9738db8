"""nginx configuration snippets for events tests."""

import json
import time


def http(opts="", extra_init="", extra_worker=""):
    return """
    init_by_lua_block {
        require("events_helper").init({ %s })
        %s
    }
    init_worker_by_lua_block {
        require("events_helper").init_worker()
        %s
    }
    server {
        listen unix:$PREFIX/sock/bus.sock;
        lua_socket_buffer_size 64k;
        location / {
            content_by_lua_block { require("resty.loom.events").get():serve() }
        }
    }
    """ % (opts, extra_init, extra_worker)


SERVER = """
    location /ev/ { content_by_lua_block { require("events_helper").handle() } }
"""


def states(n, tries=400):
    """The helper's state of every worker: through the bus's collect() once
    it is up, else by asking until each worker has answered over HTTP."""
    seen = {}
    for _ in range(tries):
        r = n.get("/ev/collect")
        if r.status == 200:
            got = {int(k): v for k, v in r.json().items()}
            if len(got) == n.workers:
                return got
        s = n.get("/ev/state").json()
        seen[s["worker"]] = s
        if len(seen) == n.workers:
            return seen
    raise AssertionError("only workers %r answered" % sorted(seen))


def wait_ready(n, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = states(n)
        if all(s["ready"] for s in st.values()):
            return st
        time.sleep(0.05)
    raise AssertionError("bus not ready: %s" % json.dumps(
        {w: s["stats"] for w, s in states(n).items()}))


def wait_totals(n, expect, timeout=15):
    """Waits until every worker's total received equals expect[worker]."""
    deadline = time.time() + timeout
    while True:
        st = states(n)
        got = {w: s["total"] for w, s in st.items()}
        if all(got.get(w) == c for w, c in expect.items()):
            return st
        if time.time() > deadline:
            raise AssertionError("totals %r, expected %r" % (got, expect))
        time.sleep(0.05)
