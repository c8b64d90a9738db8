"""The benchmark's fast sink (tests/pubsub/sink.py) counts what it gets:
the benchmark's zero-loss figure rests on it."""

import json
import socket

from pubsub.sink import FastSink

PATH = "/v1/projects/p/topics/t:publish"


def request(path, body):
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\n\r\n" % (path.encode(), len(body))
            + body)


def read_response(f):
    status = f.readline().split()[1]
    length = 0
    while True:
        line = f.readline()
        if line in (b"\r\n", b""):
            break
        k, _, v = line.partition(b":")
        if k.lower() == b"content-length":
            length = int(v)
    return int(status), f.read(length)


def body(n, size=3000):
    msgs = [{"data": "QUJD" * (size // 4), "attributes": {"seq": str(i)}}
            for i in range(n)]
    return json.dumps({"messages": msgs}, separators=(",", ":")).encode()


def test_counts_and_ids_over_keepalive_and_pipelining():
    sink = FastSink()
    try:
        s = socket.create_connection(("127.0.0.1", sink.port))
        f = s.makefile("rb")
        # a large body in one request, then two pipelined in one write
        s.sendall(request(PATH, body(700)))
        st, b1 = read_response(f)
        assert st == 200
        ids1 = json.loads(b1)["messageIds"]
        assert len(ids1) == 700
        s.sendall(request(PATH, body(3, 10)) + request(PATH, body(2, 10)))
        ids2 = json.loads(read_response(f)[1])["messageIds"]
        ids3 = json.loads(read_response(f)[1])["messageIds"]
        assert (len(ids2), len(ids3)) == (3, 2)
        assert len(set(ids1 + ids2 + ids3)) == 705
        # other paths are refused and not counted
        s.sendall(request("/other", body(1)))
        assert read_response(f)[0] == 404
        s.close()
        st = sink.stats()
        assert st["messages"] == 705
        assert st["requests"] == 3
    finally:
        sink.close()


def test_split_writes_garbage_and_stats():
    sink = FastSink()
    try:
        # a request that arrives a few bytes at a time
        s = socket.create_connection(("127.0.0.1", sink.port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        f = s.makefile("rb")
        raw = request(PATH, body(4, 100))
        for i in range(0, len(raw), 7):
            s.sendall(raw[i:i + 7])
        st, b = read_response(f)
        assert st == 200 and len(json.loads(b)["messageIds"]) == 4
        # a length that is not a number closes that connection only
        g = socket.create_connection(("127.0.0.1", sink.port))
        g.sendall(b"POST /x:publish HTTP/1.1\r\nContent-Length: -5\r\n\r\n")
        assert g.recv(100) == b""
        g.close()
        s.sendall(request(PATH, body(1, 10)))
        assert read_response(f)[0] == 200
        s.close()
        st = sink.stats()
        assert (st["messages"], st["requests"]) == (5, 2)
        assert st["bytes"] == len(body(4, 100)) + len(body(1, 10))
    finally:
        sink.close()
    assert sink.proc.returncode == 0
