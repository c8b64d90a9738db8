"""The Java offload runtime (runtimes/java): handlers on the threads of a
JVM embedded in each worker, and its life with nginx's signals."""

import os
import re
import shutil
import signal
import subprocess
import threading
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
RT_DIR = os.path.join(ROOT, "runtimes", "java")
LIB = os.path.join(RT_DIR, "build", "libloom_rt_java.so")
EXAMPLES = os.path.join(RT_DIR, "build", "loom-examples.jar")
JAVA_HOME = "/usr/lib/jvm/java-17-openjdk-amd64"
# -Xcheck:jni: the JVM checks every JNI call the runtime makes
CONFIG = ("classpath=%s xmx=48m cpus=1 jvm_options=-Xcheck:jni,"
          "-XX:+UseSerialGC" % EXAMPLES)


@pytest.fixture(scope="module", autouse=True)
def java_runtime():
    if not os.path.exists(os.path.join(JAVA_HOME, "bin", "javac")):
        pytest.skip("no JDK (Debian package openjdk-17-jdk-headless)")
    subprocess.run(["make", "-s", "-C", RT_DIR], check=True)


# what -Xcheck:jni prints (through the runtime's vfprintf hook, on the
# worker's stderr, that is the error log) about a JNI call made wrongly
JNI_CHECK = re.compile(r"WARNING in native method|FATAL ERROR in native "
                       r"method|WARNING: JNI local refs")

STARTED = []


@pytest.fixture(autouse=True)
def no_jni_warnings(nginx):
    """Every instance's log, read after it stopped, has no JNI check
    warning (the harness looks only at [error]/[crit]/[alert] lines)."""
    del STARTED[:]
    yield
    for n in STARTED:
        n.stop()
        bad = [line for line in n.error_log().splitlines()
               if JNI_CHECK.search(line)]
        assert not bad, "\n".join(bad[:10])


def start(nginx, workers=1, threads=2, queue=64, timeout=5, cfg=CONFIG,
          server="", lib=LIB, **kw):
    http = """
    init_worker_by_lua_block {
        local offload = require "resty.loom.offload"
        JAVA, JAVA_ERR = offload.load("%s", "%s",
            { threads = %d, queue = %d, timeout = %s, grace = 2 })
    }
    """ % (lib, cfg, threads, queue, timeout)
    server = """
    location /call {
        content_by_lua_block {
            if not JAVA then
                ngx.status = 500
                return ngx.say("load failed: ", JAVA_ERR)
            end
            local a = ngx.req.get_uri_args()
            local res, err = JAVA:call(a.c, a.d or "",
                a.t and { timeout = tonumber(a.t) } or nil)
            if not res then
                ngx.status = 502
                return ngx.print("ERR ", err)
            end
            ngx.print(res)
        }
    }
    location /plain { content_by_lua_block { ngx.say("plain") } }
    location /running {
        content_by_lua_block { ngx.print(JAVA:stats().running) }
    }
    """ + server
    n = nginx(workers=workers, http=http, server=server, **kw)
    STARTED.append(n)
    return n


def call(n, cls, d="", t=None, **kw):
    q = "/call?c=loom.example.%s&d=%s" % (cls, d.replace(" ", "%20"))
    if t is not None:
        q += "&t=%s" % t
    return n.get(q, timeout=kw.pop("timeout", 30), **kw)


def test_calls_and_state(nginx):
    n = start(nginx)
    r = call(n, "Echo", "hello")
    assert (r.status, r.text) == (200, "hello")
    got = [call(n, "Counter").text for _ in range(20)]
    # one handler instance per class and load, state kept between calls
    assert got == ["%d 1" % i for i in range(1, 21)]
    import hashlib
    h = b"abc"
    for _ in range(1000):
        h = hashlib.sha256(h).digest()
    assert call(n, "Work", "sha256 1000 abc").text == h.hex()
    assert call(n, "Work", "null").status == 200


