"""Google's Pub/Sub emulator (the Google Cloud CLI's pubsub-emulator
component) on a loopback port, driven over its REST interface."""

import atexit
import base64
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time

import requests

JAR_GLOBS = [
    os.environ.get("LOOM_PUBSUB_EMULATOR_JAR", ""),
    "/usr/lib/google-cloud-sdk/platform/pubsub-emulator/lib/"
    "cloud-pubsub-emulator-*.jar",
    "/usr/share/google-cloud-sdk/platform/pubsub-emulator/lib/"
    "cloud-pubsub-emulator-*.jar",
    "/opt/google-cloud-sdk/platform/pubsub-emulator/lib/"
    "cloud-pubsub-emulator-*.jar",
]


def find_jar():
    for g in JAR_GLOBS:
        if not g:
            continue
        hits = sorted(glob.glob(g))
        if hits:
            return hits[-1]
    return None


def unavailable():
    """None when the emulator can run here, else the reason why not."""
    if not find_jar():
        return ("Pub/Sub emulator jar not found (install the Google Cloud "
                "CLI component pubsub-emulator, or set "
                "LOOM_PUBSUB_EMULATOR_JAR)")
    if not shutil.which("java"):
        return "java is not installed (the Pub/Sub emulator needs it)"
    return None


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Emulator:
    def __init__(self, timeout=60):
        self.port = _free_port()
        self.host = "127.0.0.1:%d" % self.port
        self.url = "http://" + self.host
        self.dir = tempfile.mkdtemp(prefix="loom-pubsub-emu-")
        self.log = open(os.path.join(self.dir, "emulator.log"), "wb")
        self.proc = subprocess.Popen(
            ["java", "-jar", find_jar(), "--host=127.0.0.1",
             "--port=%d" % self.port],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=self.dir)
        self.session = requests.Session()
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("emulator exited: " + self.log_text())
            try:
                if self.session.get(self.url + "/", timeout=1).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        self.close()
        raise RuntimeError("emulator did not start: " + self.log_text())

    def log_text(self):
        try:
            with open(os.path.join(self.dir, "emulator.log"), "rb") as f:
                return f.read()[-3000:].decode("utf-8", "replace")
        except OSError:
            return ""

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def create_topic(self, project, topic):
        r = self.session.put("%s/v1/projects/%s/topics/%s" % (
            self.url, project, topic), json={}, timeout=10)
        assert r.ok, r.text

    def create_subscription(self, project, topic, sub, ordered=True):
        r = self.session.put(
            "%s/v1/projects/%s/subscriptions/%s" % (self.url, project, sub),
            json={"topic": "projects/%s/topics/%s" % (project, topic),
                  "enableMessageOrdering": ordered,
                  "ackDeadlineSeconds": 600}, timeout=10)
        assert r.ok, r.text

    def pull(self, project, sub, want, timeout=30):
        """Pulls and acks until want messages arrived (or timeout); returns
        the received messages with data decoded."""
        out = []
        deadline = time.time() + timeout
        base = "%s/v1/projects/%s/subscriptions/%s" % (self.url, project, sub)
        while len(out) < want and time.time() < deadline:
            r = self.session.post(base + ":pull", json={
                "maxMessages": 1000, "returnImmediately": True}, timeout=10)
            assert r.ok, r.text
            got = r.json().get("receivedMessages", [])
            if not got:
                time.sleep(0.1)
                continue
            acks = []
            for m in got:
                msg = m["message"]
                msg["data"] = base64.b64decode(msg.get("data", ""))
                out.append(msg)
                acks.append(m["ackId"])
            r = self.session.post(base + ":acknowledge",
                                  json={"ackIds": acks}, timeout=10)
            assert r.ok, r.text
        return out


_shared = None


def shared():
    """One emulator for the whole test process (stopped at exit); tests
    keep apart by using their own topics."""
    global _shared
    if _shared is None or _shared.proc.poll() is not None:
        _shared = Emulator()
        atexit.register(_shared.close)
    return _shared
