"""The fake Pub/Sub's fast mode: a sink for the benchmark, a small C server
(tests/pubsub/sink.c, built by `make build` as build/pubsub-sink) that this
class starts and reads. It shares the machine with nginx and wrk, so its
CPU is taken from what is measured: the Python server this replaces spent
1.3 us per 1 KiB message, a fifth of what publishing cost the workers.

    sink = FastSink()
    ... nginx publishes to sink.host (plain HTTP, keep-alive) ...
    sink.stats()    # {"messages", "requests", "bytes", "connections"}
    sink.close()

Any POST whose path ends in ":publish" is accepted: each message with data
is counted (without parsing the JSON) and gets a message ID. Nothing is
validated; for checks of what was sent, use FakePubSub (fake.py).
"""

import http.client
import json
import os
import subprocess

BINARY = os.environ.get("LOOM_SINK", os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "build",
    "pubsub-sink"))


class FastSink:
    def __init__(self):
        if not os.access(BINARY, os.X_OK):
            raise RuntimeError("%s is missing: run `make build`" % BINARY)
        # the sink stops when its stdin closes, also if this process dies
        self.proc = subprocess.Popen([BINARY], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        self.port = int(self.proc.stdout.readline())
        self.host = "127.0.0.1:%d" % self.port

    def stats(self):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", "/_sink/stats")
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(10)
        self.proc.stdout.close()