def test_each_call_runs_its_own_handler(nginx):
    # one thread takes every task, and keeps the String of the last
    # handler name for the next task that names the same: a task naming
    # another handler (a longer or shorter name, one too long to keep, an
    # empty one) must get that handler, never the previous one
    n = start(nginx, threads=1, server="""
    location /raw {
        content_by_lua_block {
            local res, err = JAVA:call("\\0" .. ngx.var.arg_d)
            ngx.print(res or err)
        }
    }
    """)
    n.allow_log(r"java handler ")
    long_name = "E" * 300
    steps = [("Echo", "a", "a"), ("Counter", "", "1 1"),
             ("Counter", "", "2 1"), ("Echo", "b", "b"), ("Work", "null", ""),
             ("Echo", "c", "c"), (long_name, "x", None), ("Echo", "d", "d"),
             (long_name, "y", None), ("Counter", "", "3 1")]
    for cls, d, want in steps:
        r = call(n, cls, d)
        if want is None:
            assert r.status == 502 and "ClassNotFoundException: " \
                "loom.example.%s" % long_name in r.text, r.text
        else:
            assert (r.status, r.text) == (200, want), (cls, r.text)
    # no name at all (rt:call(payload) with a NUL first): no handler
    r = n.get("/raw?d=loom.example.Echo")
    assert "ClassNotFoundException" in r.text, r.text
    assert call(n, "Echo", "e").text == "e"


def test_exception_is_the_error_and_is_logged_with_its_trace(nginx):
    n = start(nginx)
    n.allow_log(r"java handler (loom\.example\.(Work|Nope)|java\.lang\.String): ")
    r = call(n, "Work", "fail it broke")
    assert (r.status, r.text) == (
        502, "ERR runtime error: java.lang.IllegalStateException: it broke")
    n.wait_log(r"java handler loom\.example\.Work: "
               r"java\.lang\.IllegalStateException: it broke")
    log = n.error_log()
    assert "at loom.example.Work.call(Work.java:" in log
    assert log.count("IllegalStateException: it broke") == 1
    # a missing class, and a class that is no Handler
    r = call(n, "Nope")
    assert "java.lang.ClassNotFoundException: loom.example.Nope" in r.text
    r = n.get("/call?c=java.lang.String&d=x")
    assert "does not implement loom.offload.Handler" in r.text
    assert call(n, "Echo", "still").text == "still"


def test_event_loop_stays_free_and_cancellation(nginx):
    n = start(nginx, threads=1)
    out = []
    th = threading.Thread(target=lambda: out.append(
        call(n, "Work", "sleep 1500")))
    th.start()
    time.sleep(0.3)
    t0 = time.time()
    plain = [n.get("/plain").text for _ in range(10)]
    took = time.time() - t0
    th.join()
    assert plain == ["plain\n"] * 10 and took < 1.0, took
    assert out[0].text == "slept"
    # a timed-out call is cancelled: the handler sees it and the only
    # thread is free again at once
    r = call(n, "Work", "sleep 5000", t=0.2)
    assert (r.status, r.text) == (502, "ERR timeout")
    t0 = time.time()
    assert call(n, "Echo", "next", t=3).text == "next"
    assert time.time() - t0 < 2


def test_jvm_options_are_per_worker_and_checked(nginx):
    n = start(nginx, workers=2, server="""
    location /second {
        content_by_lua_block {
            local offload = require "resty.loom.offload"
            local rt, err = offload.load("%s",
                "classpath=%s xmx=256m", { threads = 1 })
            ngx.say(rt and "loaded" or err)
            local res, e = rt:call("loom.example.Echo", "x")
            ngx.say(res, " ", e)
        }
    }
    """ % (LIB, EXAMPLES))
    n.allow_log(r"this worker's JVM was started with")
    r = n.get("/second")
    # the load starts asynchronously; its calls fail and the reason is
    # logged
    assert "nil closed" in r.text
    n.wait_log(r"this worker's JVM was started with .*xmx=48m")
    # one JVM in each worker process, none in the master
    pids = n.worker_pids()
    for pid in pids:
        maps = open("/proc/%d/maps" % pid).read()
        assert "libjvm.so" in maps
    master = int(open(os.path.join(n.prefix, "logs", "nginx.pid")).read())
    assert "libjvm.so" not in open("/proc/%d/maps" % master).read()


