"""resty.loom.publish credentials over TLS: service-account JWT exchange
(checked with PyJWT), self-signed JWT, metadata server, 401 refresh, refresh
before expiry by one worker for all, certificate verification."""

import json
import tempfile
import time

import jwt as pyjwt
import pytest

from pubsub import certs
from pubsub import harness as H
from pubsub.fake import FakePubSub


@pytest.fixture(scope="module")
def pki():
    d = tempfile.mkdtemp(prefix="loom-pub-pki-")
    ca, ca_key, ca_path = certs.make_ca(d)
    cert, key = certs.make_server_cert(d, ca, ca_key)
    _, _, other = certs.make_ca(d, "other CA")
    return {"dir": d, "ca": ca_path, "cert": cert, "key": key,
            "other": other}


@pytest.fixture
def fake(pki):
    f = FakePubSub(tls=(pki["cert"], pki["key"]), auth=True)
    d = tempfile.mkdtemp(prefix="loom-sa-", dir=pki["dir"])
    f.sa_path, f.sa_public, f.sa_info = certs.make_service_account(
        d, f.token_uri)
    yield f
    f.close()


def tls_http(pki, ca=None):
    return "lua_ssl_trusted_certificate %s;\nlua_ssl_verify_depth 3;" % (
        ca or pki["ca"])


def conf(fake, **cred):
    c = {"endpoint": fake.url, "batch_max_delay": 0.05,
         "retry_initial_backoff": 0.05, "retry_max_backoff": 0.2,
         "timeout": 5,
         "credentials": dict({"key_file": fake.sa_path,
                              "shm": "loom_publish"}, **cred)}
    return c


def test_service_account_exchange(nginx, fake, pki):
    n = H.publisher(nginx, conf(fake), workers=2, http=tls_http(pki))
    for i in range(6):
        ok, _ = H.send(n, 20, "sa%d" % i)
        assert ok == 20
    assert fake.wait_messages(120) == 120
    # one token for both workers, fetched with a valid RS256 assertion
    assert len(fake.token_requests) == 1
    tr = fake.token_requests[0]
    assert tr["content_type"] == "application/x-www-form-urlencoded"
    assert "error" not in tr, tr.get("error")
    claims, header = tr["claims"], tr["header"]
    assert header["alg"] == "RS256" and header["typ"] == "JWT"
    assert header["kid"] == fake.sa_info["private_key_id"]
    assert claims["iss"] == fake.sa_info["client_email"]
    assert claims["aud"] == fake.token_uri
    assert claims["scope"] == "https://www.googleapis.com/auth/pubsub"
    assert claims["exp"] - claims["iat"] == 3600
    assert abs(claims["iat"] - time.time()) < 30
    assert {r["auth"] for r in fake.requests} == {tr["token"]}
    assert all(a["ok"] for a in fake.auth_log)
    st = n.get("/stats").json()
    assert st["token_refreshes"] == 1


def test_self_signed_jwt(nginx, fake, pki):
    n = H.publisher(nginx, conf(fake, self_signed_jwt=True), workers=2,
                    http=tls_http(pki))
    ok, _ = H.send(n, 50, "ss")
    assert ok == 50
    assert fake.wait_messages(50) == 50
    assert fake.token_requests == []
    tok = fake.requests[0]["auth"]
    claims = pyjwt.decode(tok, fake.sa_public, algorithms=["RS256"],
                          audience="https://pubsub.googleapis.com/")
    assert claims["iss"] == claims["sub"] == fake.sa_info["client_email"]
    assert claims["exp"] - claims["iat"] == 3600
    assert "scope" not in claims
    assert pyjwt.get_unverified_header(tok)["kid"] == \
        fake.sa_info["private_key_id"]
    # a tampered signature is refused by the same check
    with pytest.raises(pyjwt.InvalidSignatureError):
        pyjwt.decode(tok[:-6] + ("A" if tok[-6] != "A" else "B") + tok[-5:],
                     fake.sa_public, algorithms=["RS256"],
                     audience="https://pubsub.googleapis.com/")


