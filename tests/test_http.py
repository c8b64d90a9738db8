"""resty.loom.http on its own: keep-alive, body framings, stale connections,
timeouts, TLS verification."""

import json
import os
import socket
import ssl
import tempfile
import threading
import time

import pytest

from loomtest.nginx import close_listener
from pubsub import certs


class RawServer:
    """A TCP server that hands each connection to handler(conn, server)."""

    def __init__(self, handler, tls=None):
        self.handler = handler
        self.connections = 0
        self.requests = []
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.ctx = None
        if tls:
            self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.ctx.load_cert_chain(*tls)
        self.stopped = False
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        while not self.stopped:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(c,),
                             daemon=True).start()

    def _serve(self, c):
        try:
            if self.ctx:
                c = self.ctx.wrap_socket(c, server_side=True)
            self.handler(c, self)
        except (OSError, ssl.SSLError):
            pass
        finally:
            try:
                c.close()
            except OSError:
                pass

    def close(self):
        self.stopped = True
        close_listener(self.sock)


def read_request(c, buf=b""):
    """Reads one request; returns (request_line, headers, body, rest)."""
    while b"\r\n\r\n" not in buf:
        d = c.recv(65536)
        if not d:
            return None, None, None, b""
        buf += d
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {}
    for line in lines[1:]:
        k, v = line.split(":", 1)
        headers[k.strip().lower()] = v.strip()
    n = int(headers.get("content-length", 0))
    while len(rest) < n:
        rest += c.recv(65536)
    return lines[0], headers, rest[:n], rest[n:]


def keepalive_handler(responses):
    """Answers each request on a connection with the next of responses
    (callables taking the request and returning bytes, or bytes)."""
    def handler(c, srv):
        rest = b""
        while True:
            line, headers, body, rest = read_request(c, rest)
            if line is None:
                return
            with srv.lock:
                srv.requests.append((line, headers, body))
                i = len(srv.requests) - 1
            r = responses[min(i, len(responses) - 1)]
            if callable(r):
                r = r(line, headers, body)
            if r is None:
                return
            c.sendall(r)
            framed = (b"Content-Length" in r or b"chunked" in r
                      or b" 204 " in r)
            if b"Connection: close" in r or not framed:
                return
    return handler


def ok(body=b"hello", extra=b""):
    return (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s"
            % (len(body), extra, body))


LUA_CLIENT = """
location = /t { content_by_lua_block {
    local cjson = require "cjson"
    local http = require "resty.loom.http"
    local args = ngx.req.get_uri_args()
    local c = http.new({ host = "127.0.0.1", port = tonumber(args.port),
        scheme = args.scheme or "http",
        read_timeout = tonumber(args.rt or 5),
        ssl_verify = args.verify ~= "0",
        server_name = args.sni })
    local out = {}
    for i = 1, tonumber(args.n or 1) do
        local body = args.body
        if args.split then
            body = { "part1-", "part2" }
        end
        local res, err = c:request(args.method or "GET", "/r" .. i,
                                   { ["X-Test"] = "v" .. i }, body)
        if res then
            out[i] = { status = res.status, body = res.body,
                       reused = res.reused,
                       ctype = res.headers["content-type"] }
        else
            out[i] = { err = err }
        end
        if args.pause then
            ngx.sleep(tonumber(args.pause))
        end
    end
    ngx.say(cjson.encode({ results = out, connects = c.connects,
                           reuses = c.reuses }))
} }
"""


def run(ngx_, **args):
    q = "&".join("%s=%s" % kv for kv in args.items())
    r = ngx_.get("/t?" + q, timeout=20)
    assert r.status == 200, r
    return r.json()


@pytest.fixture
def ngx(nginx):
    return nginx(workers=1, server=LUA_CLIENT)


def test_keepalive_reuses_one_connection(ngx):
    srv = RawServer(keepalive_handler([ok(b"a" * 10)]))
    try:
        res = run(ngx, port=srv.port, n=5)
        assert [r["body"] for r in res["results"]] == ["a" * 10] * 5
        assert [r["reused"] for r in res["results"]] == [0, 1, 2, 3, 4]
        assert srv.connections == 1
        assert res["connects"] == 1
        # the request carried our header, the Host and the path
        line, headers, _ = srv.requests[2]
        assert line == "GET /r3 HTTP/1.1"
        assert headers["x-test"] == "v3"
        assert headers["host"] == "127.0.0.1:%d" % srv.port
    finally:
        srv.close()


