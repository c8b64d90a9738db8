"""Socket permissions, peer credentials, and bad input on the wire."""

import os
import socket
import stat
import subprocess
import sys

import eventsconf as ec

RAW = ec.SERVER + """
    location /raw { content_by_lua_block { require("events_raw").handle() } }
"""

KINDS = ["garbage", "version", "not_hello", "hello_garbage", "lying_pid",
         "bad_worker", "generation", "oversize", "bad_type", "bad_lengths",
         "shm_nowhere", "shm_other"]


def test_socket_mode_and_directory(nginx):
    n = nginx(workers=2, http=ec.http(), server=ec.SERVER)
    ec.wait_ready(n)
    sock = os.path.join(n.prefix, "sock", "bus.sock")
    st = os.stat(sock)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    d = os.stat(os.path.dirname(sock))
    assert stat.S_IMODE(d.st_mode) == 0o700
    assert st.st_uid == os.geteuid() and d.st_uid == os.geteuid()


def test_outsider_process_refused(nginx):
    """A process of the same user that is not a worker of this master."""
    n = nginx(workers=2, http=ec.http(), server=ec.SERVER)
    ec.wait_ready(n)
    path = os.path.join(n.prefix, "sock", "bus.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: loom-events/1\r\n\r\n")
    assert s.recv(100) == b""          # closed without an answer
    s.close()
    st = ec.states(n)
    assert st[0]["stats"]["broker"]["rejected"] == {"peer not a worker": 1}
    # the bus still serves the workers
    assert n.get("/ev/pub?target=all&n=5").json()["ok"] == 5
    ec.wait_totals(n, {0: 5, 1: 5})
    n.allow_log(r"rejected a connection: peer not a worker")


def test_other_uid_refused(nginx):
    if os.geteuid() != 0:
        import pytest
        pytest.skip("needs root to run a client as another user")
    n = nginx(workers=2, http=ec.http(), server=ec.SERVER)
    ec.wait_ready(n)
    path = os.path.join(n.prefix, "sock", "bus.sock")
    client = ("import socket,os,sys\n"
              "os.setgid(65534); os.setuid(65534)\n"
              "s=socket.socket(socket.AF_UNIX)\n"
              "try:\n"
              "    s.connect(sys.argv[1])\n"
              "except PermissionError:\n"
              "    print('denied'); sys.exit(0)\n"
              "s.settimeout(5)\n"
              "s.sendall(b'GET / HTTP/1.1\\r\\nHost: x\\r\\n"
              "Upgrade: loom-events/1\\r\\n\\r\\n')\n"
              "print('closed' if s.recv(100) == b'' else 'answered')\n")
    # with the real permissions the kernel refuses another user outright
    out = subprocess.run([sys.executable, "-c", client, path],
                         capture_output=True, text=True, timeout=20)
    assert out.stdout.strip() == "denied", out.stderr
    # open the permissions up: the broker's credential check still refuses
    os.chmod(os.path.dirname(path), 0o755)
    os.chmod(path, 0o666)
    out = subprocess.run([sys.executable, "-c", client, path],
                         capture_output=True, text=True, timeout=20)
    assert out.stdout.strip() == "closed", out.stderr
    st = ec.states(n)
    assert st[0]["stats"]["broker"]["rejected"] == {"peer uid": 1}
    n.allow_log(r"rejected a connection: peer uid")


def raw_from(n, wid, kind, tries=400):
    """Runs the raw client of that kind in worker wid: it says hello as
    that worker, with its pid."""
    for _ in range(tries):
        r = n.get("/raw?only=%d&kind=%s" % (wid, kind))
        if r.status != 409:
            return r.text.strip()
    raise AssertionError("no request reached worker %d" % wid)


def test_bad_frames_closed_and_counted(nginx):
    n = nginx(workers=2, http=ec.http(), server=RAW)
    n.allow_log(r"rejected a connection|closed worker \d's connection")
    ec.wait_ready(n)
    broker_pid = ec.states(n)[0]["pid"]
    for kind in KINDS:
        assert raw_from(n, 1, kind) == "closed", kind
    # from the broker worker, as the broker worker: its own client is
    # linked in-process, so the id is in use whatever the pid says, and
    # the link survives (it once took the link over and worker 0 went deaf)
    assert raw_from(n, 0, "oversize") == "closed"
    st = ec.wait_ready(n)
    rejected = st[0]["stats"]["broker"]["rejected"]
    assert rejected.get("worker id in use") == 1
    assert rejected.get("wrong version") == 2   # garbage, version
    assert rejected.get("bad hello") == 2       # not_hello, hello_garbage
    assert rejected.get("hello pid differs from peer") == 1
    assert rejected.get("bad worker id") == 1
    assert rejected.get("other generation") == 1
    # oversize, bad type, bad lengths (which once crashed the broker),
    # SHM frames for a run that is not in the sender's ring
    assert rejected.get("protocol error") == 5
    # everyone else is still served, nothing lost
    r = n.get("/ev/pub?target=all&n=50").json()
    assert r["ok"] == 50
    st = ec.wait_totals(n, {0: 50, 1: 50})
    for s in st.values():
        assert s["order_errors"] == 0
    assert st[0]["pid"] == broker_pid
    assert "exited on signal" not in n.error_log()
