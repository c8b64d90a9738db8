"""A fault-injecting fake of Google Pub/Sub's REST publish endpoint, with an
OAuth token endpoint and a GCE metadata endpoint, for tests. (Its fast mode,
the benchmark's sink, is sink.py.)

    fake = FakePubSub(tls=(cert, key))          # or tls=None for plain HTTP
    fake.script(fake.error(503, "UNAVAILABLE"), "reset", "ok")
    ... nginx publishes to fake.url ...
    fake.messages    # accepted messages: {"data", "attributes", "ordering_key"}
    fake.requests    # every publish request: {"n", "keys", "auth", "action"}
    fake.close()

Actions (consumed one per publish request, then `default`): "ok", "reset"
(RST after reading the request), "close" (FIN, no response), "ok_then_reset"
(accept the messages, then reset: the client cannot know), ("slow", s),
("hang", s) (no response for s seconds, then close), and
("status", code, body, content_type) built with error() / raw().

Requests are checked like the real service: at most 1,000 messages and
10,000,000 bytes, one ordering key per request, attribute limits, valid
base64. Violations get a 400 and are counted in `violations`.
"""

import base64
import binascii
import json
import re
import socket
import ssl
import struct
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jwt as pyjwt

PUBLISH_RE = re.compile(r"^/v1/projects/([^/]+)/topics/([^/:]+):publish$")
METADATA_PATH = \
    "/computeMetadata/v1/instance/service-accounts/default/token"
SELF_SIGNED_AUD = "https://pubsub.googleapis.com/"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256