def test_body_framings(ngx):
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
               b"Content-Type: text/x\r\n\r\n"
               b"5\r\nhello\r\n1;ext=1\r\n \r\n5\r\nworld\r\n0\r\n"
               b"Trailer: x\r\n\r\n")
    no_content = b"HTTP/1.1 204 No Content\r\n\r\n"
    until_close = b"HTTP/1.1 200 OK\r\n\r\nuntil the end"
    srv = RawServer(keepalive_handler(
        [chunked, no_content, ok(b""), until_close]))
    try:
        res = run(ngx, port=srv.port, n=4)["results"]
        assert res[0] == {"status": 200, "body": "hello world",
                          "reused": 0, "ctype": "text/x"}
        assert res[1]["status"] == 204 and res[1]["body"] == ""
        assert res[1]["reused"] == 1
        assert res[2]["status"] == 200 and res[2]["body"] == ""
        assert res[3]["body"] == "until the end"
    finally:
        srv.close()


def test_post_body_and_content_length(ngx):
    srv = RawServer(keepalive_handler(
        [lambda line, h, body: ok(b"got " + body)]))
    try:
        res = run(ngx, port=srv.port, method="POST", body="abc")
        assert res["results"][0]["body"] == "got abc"
        assert srv.requests[0][1]["content-length"] == "3"
        res = run(ngx, port=srv.port, method="POST", split=1)
        assert res["results"][0]["body"] == "got part1-part2"
    finally:
        srv.close()


def test_connection_close_and_stale_keepalive(ngx):
    # 1st answer closes explicitly, 2nd is kept alive by us but the server
    # then hangs up silently: the 3rd request must retry on a new
    # connection and succeed
    def handler(c, srv):
        rest = b""
        while True:
            line, headers, body, rest = read_request(c, rest)
            if line is None:
                return
            with srv.lock:
                srv.requests.append(line)
                i = len(srv.requests)
            if i == 1:
                c.sendall(ok(b"one", b"Connection: close\r\n"))
                return
            c.sendall(ok(b"r%d" % i))
            if i == 2:
                return      # silent close of a kept-alive connection
    srv = RawServer(handler)
    try:
        res = run(ngx, port=srv.port, n=3, pause="0.2")
        bodies = [r.get("body") for r in res["results"]]
        assert bodies == ["one", "r2", "r3"], res
        assert res["results"][2]["reused"] == 0
        assert srv.connections == 3
    finally:
        srv.close()


def test_read_timeout_and_refused(ngx):
    def silent(c, srv):
        read_request(c)
        time.sleep(3)
    srv = RawServer(silent)
    try:
        res = run(ngx, port=srv.port, rt=1)
        assert res["results"][0]["err"] == "failed to read response: timeout"
    finally:
        srv.close()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    res = run(ngx, port=port)
    assert res["results"][0]["err"].startswith("failed to connect: ")


@pytest.fixture(scope="module")
def pki():
    d = tempfile.mkdtemp(prefix="loom-pki-")
    ca, ca_key, ca_path = certs.make_ca(d)
    cert, key = certs.make_server_cert(d, ca, ca_key)
    _, _, other_ca = certs.make_ca(d, "other CA")
    return {"ca": ca_path, "cert": cert, "key": key, "other": other_ca}


def test_tls_verification(nginx, pki):
    srv = RawServer(keepalive_handler([ok(b"secure")]),
                    tls=(pki["cert"], pki["key"]))
    try:
        good = nginx(workers=1, server=LUA_CLIENT, http="""
            lua_ssl_trusted_certificate %s;
            lua_ssl_verify_depth 3;""" % pki["ca"])
        res = run(good, port=srv.port, scheme="https", n=2)
        assert [r.get("body") for r in res["results"]] == ["secure"] * 2, res
        assert res["connects"] == 1
        # a name the certificate does not carry
        res = run(good, port=srv.port, scheme="https", sni="evil.example")
        assert "failed to handshake" in res["results"][0]["err"]

        bad = nginx(workers=1, server=LUA_CLIENT, http="""
            lua_ssl_trusted_certificate %s;""" % pki["other"])
        res = run(bad, port=srv.port, scheme="https")
        err = res["results"][0]["err"]
        assert err.startswith("failed to handshake: "), err
        assert "certificate" in err
        # explicitly unverified works (and is never the default)
        res = run(bad, port=srv.port, scheme="https", verify="0")
        assert res["results"][0]["body"] == "secure"
    finally:
        srv.close()


