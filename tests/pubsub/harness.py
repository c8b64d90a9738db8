"""nginx configs for the publish tests: one publisher per worker built by
tests/lua/publish_helper.lua from a JSON config."""

import json
import time

SERVER = """
location = /send { content_by_lua_block {
    require("publish_helper").send() } }
location = /results { content_by_lua_block {
    require("publish_helper").results() } }
location = /stats { content_by_lua_block {
    require("publish_helper").stats() } }
location = /flush { content_by_lua_block {
    require("publish_helper").publisher():flush() ngx.say("ok") } }
location = /stats_all { content_by_lua_block {
    ngx.say(require("cjson").encode(
        require("resty.loom.publish").stats_all(1))) } }
"""


EXIT_HOOK = """
        exit_worker_by_lua_block {
            require("resty.loom.publish").exit_worker()
        }"""


def publisher(nginx, conf, workers=2, http="", server="", exit_hook=True,
              **kw):
    conf = dict(conf)
    conf.setdefault("project", "loom-proj")
    conf.setdefault("topic", "topic-1")
    blob = json.dumps(conf)
    assert "]==]" not in blob
    n = nginx(workers=workers, http="""
        lua_shared_dict pubtest 4m;
        lua_shared_dict loom_publish 1m;
        %s
        init_worker_by_lua_block {
            require("publish_helper").init_worker([==[%s]==])
        }
        %s
    """ % (http, blob, EXIT_HOOK if exit_hook else ""),
        server=SERVER + server, **kw)
    return n


def send(n, count, prefix, size=0, attrs=None, keys=None, per_request=None):
    """Sends count generated messages; returns how many send() accepted."""
    per_request = per_request or count
    ok = 0
    errors = {}
    i = 0
    while i < count:
        c = min(per_request, count - i)
        body = {"count": c, "prefix": "%s-%d" % (prefix, i), "size": size}
        if attrs is not None:
            body["attrs"] = attrs
        if keys is not None:
            body["keys"] = keys
        r = n.post("/send", json.dumps(body).encode())
        assert r.status == 200, r
        res = r.json()
        ok += res["ok"]
        for k, v in res["errors"].items():
            errors[k] = errors.get(k, 0) + v
        i += c
    return ok, errors


def send_messages(n, messages):
    r = n.post("/send", json.dumps({"messages": messages}).encode())
    assert r.status == 200, r
    return r.json()


def expected_datas(count, prefix, size=0, per_request=None):
    per_request = per_request or count
    out = []
    i = 0
    while i < count:
        c = min(per_request, count - i)
        p = "%s-%d" % (prefix, i)
        for j in range(1, c + 1):
            d = "%s-%08d-" % (p, j)
            if len(d) < size:
                d += "x" * (size - len(d))
            out.append(d.encode())
        i += c
    return out


def results(n):
    r = n.get("/results")
    assert r.status == 200, r
    return r.json()


def wait_for(fn, timeout=15, interval=0.05):
    deadline = time.time() + timeout
    while True:
        v = fn()
        if v or time.time() > deadline:
            return v
        time.sleep(interval)