def test_metadata_server(nginx, pki):
    meta = FakePubSub()            # plain HTTP, like the metadata server
    pub = FakePubSub(tls=(pki["cert"], pki["key"]), auth=True)
    try:
        # tokens the metadata fake issues are accepted by the publish fake
        pub.tokens = meta.tokens
        c = {"endpoint": pub.url, "batch_max_delay": 0.05,
             "credentials": {"type": "metadata", "shm": "loom_publish",
                             "scopes": ["https://www.googleapis.com/auth/"
                                        "pubsub"]}}
        n = H.publisher(nginx, c, workers=2, http=tls_http(pki),
                        env={"GCE_METADATA_HOST": meta.host})
        ok, _ = H.send(n, 30, "md")
        assert ok == 30
        assert pub.wait_messages(30) == 30
        assert len(meta.metadata_requests) == 1
        req = meta.metadata_requests[0]
        assert req["flavor"] == "Google"
        assert "scopes=https%3A%2F%2Fwww.googleapis.com%2Fauth%2Fpubsub" \
            in req["path"]
        assert {r["auth"] for r in pub.requests} == {req["token"]}

        # the metadata server may hand out a token with little life left:
        # it is renewed at half-life, not before every publish (the first
        # token is revoked, so one 401 and one refresh happen first)
        meta.expires_in = 4
        with meta.lock:
            meta.tokens.clear()
        start = time.time()
        for i in range(12):
            ok, _ = H.send(n, 5, "short%d" % i)
            assert ok == 5
            time.sleep(0.25)
        assert pub.wait_messages(90) == 90
        fetches = len(meta.metadata_requests) - 1
        assert 1 <= fetches <= (time.time() - start) / 2 + 2, fetches
        assert all(a["ok"] or a["token"] == req["token"]
                   for a in pub.auth_log)
    finally:
        meta.close()
        pub.close()


def test_401_refreshes_token_once_and_retries(nginx, fake, pki):
    n = H.publisher(nginx, conf(fake), workers=1, http=tls_http(pki))
    ok, _ = H.send(n, 10, "before")
    assert ok == 10 and fake.wait_messages(10) == 10
    # the server revokes the token: the next publish gets a 401
    with fake.lock:
        fake.tokens.clear()
    ok, _ = H.send(n, 10, "after")
    assert ok == 10 and fake.wait_messages(20) == 20
    assert len(fake.token_requests) == 2
    actions = [r["action"] for r in fake.requests]
    assert actions.count("401") == 1
    res = H.results(n)
    assert res["err_msgs"] == 0
    assert n.get("/stats").json()["retried"] == 1


def test_refresh_before_expiry_by_one_worker(nginx, fake, pki):
    fake.expires_in = 6
    n = H.publisher(nginx, conf(fake, refresh_margin=4), workers=3,
                    http=tls_http(pki))
    start = time.time()
    sent = 0
    while time.time() - start < 8:
        ok, _ = H.send(n, 5, "r%d" % sent)
        sent += ok
        time.sleep(0.1)
    elapsed = time.time() - start
    assert fake.wait_messages(sent) == sent
    # never an expired or unknown token, never a 401
    assert fake.auth_log and all(a["ok"] for a in fake.auth_log)
    assert all(r["action"] != "401" for r in fake.requests)
    # tokens live 6 s and are renewed when 4 s are left: about one fetch
    # per 2 s for all three workers together (each worker on its own
    # would triple that)
    fetches = len(fake.token_requests)
    assert 2 <= fetches <= elapsed / 2 + 2, fetches
    times = [t["time"] for t in fake.token_requests]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert min(gaps) > 1, gaps
    assert all("error" not in t for t in fake.token_requests)


def test_token_endpoint_failure_is_retried(nginx, fake, pki):
    fake.token_script = [FakePubSub.raw(503, b"busy", "text/plain")]
    n = H.publisher(nginx, conf(fake), workers=1, http=tls_http(pki))
    ok, _ = H.send(n, 10, "te")
    assert ok == 10
    assert fake.wait_messages(10) == 10
    assert len(fake.token_requests) == 2
    assert H.results(n)["err_msgs"] == 0