def test_parse_url_and_bad_options(nginx):
    n = nginx(workers=1, server="""
    location = /p { content_by_lua_block {
        local cjson = require "cjson"
        local http = require "resty.loom.http"
        local out = {}
        for _, u in ipairs({ "https://a.example/x?y=1", "http://h:8080",
                             "http://[::1]:81/p", "ftp://x/", "nohost",
                             "http://:80/" }) do
            local s, h, p, path = http.parse_url(u)
            out[#out + 1] = { s or cjson.null, h, p or cjson.null,
                              path or cjson.null }
        end
        local ok, err = pcall(http.new, { host = "x", port = 0 })
        out[#out + 1] = { ok, err }
        ok, err = pcall(http.new, { host = "x", scheme = "gopher" })
        out[#out + 1] = { ok, err }
        for _, o in ipairs({ { host = "x", read_timout = 1 },
                             { host = "x", port = 0/0 },
                             { host = "x", port = 80.5 },
                             { host = "x", pool_size = 0/0 },
                             { host = "x", timeout = 1/0 },
                             { host = "x", connect_timeout = 0 },
                             { host = "x", read_timeout = 1e8 },
                             { host = "x", keepalive_timeout = 1e8 },
                             { host = "x", ssl_verify = "no" },
                             { host = "x", max_body = -1 } }) do
            ok, err = pcall(http.new, o)
            out[#out + 1] = { ok, err }
        end
        -- a request's own timeout: refused at the call
        local c = http.new({ host = "127.0.0.1", port = 1 })
        for _, t in ipairs({ 0/0, 0, -1, 1/0, 1e8, "5" }) do
            ok, err = pcall(c.request, c, "GET", "/", nil, nil, t)
            out[#out + 1] = { ok, err }
        end
        for _, o in ipairs({ { url = "ftp://x/" }, { port = 80 } }) do
            ok, err = pcall(http.new, o)
            out[#out + 1] = { ok, err }
        end
        -- request_uri's options: refused before anything is sent
        for _, o in ipairs({ { tiemout = 1 }, { timeout = 0/0 },
                             { method = 1 } }) do
            ok, err = pcall(http.request_uri, "http://127.0.0.1:1/", o)
            out[#out + 1] = { ok, err }
        end
        ngx.say(cjson.encode(out))
    } }""")
    out = n.get("/p").json()
    assert out[0] == ["https", "a.example", 443, "/x?y=1"]
    assert out[1] == ["http", "h", 8080, "/"]
    assert out[2] == ["http", "::1", 81, "/p"]
    assert out[3][0] is None and "unsupported scheme" in out[3][1]
    assert out[4][0] is None and "no scheme" in out[4][1]
    assert out[5][0] is None and "no host" in out[5][1]
    assert out[6][0] is False and "opts.port" in out[6][1]
    assert out[7][0] is False and "opts.scheme" in out[7][1]
    want = ["opts.read_timout is not an option", "opts.port must be",
            "opts.port must be", "opts.pool_size must be",
            "opts.timeout must be", "opts.connect_timeout must be",
            "opts.read_timeout must be", "opts.keepalive_timeout must be",
            "opts.ssl_verify must be a boolean", "opts.max_body must be"]
    want += ["timeout must be a number of seconds"] * 6
    want += ["opts.url must be an http:// or https:// URL",
             "opts.host is required", "opts.tiemout is not an option",
             "opts.timeout must be a number above 0 and at most 86400",
             "opts.method must be a non-empty string"]
    for (ok_, err), text in zip(out[8:], want):
        assert ok_ is False and text in err, (err, text)
    assert len(out) == 8 + len(want)