def test_jvm_that_cannot_start_is_reported_without_a_crash_loop(nginx):
    n = start(nginx, workers=1, cfg="classpath=%s xmx=48m "
              "jvm_options=-XX:+NoSuchOptionAtAll" % EXAMPLES)
    n.allow_log(r"NoSuchOptionAtAll|failed to create the JVM")
    n.wait_log(r"failed to create the JVM \(error -?\d+\)")
    pid = n.worker_pids()
    r = call(n, "Echo", "x")
    assert (r.status, r.text) == (502, "ERR closed")
    assert n.worker_pids() == pid


def test_heap_too_large_exits_a_bounded_number_of_times(nginx):
    # HotSpot exits the process when it cannot reserve the heap: the
    # worker dies; after 3 such exits the runtime stops trying
    n = start(nginx, workers=1, cfg="classpath=%s xmx=100000g" % EXAMPLES)
    n.allow_log(r"object heap|exited with code 1|JVM exited the worker|initialization of VM"
                r"|failed to create|Could not")
    n.wait_log(r"the JVM exited the worker 3 times", timeout=60)
    pid = n.worker_pids()
    time.sleep(1)
    assert n.worker_pids() == pid
    assert call(n, "Echo", "x").text == "ERR closed"


def test_hup_quit_and_worker_crash(nginx):
    n = start(nginx, workers=2, threads=2)
    assert call(n, "Echo", "a").text == "a"
    n.reload()
    assert call(n, "Echo", "b").text == "b"
    # kill -9 a worker: the master makes a new one with a new JVM
    pids = n.worker_pids()
    n.allow_log(r"exited on signal 9")
    n.kill(pids[0], signal.SIGKILL)
    n.wait_workers(2)
    for _ in range(6):
        assert call(n, "Echo", "c").text == "c"
    # QUIT with a call in flight: answered before the worker goes
    out = []
    th = threading.Thread(target=lambda: out.append(
        call(n, "Work", "sleep 800")))
    th.start()
    time.sleep(0.3)
    n.quit()
    th.join()
    assert out[0].text == "slept"


def test_term_stops_workers_with_their_jvms(nginx):
    n = start(nginx, workers=2)
    assert call(n, "Echo", "a").text == "a"
    master = int(open(os.path.join(n.prefix, "logs", "nginx.pid")).read())
    pids = n.worker_pids()
    os.kill(master, signal.SIGTERM)
    deadline = time.time() + 15
    while time.time() < deadline and any(
            os.path.exists("/proc/%d" % p) for p in pids + [master]):
        time.sleep(0.05)
    assert not any(os.path.exists("/proc/%d/status" % p) and
                   "zombie" not in open("/proc/%d/status" % p).read()
                   for p in pids + [master])


def test_payload_larger_than_the_heap_is_an_error_and_the_thread_stays(
        nginx):
    # the request is copied into a Java byte[]: one larger than the heap
    # throws OutOfMemoryError in the copy, before the handler runs. The
    # call must get that error and the only thread keep serving (it used
    # to die with the task unanswered: every later call timed out)
    n = start(nginx, threads=1, timeout=5,
              cfg="classpath=%s xmx=16m cpus=1 jvm_options=-Xcheck:jni,"
                  "-XX:+UseSerialGC" % EXAMPLES,
              server="""
    location /big {
        content_by_lua_block {
            local res, err = JAVA:call("loom.example.Echo",
                                       string.rep("x", 48 * 1024 * 1024))
            ngx.print(res and #res or err)
        }
    }
    """)
    n.allow_log(r"java handler loom\.example\.Echo: "
                r"java\.lang\.OutOfMemoryError")
    assert call(n, "Echo", "warm").text == "warm"
    r = n.get("/big", timeout=30)
    assert r.text == "runtime error: java.lang.OutOfMemoryError: " \
        "Java heap space", r.text
    for i in range(3):
        assert call(n, "Echo", "after%d" % i, t=5).text == "after%d" % i
    n.wait_log(r"java handler loom\.example\.Echo: "
               r"java\.lang\.OutOfMemoryError: Java heap space")


