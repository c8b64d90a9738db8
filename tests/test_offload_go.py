"""The Go offload runtime (runtimes/go, cgo, -buildmode=c-shared) through
real nginx: the shared RuntimeSuite (tests/test_offload_rust.py) plus what
is special about Go (its runtime's threads and signal handlers)."""

import os
import re
import signal

from test_offload_rust import ROOT, SOAK_CALLS, RuntimeSuite, thread_names


def signal_handlers(pid):
    """Signals with a handler installed (SigCgt) in process pid."""
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("SigCgt:"):
                mask = int(line.split()[1], 16)
                return {s for s in range(1, 65) if mask & (1 << (s - 1))}
    raise AssertionError("no SigCgt")


class TestGo(RuntimeSuite):
    NAME = "go"
    LIB = os.path.join(ROOT, "runtimes/go/build/libloom_rt_go_example.so")
    CONFIG = "mode=ops"
    PANIC_RE = (r"^ERR runtime error: panic at .*/examples/cache/main\.go:\d+:"
                r" boom$")
    PANIC_LOG_RE = (r"\[error\].*\[loom\.offload\] \S+go_example\.so: "
                    r"go handler \*main\.\w+ panic at "
                    r".*/examples/cache/main\.go:\d+: (boom|again)")
    SOAK = SOAK_CALLS
    # Go's runtime unblocks SIGCHLD on every thread it creates; the
    # package wraps nginx's SIGCHLD handler so that it forwards the signal
    # to the main thread (without that, os.execute() got -1 in 14-34% of
    # calls while goroutines were busy; test_signals_stay_with_nginx
    # checks the exit statuses)
    UNBLOCKED_OK = {"SIGCHLD"}

    def test_go_keeps_nginx_signal_handlers(self, nginx):
        # nginx's worker catches SIGCHLD, SIGHUP, SIGQUIT, SIGTERM, ...;
        # loading Go must leave those handlers to nginx (Go in c-shared
        # mode adds handlers for faults, SIGPIPE and SIGURG only)
        plain = nginx(workers=1, server="location /t { return 200; }")
        base = signal_handlers(plain.worker_pids()[0])
        n = self.start(nginx, threads=4)
        pid = n.worker_pids()[0]
        with_go = signal_handlers(pid)
        assert base <= with_go, base - with_go
        added = with_go - base
        # faults, SIGPIPE, SIGURG (preemption), glibc's own 32 and 33
        assert added <= {4, 5, 6, 7, 8, 11, 13, 23, 31, 32, 33}, \
            sorted(added)
        for sig in (1, 3, 10, 12, 14, 15, 17, 28, 29):
            assert sig in with_go, sig
        # the goroutines serving calls run on their own OS threads
        assert len(thread_names(pid)) > 4

    def test_sigpipe_is_still_ignored(self, nginx):
        # Go installs its own SIGPIPE handler; nginx ignores SIGPIPE, and
        # Go must forward to that: a SIGPIPE (as a write to a dead peer
        # raises) must not kill the worker
        n = self.start(nginx, threads=2)
        pid = n.worker_pids()[0]
        assert 13 in signal_handlers(pid)   # Go's handler is there
        for _ in range(3):
            os.kill(pid, signal.SIGPIPE)
            assert self.call(n, "echo:alive") == (200, b"alive")
        assert n.worker_pids() == [pid]

    def test_failing_constructor_fails_the_load(self, nginx):
        n = self.start(nginx, config="mode=nope", ready=False)
        n.allow_log(r"failed to create handler: unknown mode: nope")
        assert self.call(n, "echo:x") == (500, b"ERR closed")
        n.wait_log(re.escape("failed to create handler: unknown mode: nope"))
