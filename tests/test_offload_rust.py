"""The Rust offload runtime (runtimes/rust) through real nginx.

This file also holds RuntimeSuite, the tests every runtime passes;
tests/test_offload_go.py and tests/test_offload_python.py subclass it with
their own library and configuration. Each runtime's example answers the
same "<op>:<argument>" payloads (see runtimes/rust/examples/cache.rs).
"""

import os
import re
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

# sequential calls in each runtime's soak test (LOOM_OFFLOAD_SOAK to change)
SOAK_CALLS = int(os.environ.get("LOOM_OFFLOAD_SOAK", "1000000"))

# os.execute("exit 3") returns the raw wait status
EXIT3_STATUS = 3 << 8

# signals nginx's main thread must receive, never a runtime thread
NGINX_SIGNALS = {
    "SIGHUP": 1, "SIGINT": 2, "SIGQUIT": 3, "SIGUSR1": 10, "SIGUSR2": 12,
    "SIGALRM": 14, "SIGTERM": 15, "SIGCHLD": 17, "SIGWINCH": 28, "SIGIO": 29,
}

LOCATIONS = """
    location /call { content_by_lua_block {
        require("offload_rt_common").call() } }
    location /many { content_by_lua_block {
        require("offload_rt_common").many() } }
    location /burst { content_by_lua_block {
        require("offload_rt_common").burst() } }
    location /soak { content_by_lua_block {
        require("offload_rt_common").soak() } }
    location /bulk { content_by_lua_block {
        require("offload_rt_common").bulk() } }
    location /stats { content_by_lua_block {
        require("offload_rt_common").stats() } }
    location /state { content_by_lua_block {
        require("offload_rt_common").state() } }
    location /exec { content_by_lua_block {
        require("offload_rt_common").exec() } }
    location /logphase {
        content_by_lua_block { ngx.say("logged") }
        log_by_lua_block {
            require("offload_rt_common").log_phase_call("%(name)s") }
    }
"""


def fnv1a64(data):
    h = 0xcbf29ce484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001b3) & 0xffffffffffffffff
    return b"%016x" % h