def test_reloads_while_jvms_start_do_not_count_as_crashes(nginx):
    # workers that a reload (or quit) retires while their JVM is still
    # starting exit normally: that is no JVM crash, and must not count
    # towards the 3 exits after which the runtime stops trying. Old
    # workers made the count reach 4 in one reload, and the next
    # generation refused to start Java at all
    n = start(nginx, workers=4, timeout=20,
              cfg="classpath=%s xmx=48m cpus=1 jvm_options=-Xcheck:jni,"
                  "-XX:+UseSerialGC,-Xms48m,-XX:+AlwaysPreTouch" % EXAMPLES)
    n.allow_log(r"still starting at exit|SIGSEGV handler modified")
    n.reload()
    n.reload()
    for i in range(8):
        r = call(n, "Echo", "x%d" % i, t=20)
        assert r.text == "x%d" % i, r.text
    assert "exited the worker" not in n.error_log()


def test_quit_with_a_handler_stuck_in_java_ends_after_the_grace(nginx):
    # a handler that never looks at cancellation holds the only Java
    # thread: QUIT closes the queue after the grace (2 s), the call gets
    # "closed", the runtime is abandoned after another grace, and the
    # worker exits with the JVM's threads still running, without a crash
    n = start(nginx, threads=1)
    n.allow_log(r"did not shut down within 2000 ms")
    out = []
    th = threading.Thread(target=lambda: out.append(
        call(n, "Work", "hang 60000", t=120, timeout=120)))
    th.start()
    deadline = time.time() + 10
    while n.get("/running").text != "1":
        assert time.time() < deadline
        time.sleep(0.05)
    t0 = time.time()
    n.quit()
    took = time.time() - t0
    th.join()
    assert out[0].text == "ERR closed"
    # the handler sleeps 60 s: nginx did not wait for it
    assert took < 30, took
    log = n.error_log()
    assert "did not shut down within 2000 ms, abandoned" in log
    assert "exited on signal" not in log


def test_misspelled_configuration_key_fails_the_load(nginx):
    # "xmxx=256m" was ignored: the JVM started with the default 64m heap
    # and nothing said so
    n = start(nginx, cfg="classpath=%s xmxx=256m" % EXAMPLES)
    n.allow_log(r'failed to start .*bad configuration "xmxx=256m"')
    n.wait_log(r'bad configuration "xmxx=256m": want <key>=<value>, the '
               r'keys being classpath, xmx, cpus, jvm_options, java_home')
    assert call(n, "Echo", "x").text == "ERR closed"


def test_handler_name_that_is_not_utf8(nginx):
    # the name goes to Java through NewStringUTF, which wants modified
    # UTF-8: bytes that are not must give the call an error, not a JNI
    # check warning or a crash
    n = start(nginx)
    n.allow_log(r"java handler ")
    pid = n.worker_pids()
    r = n.get("/call?c=loom.%FF%FE%C0%80x&d=x")
    assert r.status == 502 and r.text.startswith("ERR runtime error: "), \
        r.text
    assert call(n, "Echo", "after").text == "after"
    assert n.worker_pids() == pid


def test_jvm_without_the_api_classes_fails_every_load_cleanly(nginx, tmp_path):
    # the JVM starts but loom.offload.Native cannot be found (a broken or
    # foreign loom-offload.jar next to the library): the first load fails,
    # and a second load in that worker used to dereference a NULL key and
    # kill the worker
    lib = tmp_path / "libloom_rt_java.so"
    shutil.copy(LIB, lib)
    with open(tmp_path / "loom-offload.jar", "wb") as f:
        f.write(b"PK\x05\x06" + b"\0" * 18)     # an empty zip
    n = start(nginx, cfg="classpath=%s xmx=48m cpus=1" % EXAMPLES, lib=lib,
              server="""
    location /again {
        content_by_lua_block {
            local offload = require "resty.loom.offload"
            local rt = assert(offload.load("%s",
                "classpath=%s xmx=48m cpus=1", { threads = 1 }))
            ngx.say(rt:wait_ready(10))
        }
    }
    """ % (lib, tmp_path))
    n.allow_log(r"failed to start .*libloom_rt_java\.so: "
                r"(failed to find loom\.offload\.Native|this worker's JVM)")
    n.wait_log(r"failed to find loom\.offload\.Native", timeout=30)
    pid = n.worker_pids()
    assert n.get("/again", timeout=30).text.startswith(
        "nilfailed to start: ")
    assert n.worker_pids() == pid
    assert "exited on signal" not in n.error_log()