NAMED_CLIENT = """
location = /named { content_by_lua_block {
    local cjson = require "cjson"
    local http = require "resty.loom.http"
    local args = ngx.req.get_uri_args()
    local c = http.new({ host = args.host, port = tonumber(args.port),
                         timeout = tonumber(args.timeout) })
    local t0 = ngx.now()
    local res, err, permanent = c:request("GET", "/")
    ngx.update_time()
    ngx.say(cjson.encode({ status = res and res.status, err = err,
                           permanent = permanent or false,
                           elapsed = ngx.now() - t0 }))
} }
"""


def named(n, host, port, timeout):
    r = n.get("/named?host=%s&port=%d&timeout=%s" % (host, port, timeout),
              timeout=60)
    assert r.status == 200, r
    return r.json()


def test_timeout_covers_a_resolver_that_never_answers(nginx):
    from pubsub.dns import FakeDNS
    dns = FakeDNS("silent")
    try:
        # (an abandoned lookup holds a graceful exit until resolver_timeout:
        # 6 s keeps the test short and still far above the request's 1 s)
        n = nginx(workers=1, server=NAMED_CLIENT, http="""
            resolver %s ipv6=off;
            resolver_timeout 6s;""" % dns.addr)
        res = named(n, "never.test", 80, 1)
        assert res["err"] == "failed to connect: timeout", res
        assert res["permanent"] is False
        # the one-second limit, not the resolver's 6 s (slack for a busy
        # machine)
        assert 0.9 <= res["elapsed"] < 4, res
        assert "never.test" in dns.queries
        # the worker is fine afterwards: a second lookup is cut the same way
        res = named(n, "never2.test", 80, 0.5)
        assert res["err"] == "failed to connect: timeout", res
        assert res["elapsed"] < 4, res
        n.quit()
    finally:
        dns.close()


def test_resolution_failures_say_whether_they_are_permanent(nginx):
    from pubsub.dns import FakeDNS
    srv = RawServer(keepalive_handler([ok(b"named")]))
    nx = FakeDNS({"good.test": "127.0.0.1"})
    sf = FakeDNS("servfail")
    try:
        n = nginx(workers=1, server=NAMED_CLIENT, http="""
            resolver %s ipv6=off;""" % nx.addr)
        res = named(n, "good.test", srv.port, 5)
        assert res.get("status") == 200 and "err" not in res, res
        res = named(n, "missing.test", srv.port, 5)
        assert "could not be resolved (3: " in res["err"], res
        assert res["permanent"] is True
        n2 = nginx(workers=1, server=NAMED_CLIENT, http="""
            resolver %s ipv6=off;""" % sf.addr)
        res = named(n2, "any.test", srv.port, 5)
        assert "could not be resolved (2: " in res["err"], res
        assert res["permanent"] is False
        n3 = nginx(workers=1, server=NAMED_CLIENT)
        n3.allow_log(r"no resolver defined to resolve")
        res = named(n3, "any.test", srv.port, 5)
        assert "no resolver defined" in res["err"], res
        assert res["permanent"] is True
    finally:
        srv.close()
        nx.close()
        sf.close()


def test_pooled_connections_to_a_name_spawn_no_thread(nginx):
    # a light thread lives in its request's memory until the request ends
    # (a publisher's timer runs for days): only a connect that may resolve
    # a name gets one, not one per request on a kept-alive connection
    from pubsub.dns import FakeDNS
    srv = RawServer(keepalive_handler([ok(b"k")]))
    dns = FakeDNS({"keep.test": "127.0.0.1"})
    try:
        n = nginx(workers=1, http="resolver %s ipv6=off;" % dns.addr,
                  server="""
        location = /t { content_by_lua_block {
            local spawn = ngx.thread.spawn
            local spawned = 0
            ngx.thread.spawn = function(...)
                spawned = spawned + 1
                return spawn(...)
            end
            package.loaded["resty.loom.http"] = nil
            local http = require "resty.loom.http"
            ngx.thread.spawn = spawn
            local c = http.new({ host = "keep.test",
                                 port = tonumber(ngx.var.arg_port) })
            local bodies = 0
            for i = 1, 50 do
                local res = c:request("GET", "/")
                if res and res.body == "k" then
                    bodies = bodies + 1
                end
            end
            ngx.say(bodies, " ", spawned, " ", c.connects)
        } }""")
        r = n.get("/t?port=%d" % srv.port)
        assert r.text.split() == ["50", "1", "1"], r.text
    finally:
        srv.close()
        dns.close()
