"""Example handler for the resty-loom Python offload runtime.

Load it with

    offload.load("<root>/runtimes/python/build/libloom_rt_python.so",
                 "path=<root>/runtimes/python/examples "
                 "module=loom_example function=handle", { threads = 4 })

`handle(payload: bytes) -> bytes` runs on the runtime's own threads, with
the GIL held. Module-level objects live as long as the nginx worker, so
they keep state between calls: here a small cache and a call counter
(a real runtime would keep a connection pool or a loaded model there).

The payload is "<op>:<argument>":

    echo:<x>        returns x
    hash:<x>        FNV-1a 64 of x, 16 hex digits
    sha256:<x>      hashlib's SHA-256 of x, hex (an extension module)
    put:<k>=<v>     stores v under k in the cache, returns "ok"
    get:<k>         the cached value, or "miss"
    count:          how many calls this worker's runtime has served
    sleep:<ms>      sleeps, giving up early when the call is cancelled
    stuck:<ms>      sleeps without looking at cancellation
    raise:<msg>     raises ValueError(msg)
    big:<n>         n bytes of "x"
    int:<n>         returns the int n (not bytes: an error)
    config:         the configuration string setup() got (init=setup)
    view:<x>        x as a memoryview (any buffer object is accepted)
    exit:<n>        runs "sh -c 'exit n'", returns subprocess's returncode

A payload without a known op is echoed back unchanged.
"""

import hashlib
import subprocess
import threading
import time

import loom

_lock = threading.Lock()
_cache = {}
_calls = 0
_config = b""


def _fnv1a64(data):
    h = 0xcbf29ce484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001b3) & 0xffffffffffffffff
    return b"%016x" % h


def _sleep(ms, watch_cancel):
    deadline = time.monotonic() + ms / 1000.0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"slept"
        if watch_cancel and loom.cancelled():
            return b"cancelled"
        time.sleep(min(left, 0.005))


def setup(config):
    """Called once at load with init=setup: the configuration string."""
    global _config
    _config = config.encode()


def echo(payload):
    """A second entry point: function=echo answers with the payload."""
    return payload


def handle(payload):
    global _calls
    with _lock:
        _calls += 1
        calls = _calls
    op, sep, arg = payload.partition(b":")
    if not sep:
        return payload
    if op == b"echo":
        return arg
    if op == b"hash":
        return _fnv1a64(arg)
    if op == b"sha256":
        return hashlib.sha256(arg).hexdigest().encode()
    if op == b"put":
        k, _, v = arg.partition(b"=")
        with _lock:
            _cache[k] = v
        return b"ok"
    if op == b"get":
        with _lock:
            return _cache.get(arg, b"miss")
    if op == b"count":
        return b"%d" % calls
    if op == b"sleep":
        return _sleep(int(arg), True)
    if op == b"stuck":
        return _sleep(int(arg), False)
    if op == b"raise":
        raise ValueError(arg.decode())
    if op == b"big":
        return b"x" * int(arg)
    if op == b"int":
        return int(arg)
    if op == b"config":
        return _config
    if op == b"view":
        return memoryview(arg)
    if op == b"exit":
        res = subprocess.run(["sh", "-c", "exit %d" % int(arg)])
        return b"%d" % res.returncode
    return payload
