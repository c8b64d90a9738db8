"""A handler whose child is reaped behind subprocess's back, as another
waitpid() in the worker process could: subprocess must not report it as
a success (tests/test_offload_python.py)."""

import os
import subprocess


def handle(payload):
    if payload.startswith(b"echo:"):
        return payload[5:]
    p = subprocess.Popen(["sh", "-c", "exit 3"])
    os.waitpid(p.pid, 0)
    if payload == b"poll":
        return b"%r" % (p.poll(),)
    return b"%d" % p.wait()