class FakePubSub:
    def __init__(self, tls=None, auth=False, expires_in=3600,
                 sa_public=None, token_path="/token"):
        self.auth = auth
        self.expires_in = expires_in
        self.sa_public = sa_public
        self.token_path = token_path
        self.lock = threading.Lock()
        self._script = []
        self.default = "ok"
        self.token_script = []
        self.messages = []
        self.requests = []
        self.violations = []
        self.token_requests = []
        self.metadata_requests = []
        self.auth_log = []
        self.tokens = {}          # token -> expiry (time.time())
        self.connections = 0
        self.message_count = 0
        self.next_id = 1
        self.ids = {}             # message id -> message
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                with fake.lock:
                    fake.connections += 1
                super().setup()

            def log_message(self, *a):
                pass

            def do_POST(self):
                fake._handle(self, "POST")

            def do_GET(self):
                fake._handle(self, "GET")

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.scheme = "http"
        if tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(tls[0], tls[1])
            self.httpd.socket = ctx.wrap_socket(self.httpd.socket,
                                                server_side=True)
            self.scheme = "https"
        self.port = self.httpd.server_address[1]
        self.host = "127.0.0.1:%d" % self.port
        self.url = "%s://127.0.0.1:%d" % (self.scheme, self.port)
        self.token_uri = self.url + token_path
        self.thread = threading.Thread(target=self.httpd.serve_forever,
                                       kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    # -- scripting ----------------------------------------------------------

    @staticmethod
    def error(code, status, message="injected"):
        body = json.dumps({"error": {"code": code, "message": message,
                                     "status": status}}).encode()
        return ("status", code, body, "application/json")

    @staticmethod
    def raw(code, body, content_type="text/html"):
        return ("status", code, body, content_type)

    def script(self, *actions):
        with self.lock:
            self._script.extend(actions)

    def pending_script(self):
        with self.lock:
            return len(self._script)

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- queries ------------------------------------------------------------

    def wait_messages(self, count, timeout=15):
        deadline = time.time() + timeout
        while time.time() < deadline:
            with self.lock:
                n = self.message_count
            if n >= count:
                return n
            time.sleep(0.02)
        with self.lock:
            return self.message_count

    def datas(self):
        with self.lock:
            return [m["data"] for m in self.messages]

    # -- handling -----------------------------------------------------------

    def _reply(self, h, code, body, ctype="application/json", close=False):
        h.send_response(code)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        if close:
            h.send_header("Connection", "close")
            h.close_connection = True
        h.end_headers()
        h.wfile.write(body)

    def _json(self, h, code, obj):
        self._reply(h, code, json.dumps(obj).encode())

    def _reset(self, h):
        try:
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                    struct.pack("ii", 1, 0))
        except OSError:
            pass
        h.close_connection = True
        try:
            h.connection.close()
        except OSError:
            pass

    def _body(self, h):
        n = int(h.headers.get("Content-Length") or 0)
        return h.rfile.read(n) if n else b""

    def _handle(self, h, method):
        path = h.path
        body = self._body(h)
        if method == "POST" and path == self.token_path:
            return self._token(h, body)
        if method == "GET" and path.split("?")[0] == METADATA_PATH:
            return self._metadata(h)
        m = PUBLISH_RE.match(path)
        if method != "POST" or not m:
            return self._reply(h, 404, b"Not Found", "text/plain")
        return self._publish(h, m.group(1), m.group(2), body)

    def _check_auth(self, h):
        value = h.headers.get("Authorization")
        now = time.time()
        ok = False
        tok = None
        if value and value.startswith("Bearer "):
            tok = value[7:]
            with self.lock:
                exp = self.tokens.get(tok)
            if exp is not None:
                ok = exp > now
            elif self.sa_public and tok.count(".") == 2:
                try:
                    claims = pyjwt.decode(tok, self.sa_public,
                                          algorithms=["RS256"],
                                          audience=SELF_SIGNED_AUD)
                    ok = claims["iss"] == claims["sub"]
                except pyjwt.PyJWTError:
                    ok = False
        with self.lock:
            self.auth_log.append({"time": now, "token": tok, "ok": ok})
        return ok, tok

    def _publish(self, h, project, topic, body):
        with self.lock:
            action = self._script.pop(0) if self._script else self.default
        tok = None
        if self.auth:
            ok, tok = self._check_auth(h)
            if not ok:
                with self.lock:
                    self.requests.append({"n": 0, "keys": set(), "auth": tok,
                                          "action": "401", "time":
                                          time.time()})
                return self._json(h, 401, {"error": {
                    "code": 401, "status": "UNAUTHENTICATED",
                    "message": "Request had invalid authentication "
                               "credentials."}})
        if action == "reset":
            self._record_request(0, set(), tok, action)
            return self._reset(h)
        if action == "close":
            self._record_request(0, set(), tok, action)
            h.close_connection = True
            return h.connection.close()
        if isinstance(action, tuple) and action[0] == "hang":
            self._record_request(0, set(), tok, "hang")
            time.sleep(action[1])
            h.close_connection = True
            return h.connection.close()
        if isinstance(action, tuple) and action[0] == "status":
            self._record_request(0, set(), tok, "status %d" % action[1])
            return self._reply(h, action[1], action[2], action[3])
        if isinstance(action, tuple) and action[0] == "slow":
            time.sleep(action[1])
        if h.headers.get("Content-Type", "").split(";")[0] \
                != "application/json":
            return self._reply(h, 404, b"Not Found", "text/plain")

        problem, msgs = self._validate(body)
        if problem:
            with self.lock:
                self.violations.append(problem)
            self._record_request(0, set(), tok, "400 " + problem)
            return self._json(h, 400, {"error": {
                "code": 400, "status": "INVALID_ARGUMENT",
                "message": problem}})
        keys = set(m["ordering_key"] for m in msgs)
        with self.lock:
            first = self.next_id
            self.next_id += len(msgs)
            ids = [str(i) for i in range(first, first + len(msgs))]
            for i, m in zip(ids, msgs):
                m["id"] = i
                m["topic"] = topic
                self.ids[i] = m
                self.messages.append(m)
            self.message_count += len(msgs)
        self._record_request(len(msgs), keys, tok, str(action),
                             size=len(body))
        if action == "ok_then_reset":
            return self._reset(h)
        return self._json(h, 200, {"messageIds": ids})

    def _record_request(self, n, keys, tok, action, size=0):
        with self.lock:
            self.requests.append({"n": n, "keys": keys, "auth": tok,
                                  "action": action, "bytes": size,
                                  "time": time.time()})

    def _validate(self, body):
        if len(body) > 10000000:
            return "request too large", None
        try:
            req = json.loads(body)
        except ValueError:
            return "Payload isn't valid for request.", None
        msgs = req.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return "No messages to publish", None
        if len(msgs) > 1000:
            return "Too many messages to publish", None
        out = []
        for m in msgs:
            if set(m) - {"data", "attributes", "orderingKey"}:
                return "unknown field", None
            try:
                data = base64.b64decode(m.get("data", ""), validate=True)
            except (binascii.Error, ValueError):
                return "bad base64", None
            attrs = m.get("attributes") or {}
            if not data and not attrs:
                return "Some messages are empty", None
            if len(attrs) > 100:
                return "too many attributes", None
            for k, v in attrs.items():
                if not isinstance(v, str):
                    return "attribute value not a string", None
                if len(k.encode()) > 256 or k.startswith("goog") or not k:
                    return "bad attribute key", None
                if len(v.encode()) > 1024:
                    return "attribute value too long", None
            key = m.get("orderingKey", "")
            if len(key.encode()) > 1024:
                return "ordering key too long", None
            out.append({"data": data, "attributes": attrs,
                        "ordering_key": key})
        if len(set(m["ordering_key"] for m in out)) > 1:
            return "mixed ordering keys in one request", None
        return None, out

    def _issue(self, expires_in):
        with self.lock:
            tok = "tok-%d-%d" % (len(self.tokens) + 1,
                                 int(time.time() * 1000))
            self.tokens[tok] = time.time() + expires_in
        return tok

    def _token(self, h, body):
        form = urllib.parse.parse_qs(body.decode())
        with self.lock:
            action = self.token_script.pop(0) if self.token_script else "ok"
        entry = {"time": time.time(), "form": form,
                 "content_type": h.headers.get("Content-Type")}
        with self.lock:
            self.token_requests.append(entry)
        if action != "ok":
            return self._reply(h, action[1], action[2], action[3])
        assertion = form.get("assertion", [""])[0]
        try:
            entry["header"] = pyjwt.get_unverified_header(assertion)
            entry["claims"] = pyjwt.decode(assertion, self.sa_public,
                                           algorithms=["RS256"],
                                           audience=self.token_uri)
        except pyjwt.PyJWTError as e:
            entry["error"] = str(e)
            return self._json(h, 400, {"error": "invalid_grant",
                                       "error_description": str(e)})
        if form.get("grant_type") != \
                ["urn:ietf:params:oauth:grant-type:jwt-bearer"]:
            return self._json(h, 400, {"error": "unsupported_grant_type"})
        tok = self._issue(self.expires_in)
        entry["token"] = tok
        return self._json(h, 200, {"access_token": tok,
                                   "expires_in": self.expires_in,
                                   "token_type": "Bearer"})

    def _metadata(self, h):
        entry = {"time": time.time(), "path": h.path,
                 "flavor": h.headers.get("Metadata-Flavor")}
        with self.lock:
            self.metadata_requests.append(entry)
        if h.headers.get("Metadata-Flavor") != "Google":
            return self._reply(h, 403, b"Missing Metadata-Flavor",
                               "text/plain")
        tok = self._issue(self.expires_in)
        entry["token"] = tok
        return self._json(h, 200, {"access_token": tok,
                                   "expires_in": self.expires_in,
                                   "token_type": "Bearer"})