def test_untrusted_certificate_is_refused(nginx, fake, pki):
    c = conf(fake, self_signed_jwt=True)
    c["retry_deadline"] = 1
    n = H.publisher(nginx, c, workers=1, http=tls_http(pki, pki["other"]))
    ok, _ = H.send(n, 10, "mitm")
    assert ok == 10
    res = H.wait_for(lambda: (lambda r: r if r["err_msgs"] else None)(
        H.results(n)), 10)
    assert res["err_msgs"] == 10
    assert "handshake" in res["errors"][0]["reason"]
    assert fake.message_count == 0
    assert fake.requests == []


def test_topics_share_one_token(nginx, fake, pki):
    # a second topic with the same key, in every worker, next to the
    # helper's publisher: still one token for all
    n = H.publisher(nginx, conf(fake), workers=2, http=tls_http(pki) + """
        init_by_lua_block {
            SECOND_CONF = [==[%s]==]
        }""" % json.dumps(dict(conf(fake), project="loom-proj",
                                topic="topic-2")), server="""
        location = /second { content_by_lua_block {
            local publish = require "resty.loom.publish"
            SECOND = SECOND or publish.new(
                require("cjson").decode(SECOND_CONF))
            for i = 1, 10 do
                assert(SECOND:send("second-" .. i))
            end
            ngx.say("ok")
        } }""")
    ok, _ = H.send(n, 20, "first")
    assert ok == 20
    for _ in range(4):
        assert n.get("/second").status == 200
    assert fake.wait_messages(60) == 60
    topics = {m["topic"] for m in fake.messages}
    assert topics == {"topic-1", "topic-2"}
    assert len(fake.token_requests) == 1
    assert len({r["auth"] for r in fake.requests}) == 1


@pytest.mark.parametrize("status,body", [
    (400, b'{"error": "invalid_grant", "error_description": "bad key"}'),
    (401, b'{"error": "unauthorized_client"}'),
])
def test_token_endpoint_refusal_fails_at_once(nginx, fake, pki, status,
                                              body):
    # the token endpoint refuses the credentials: asking again cannot help,
    # so the batch fails at once (default retry deadline: 60 s)
    fake.token_script = [FakePubSub.raw(status, body, "application/json")] \
        * 100
    n = H.publisher(nginx, conf(fake), workers=1, http=tls_http(pki))
    n.allow_log(r"token refresh: failed to fetch token")
    ok, _ = H.send(n, 10, "tok")
    assert ok == 10
    res = H.wait_for(lambda: (lambda r: r if r["err_msgs"] else None)(
        H.results(n)), 10)
    assert res and res["err_msgs"] == 10, res
    err = res["errors"][0]
    assert err["attempts"] == 1
    assert "failed to fetch token: status %d" % status in err["reason"]
    assert fake.requests == []
    assert n.get("/stats").json()["retried"] == 0
    # more batches within 5 s fail the same way without asking again
    asked = len(fake.token_requests)
    ok, _ = H.send(n, 10, "tok2")
    assert H.wait_for(lambda: H.results(n)["err_msgs"] == 20, 10)
    assert len(fake.token_requests) == asked


def test_unverified_certificate_fails_at_once(nginx, fake, pki):
    # default retry deadline (60 s): a certificate that does not verify is
    # not retried
    c = conf(fake, self_signed_jwt=True)
    n = H.publisher(nginx, c, workers=1, http=tls_http(pki, pki["other"]))
    n.allow_log(r"certificate verify failed|SSL_do_handshake")
    ok, _ = H.send(n, 10, "mitm2")
    assert ok == 10
    res = H.wait_for(lambda: (lambda r: r if r["err_msgs"] else None)(
        H.results(n)), 10)
    assert res and res["err_msgs"] == 10, res
    assert res["errors"][0]["attempts"] == 1
    assert "handshake" in res["errors"][0]["reason"]
    assert fake.requests == []