def rss_kb(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS for %d" % pid)


def blocked_signals(pid, tid):
    with open("/proc/%d/task/%d/status" % (pid, tid)) as f:
        for line in f:
            if line.startswith("SigBlk:"):
                mask = int(line.split()[1], 16)
                return {s for s in range(1, 65) if mask & (1 << (s - 1))}
    raise AssertionError("no SigBlk")


def thread_names(pid):
    names = {}
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/comm" % (pid, tid)) as f:
                names[int(tid)] = f.read().strip()
        except OSError:
            pass
    return names


class RuntimeSuite:
    """Tests every offload runtime passes; subclasses set these."""

    NAME = None          # runtime name in the Lua helper
    LIB = None           # path of the shared library
    CONFIG = ""          # configuration string for the "ops" example
    PANIC_RE = None      # what a "panic:boom" payload gives
    PANIC_LOG_RE = None  # its error.log line (runtime, handler, message)
    PANIC_LOG_MORE = ""  # and what follows that line (a traceback)
    PANIC_OP = "panic:"  # the op that panics / raises
    SOAK = SOAK_CALLS    # sequential calls in the soak test
    ECHO_CONFIG = "mode=echo"  # an instance answering with the payload
    # signals of NGINX_SIGNALS a runtime's threads may leave unblocked
    # because the runtime forwards them to nginx's main thread
    UNBLOCKED_OK = set()

    # -- helpers -----------------------------------------------------------

    @pytest.fixture(autouse=True)
    def _built(self):
        if not os.path.exists(self.LIB):
            subprocess.run(["make", "-C", os.path.dirname(
                os.path.dirname(self.LIB))], check=True,
                capture_output=True, timeout=600)
        assert os.path.exists(self.LIB), self.LIB

    def start(self, nginx, workers=1, threads=2, opts="", config=None,
              ready=True, extra="", **kw):
        cfg = self.CONFIG if config is None else config
        http = """
            init_worker_by_lua_block {
                require("offload_rt_common").load(%r, %r, %r,
                    { threads = %d, %s })
                %s
            }
        """ % (self.NAME, self.LIB, cfg, threads, opts, extra)
        n = nginx(workers=workers, http=http,
                  server=LOCATIONS % {"name": self.NAME}, **kw)
        for _ in range(workers * 4 if ready else 0):
            r = self.call(n, "echo:ready", timeout=10)
            assert r == (200, b"ready"), r
        return n

    def call(self, n, payload, timeout=None, http_timeout=30):
        path = "/call?rt=%s" % self.NAME
        if timeout is not None:
            path += "&timeout=%s" % timeout
        if isinstance(payload, str):
            payload = payload.encode()
        r = n.post(path, body=payload, timeout=http_timeout)
        return r.status, r.body

    def get(self, n, path, **kw):
        sep = "&" if "?" in path else "?"
        r = n.get("%s%srt=%s" % (path, sep, self.NAME), **kw)
        assert r.status == 200, r
        return r.text

    def test_unit_tests_against_a_mock_host(self):
        # the runtime's own tests (make test: cargo test, go test, or the
        # C mock host for Python), without nginx
        res = subprocess.run(
            ["make", "-s", "-C", os.path.dirname(os.path.dirname(self.LIB)),
             "test"], capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    # -- results and state ---------------------------------------------------

    def test_results_and_state(self, nginx):
        n = self.start(nginx)
        assert self.call(n, "echo:hello") == (200, b"hello")
        assert self.call(n, "") == (200, b"")
        blob = bytes(range(256)) * 64
        assert self.call(n, b"echo:" + blob) == (200, blob)
        assert self.call(n, "hash:abc") == (200, fnv1a64(b"abc"))
        assert self.call(n, "hash:abc") == (200, fnv1a64(b"abc"))
        assert self.call(n, "get:colour") == (200, b"miss")
        assert self.call(n, "put:colour=blue") == (200, b"ok")
        assert self.call(n, "get:colour") == (200, b"blue")
        _, c1 = self.call(n, "count:")
        _, c2 = self.call(n, "count:")
        assert int(c2) == int(c1) + 1
        status, big = self.call(n, "big:%d" % (1 << 20))
        assert status == 200 and big == b"x" * (1 << 20)
        # the state lives as long as the worker
        assert self.call(n, "get:colour") == (200, b"blue")

    def test_error_and_panic_keep_the_worker(self, nginx):
        n = self.start(nginx, threads=2)
        n.allow_log(self.PANIC_LOG_RE)
        pid = n.worker_pids()[0]
        assert self.call(n, "put:k=kept") == (200, b"ok")
        status, body = self.call(n, self.PANIC_OP + "boom")
        assert status == 500
        assert re.match(self.PANIC_RE, body.decode()), body
        # every thread can panic, and keeps serving afterwards
        for _ in range(20):
            status, body = self.call(n, self.PANIC_OP + "again")
            assert status == 500 and b"again" in body, body
        assert self.call(n, "echo:next") == (200, b"next")
        assert self.call(n, "get:k") == (200, b"kept")
        assert n.worker_pids() == [pid]
        stats = n.get("/stats?rt=%s" % self.NAME).json()
        assert stats["errors"] >= 21

    def test_panic_is_logged_once(self, nginx):
        n = self.start(nginx, threads=2)
        n.allow_log(self.PANIC_LOG_RE)
        status, body = self.call(n, self.PANIC_OP + "boom")
        assert status == 500
        # exactly one line, with the runtime, the handler and the message
        n.wait_log(self.PANIC_LOG_RE + self.PANIC_LOG_MORE)
        time.sleep(0.3)
        log = n.error_log()
        assert len(re.findall(self.PANIC_LOG_RE, log)) == 1, log[-3000:]
        assert len(re.findall(r"\[error\]", log)) == 1, log[-3000:]

    def test_two_instances_in_one_worker(self, nginx):
        # one library, two configurations: two runtimes with their own
        # threads and state
        n = self.start(nginx, extra='require("offload_rt_common").load('
                       '"second", %r, %r, { threads = 1 })'
                       % (self.LIB, self.ECHO_CONFIG))
        assert self.call(n, "put:a=1") == (200, b"ok")
        assert self.call(n, "get:a") == (200, b"1")
        r = n.post("/call?rt=second", body=b"get:a")
        assert (r.status, r.body) == (200, b"get:a")
        assert self.call(n, "count:")[1].isdigit()

    def test_returned_error(self, nginx):
        n = self.start(nginx)
        assert self.call(n, "error:bad input") == (
            500, b"ERR runtime error: bad input")

    # -- timeouts, cancellation, back-pressure --------------------------------

    def test_timeout_cancels_the_call(self, nginx):
        n = self.start(nginx, threads=1)
        assert self.call(n, "sleep:60000", timeout=0.2) == (
            500, b"ERR timeout")
        # the only thread saw the cancellation and stopped sleeping: the
        # next call is served within its 10 s, not after the 60 s
        assert self.call(n, "echo:after", timeout=10) == (200, b"after")
        stats = n.get("/stats?rt=%s" % self.NAME).json()
        assert stats["timeouts"] == 1

    def test_queue_full(self, nginx):
        n = self.start(nginx, threads=1, opts="queue = 2")
        out = self.get(n, "/burst?n=10&p=sleep:300")
        counts = {}
        for line in out.splitlines():
            c, what = line.split(" ", 1)
            counts[what] = int(c)
        assert set(counts) == {"slept", "ERR queue full"}, out
        # one task running, two queued; the runtime thread may take the
        # first one before the others are submitted, or not
        assert 2 <= counts["slept"] <= 3, out
        assert counts["ERR queue full"] == 10 - counts["slept"]
        assert self.call(n, "echo:drained") == (200, b"drained")
        stats = n.get("/stats?rt=%s" % self.NAME).json()
        assert stats["rejected"] == counts["ERR queue full"]

    def test_wrong_phase_is_a_clear_error(self, nginx):
        n = self.start(nginx)
        assert n.get("/logphase").text == "logged\n"
        m = n.wait_log(r"\[offload_rt\] log phase call: (\S+) (\S+) (.*?),")
        assert m[0][0] == "true" and m[0][1] == "nil", m
        assert "API disabled in the context of log" in m[0][2], m

    # -- load ----------------------------------------------------------------

    def test_1000_concurrent_calls(self, nginx):
        n = self.start(nginx, workers=2, threads=4)
        assert self.get(n, "/many?n=1000") == "ok=1000 bad=0 errors=\n"

        def one(i):
            return self.call(n, "echo:%d" % i)

        with ThreadPoolExecutor(32) as ex:
            res = list(ex.map(one, range(300)))
        assert res == [(200, b"%d" % i) for i in range(300)]

    def test_soak_keeps_rss_flat(self, nginx):
        n = self.start(nginx, threads=2)
        pid = n.worker_pids()[0]
        step = self.SOAK // 4
        for _ in range(2):      # warm up: caches, allocator arenas
            assert self.get(n, "/soak?n=%d" % step,
                            timeout=120) == "ok=%d bad=0 first=\n" % step
        before = rss_kb(pid)
        for _ in range(2):
            assert self.get(n, "/soak?n=%d" % step,
                            timeout=120) == "ok=%d bad=0 first=\n" % step
        after = rss_kb(pid)
        stats = n.get("/stats?rt=%s" % self.NAME).json()
        assert stats["completed"] >= self.SOAK
        assert after - before < 2048, (before, after)

    def test_large_payloads_give_memory_back(self, nginx):
        # 64 MiB payloads and answers, two calls at a time: once they are
        # done the worker's RSS comes back near where it was (a Go worker
        # kept 137 MB)
        n = self.start(nginx, threads=2)
        pid = n.worker_pids()[0]
        assert self.get(n, "/bulk?mib=1&n=2") == "ok=8 bad=0\n"  # warm up
        before = rss_kb(pid)
        assert self.get(n, "/bulk?mib=64&n=2",
                        timeout=120) == "ok=8 bad=0\n"
        peak = rss_kb(pid)
        deadline = time.time() + 5
        after = peak
        while time.time() < deadline:
            time.sleep(0.25)
            after = rss_kb(pid)
            if after - before < 8 * 1024:
                break
        print("%s: worker RSS %d kB before 64 MiB calls, %d kB right "
              "after, %d kB within 5 s" % (self.NAME, before, peak, after))
        assert after - before < 8 * 1024, (before, peak, after)

    # -- signals ------------------------------------------------------------

    def test_signals_stay_with_nginx(self, nginx):
        n = self.start(nginx, threads=4)
        pid = n.worker_pids()[0]
        # the runtime starts its threads while the first calls are served:
        # the last may still be on its way under load
        deadline = time.time() + 10
        while len(thread_names(pid)) < 1 + 4 and time.time() < deadline:
            time.sleep(0.05)
        names = thread_names(pid)
        assert len(names) >= 1 + 4, names
        for tid in names:
            if tid == pid:
                continue
            missing = {name for name, num in NGINX_SIGNALS.items()
                       if num not in blocked_signals(pid, tid)}
            missing -= self.UNBLOCKED_OK
            assert not missing, (tid, names[tid], missing)
        # the worker still reaps its own children while runtime threads
        # are busy: os.execute() gets the shell's exit status
        busy = threading.Thread(target=self.get,
                                args=(n, "/many?n=2000"))
        busy.start()
        try:
            assert self.get(n, "/exec?n=60") == "%d=60\n" % EXIT3_STATUS
        finally:
            busy.join()

    # -- reload and shutdown --------------------------------------------------

    def test_reload_with_calls_in_flight(self, nginx):
        n = self.start(nginx, workers=1, threads=2)
        old = n.worker_pids()
        results = []

        def slow(i):
            results.append(self.call(n, "sleep:800"))

        ts = [threading.Thread(target=slow, args=(i,)) for i in range(6)]
        for t in ts:
            t.start()
        time.sleep(0.3)
        stats_before = n.get("/stats?rt=%s" % self.NAME).json()
        n.reload()
        for t in ts:
            t.join(20)
        assert len(results) == 6
        # in-flight calls finish inside the grace period (5 s default)
        assert all(r == (200, b"slept") for r in results), results
        assert stats_before["running"] + stats_before["queued"] >= 1
        assert n.wait_gone(old, timeout=15)
        assert self.call(n, "echo:new") == (200, b"new")

    def test_reload_closes_calls_past_the_grace_period(self, nginx):
        n = self.start(nginx, workers=1, threads=2, opts="grace = 0.3",
                       shutdown_timeout="60s")
        old = n.worker_pids()
        results = []

        def slow():
            results.append(self.call(n, "sleep:600000", timeout=900))

        ts = [threading.Thread(target=slow, daemon=True) for _ in range(4)]
        for t in ts:
            t.start()
        deadline = time.time() + 5
        while time.time() < deadline:
            st = n.get("/stats?rt=%s" % self.NAME).json()
            if st["running"] + st["queued"] == 4:
                break
            time.sleep(0.02)
        else:
            raise AssertionError("the calls never got in flight")
        n.reload()
        for t in ts:
            t.join(30)
        # the old worker closed its queue after 0.3 s: every call got
        # "closed" (the runtime saw them cancelled), and the worker left
        assert results == [(500, b"ERR closed")] * 4, results
        assert n.wait_gone(old, timeout=15)
        assert self.call(n, "echo:new") == (200, b"new")

    def test_quit_with_a_stuck_call(self, nginx):
        # nginx's own worker_shutdown_timeout is far away: only the
        # runtime's grace period can end the stuck call
        n = self.start(nginx, threads=1, opts="grace = 0.5",
                       shutdown_timeout="60s")
        pid = n.worker_pids()[0]
        result = []

        def stuck():
            try:
                result.append(self.call(n, "stuck:600000", timeout=900,
                                        http_timeout=60))
            except Exception as e:      # connection closed at exit
                result.append(e)

        t = threading.Thread(target=stuck, daemon=True)
        t.start()
        deadline = time.time() + 5
        while time.time() < deadline:
            if n.get("/stats?rt=%s" % self.NAME).json()["running"] == 1:
                break
            time.sleep(0.02)
        else:
            raise AssertionError("the stuck call never started")
        # the call sleeps 10 minutes and nginx would wait 60 s: quit()
        # returning within its 30 s shows the grace period ended the call
        n.quit(timeout=30)
        assert n.wait_gone([pid], 5)
        t.join(10)
        assert result and result[0] == (500, b"ERR closed"), result


class TestRust(RuntimeSuite):
    NAME = "rust"
    LIB = os.path.join(ROOT, "runtimes/rust/build/libloom_rt_rust_example.so")
    CONFIG = "mode=ops"
    PANIC_RE = (r"^ERR runtime error: panicked at examples/cache\.rs:\d+:\d+:"
                r" boom$")
    PANIC_LOG_RE = (r"\[error\].*\[loom\.offload\] \S+rust_example\.so: "
                    r"rust handler \S*::Cache panicked at "
                    r"examples/cache\.rs:\d+:\d+: (boom|again)")
    SOAK = SOAK_CALLS

    def test_threads_are_named(self, nginx):
        n = self.start(nginx, threads=3)
        names = thread_names(n.worker_pids()[0]).values()
        assert sorted(x for x in names if x.startswith("loom-rs-")) == [
            "loom-rs-0", "loom-rs-1", "loom-rs-2"]

    def test_failing_constructor_fails_the_load(self, nginx):
        n = self.start(nginx, config="mode=nope", ready=False)
        n.allow_log(r"failed to create handler: unknown mode: nope")
        # the start-up error is logged; calls get "closed"
        assert self.call(n, "echo:x") == (500, b"ERR closed")
        n.wait_log(r"failed to create handler: unknown mode: nope")
