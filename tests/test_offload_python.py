"""The Python offload runtime (runtimes/python: CPython embedded by a C
loader) through real nginx: the shared RuntimeSuite
(tests/test_offload_rust.py) plus what is special about Python."""

import os
import time

from test_offload_rust import ROOT, SOAK_CALLS, RuntimeSuite

EXAMPLES = os.path.join(ROOT, "runtimes/python/examples")
PY_TESTS = os.path.join(ROOT, "runtimes/python/tests")


class TestPython(RuntimeSuite):
    NAME = "python"
    LIB = os.path.join(ROOT, "runtimes/python/build/libloom_rt_python.so")
    CONFIG = "path=%s module=loom_example function=handle" % EXAMPLES
    PANIC_OP = "raise:"
    PANIC_RE = (r"(?s)^ERR runtime error: ValueError: boom\n"
                r"Traceback \(most recent call last\):\n"
                r".*loom_example\.py\", line \d+, in handle\n"
                r".*\nValueError: boom$")
    PANIC_LOG_RE = (r"\[error\].*\[loom\.offload\] \S+rt_python\.so: "
                    r"python handler loom_example\.handle raised ValueError: "
                    r"(boom|again)")
    PANIC_LOG_MORE = (r"\nTraceback \(most recent call last\):\n"
                      r".*loom_example\.py\", line \d+, in handle\n")
    SOAK = SOAK_CALLS
    ECHO_CONFIG = "path=%s module=loom_example function=echo" % EXAMPLES

    def test_returned_error(self, nginx):
        # the handler must return bytes-like data (or str, or None)
        n = self.start(nginx)
        n.allow_log(r"python handler loom_example\.handle raised TypeError")
        status, body = self.call(n, "int:5")
        assert status == 500
        assert body.startswith(b"ERR runtime error: TypeError: handler "
                               b"returned int, expected bytes"), body

    def test_extension_modules_load(self, nginx):
        # hashlib's _hashlib is a lib-dynload extension: it needs
        # libpython's symbols although nginx loads the runtime RTLD_LOCAL
        import hashlib
        n = self.start(nginx)
        assert self.call(n, "sha256:abc") == (
            200, hashlib.sha256(b"abc").hexdigest().encode())

    def test_init_function_gets_the_config(self, nginx):
        cfg = self.CONFIG + " init=setup pool=4"
        n = self.start(nginx, config=cfg)
        assert self.call(n, "config:") == (200, cfg.encode())

    def test_missing_module_fails_the_load(self, nginx):
        n = self.start(nginx, ready=False,
                       config="path=%s module=no_such_module" % EXAMPLES)
        n.allow_log(r"ModuleNotFoundError")
        assert self.call(n, "echo:x") == (500, b"ERR closed")
        n.wait_log(r"failed to load python handler: ModuleNotFoundError: "
                   r"No module named 'no_such_module'")

    def test_slow_start_stays_off_the_event_loop(self, nginx):
        # the module's import sleeps a second: the worker answers other
        # requests meanwhile (it reports the runtime still starting, which
        # it could not if start-up blocked the event loop), and calls
        # wait in the queue
        n = self.start(nginx, ready=False, workers=1,
                       config="path=%s module=slow_start" % PY_TESTS)
        assert n.get("/state?rt=python").text == "starting\n"
        assert self.call(n, "x", timeout=10) == (200, b"started:x")
        # (an answer caught by the poll may come back before the event loop
        # has handled the start-up notice: ready within an iteration or so)
        deadline = time.time() + 2
        while n.get("/state?rt=python").text != "ready\n":
            assert time.time() < deadline, "still not ready"
            time.sleep(0.01)
        n.wait_log(r"slow_start imported")
        # a second load in the same worker reuses the interpreter
        assert self.call(n, "y") == (200, b"started:y")

    def test_subprocess_gets_the_exit_status(self, nginx):
        # nginx's worker reaps its children on SIGCHLD (waitpid(-1)):
        # subprocess then found its child gone and reported returncode 0
        # for commands that failed (7 of 20). Children of runtime threads
        # are left to them now: every call gets the real status
        n = self.start(nginx, threads=2)
        for code in (3, 0, 1) * 10:
            assert self.call(n, "exit:%d" % code) == (200, b"%d" % code)
        # and from both threads at once
        out = self.get(n, "/many?n=40&op=exit")
        assert out == "ok=40 bad=0 errors=\n", out

    def test_subprocess_status_lost_is_an_error(self, nginx):
        # a child something else reaped: subprocess gave returncode 0;
        # now wait() and poll() raise
        n = self.start(nginx, config="path=%s module=reaped" % PY_TESTS)
        n.allow_log(r"python handler reaped\.handle raised ChildProcessError")
        for op in ("wait", "poll"):
            status, body = self.call(n, op)
            assert status == 500, body
            assert body.startswith(
                b"ERR runtime error: ChildProcessError: [Errno 10] exit "
                b"status of process "), body
            assert b"lost: something else in the nginx worker reaped it" \
                in body, body
