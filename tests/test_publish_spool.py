"""resty.loom.publish with a spool (opts.spool): nothing send() accepted is
lost on a fast stop, a kill -9, a reload, a full disk or garbage in the
files; duplicates only of messages in flight at the stop, with the same
loom_id; bad options refused."""

import base64
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time
import urllib.parse

import pytest

from loomtest.nginx import _alive
from pubsub import harness as H
from pubsub.fake import FakePubSub

KEPT = re.compile(r"(\d+) messages kept in the spool at worker exit "
                  r"\((\d+) written in ([\d.]+) ms, (\d+) there already\)")
SLOW = ("slow", 0.2)            # the fake answers each publish after 200 ms

METRICS = """
location = /metrics { content_by_lua_block {
    local status = require "resty.loom.status"
    ngx.print(require("resty.loom.status.prometheus").render(
        status.collect())) } }
"""


@pytest.fixture
def fake():
    f = FakePubSub()
    f.default = SLOW
    yield f
    f.close()


@pytest.fixture
def spool_dir():
    d = tempfile.mkdtemp(prefix="loom-spool-")
    yield os.path.join(d, "spool")
    shutil.rmtree(d, ignore_errors=True)


def conf(fake, spool, **kw):
    # batches leave by count (1000) or at exit, not by delay
    c = {"emulator_host": fake.host, "batch_max_delay": 60,
         "spool": spool}
    c.update(kw)
    return c


def spool_files(spool):
    try:
        return sorted(n for n in os.listdir(spool) if n.endswith(".spool"))
    except FileNotFoundError:
        return []


def received(fake):
    with fake.lock:
        return [(m["data"], m["attributes"].get("loom_id"))
                for m in fake.messages]


def wait_delivered(fake, want, timeout=30):
    want = set(want)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if want <= set(d for d, _ in received(fake)):
            return True
        time.sleep(0.05)
    return False


def check_delivery(fake, want, max_dups):
    """Every message of want arrived, nothing else did; at most max_dups
    of them more than once (those in flight at the stop: a request
    retried during a graceful exit may bring a third copy), with the same
    loom_id each time; ids are unique. Returns how many came again."""
    ids = {}
    for data, mid in received(fake):
        ids.setdefault(data, []).append(mid)
    missing = set(want) - set(ids)
    assert not missing, "%d lost, e.g. %r" % (len(missing),
                                              sorted(missing)[:3])
    assert set(ids) == set(want)
    dups = sum(1 for v in ids.values() if len(v) > 1)
    copies = sum(len(v) - 1 for v in ids.values())
    assert dups <= max_dups, (dups, copies, max_dups)
    for data, v in ids.items():
        assert v[0] and len(set(v)) == 1, (data, v)
    first = [v[0] for v in ids.values()]
    assert len(set(first)) == len(first)
    return dups


def check_order(fake, keyed):
    """Per ordering key and per request (one worker's publisher took it),
    the messages first arrived in the order they were sent."""
    seen = set()
    last = {}
    for data, _ in received(fake):
        if data in seen or data not in keyed:
            continue
        seen.add(data)
        prefix, j = data.decode().rsplit("-", 2)[:2]
        k = (prefix, keyed[data])
        assert int(j) > last.get(k, 0), (data, last.get(k))
        last[k] = int(j)


def keyed_datas(count, prefix, size, per_request, keys):
    """data -> ordering key, as publish_helper gives them"""
    out = {}
    datas = H.expected_datas(count, prefix, size, per_request=per_request)
    for n, d in enumerate(datas):
        key = keys[(n % per_request) % len(keys)]
        if key:
            out[d] = key
    return out


def stats(n):
    r = n.get("/stats")
    assert r.status == 200, r
    return r.json()


def stop_fast(n):
    """nginx -s stop: TERM, then wait for the master to go."""
    n.signal(signal.SIGTERM)
    assert n.wait_gone([n.master_pid], 10)
    n.master_pid = None


# -- a fast stop ------------------------------------------------------------

def test_term_with_30000_buffered_then_a_new_nginx_delivers_all(
        nginx, fake, spool_dir):
    # the first request of each worker takes 1.5 s: nothing is
    # acknowledged before the TERM, so all 30,000 are buffered (2,000 of
    # them in flight, which the fake takes too: duplicates)
    fake.script(("slow", 1.5), ("slow", 1.5))
    n = H.publisher(nginx, conf(fake, spool_dir, concurrency=1), workers=2)
    keys = ["a", "b", ""]
    ok, errors = H.send(n, 30000, "term", size=100, per_request=1000,
                        keys=keys)
    assert (ok, errors) == (30000, {})
    stop_fast(n)
    kept = KEPT.findall(n.error_log())
    assert len(kept) == 2, n.error_log()[-3000:]
    assert sum(int(k[0]) for k in kept) == 30000
    # the exit path's speed, as measured by the worker
    rate = sum(int(k[1]) for k in kept) / (
        sum(float(k[2]) for k in kept) / 1000)
    print("exit write: %s; %.0f messages/s" % (kept, rate))
    assert len(spool_files(spool_dir)) == 2
    # the next nginx on the same spool
    n2 = H.publisher(nginx, conf(fake, spool_dir), workers=2)
    want = H.expected_datas(30000, "term", 100, per_request=1000)
    assert wait_delivered(fake, want)
    # only the 2 batches in flight at the TERM may come twice (they do)
    H.wait_for(lambda: fake.message_count >= 32000, 5)
    dups = check_delivery(fake, want, max_dups=2000)
    print("duplicates:", dups)
    check_order(fake, keyed_datas(30000, "term", 100, 1000, keys))
    assert H.wait_for(lambda: spool_files(spool_dir) == [], 10), \
        spool_files(spool_dir)
    assert "messages not delivered" not in n.error_log() + n2.error_log()


# -- kill -9 ----------------------------------------------------------------

def record_at(path, pick):
    """(offset, data) of a live record of spool file path chosen by pick
    (a function of the list of live records' offsets)."""
    with open(path, "rb") as f:
        blob = f.read()
    head, fill = struct.unpack_from("<I", blob, 12)[0], \
        struct.unpack_from("<I", blob, 20)[0]
    live = []
    off = head
    while off < fill:
        length, _, magic, state, klen = struct.unpack_from("<IIBBH", blob,
                                                          off)
        assert magic == 0xA7
        if state == 0:
            live.append(off)
        off += (12 + length + 7) & ~7
    off = pick(live)
    length, _, _, _, klen = struct.unpack_from("<IIBBH", blob, off)
    msg = json.loads(blob[off + 12 + klen + 1:off + 12 + length])
    return off, base64.b64decode(msg["data"])


def kill_workers_with(n, before_respawn=None):
    """kill -9 of every worker; before_respawn() runs while the master is
    stopped (it respawns them once it runs again)."""
    old = n.worker_pids()
    n.signal(signal.SIGSTOP)
    try:
        for p in old:
            os.kill(p, signal.SIGKILL)
        assert n.wait_gone(old, 10)
        if before_respawn:
            before_respawn()
    finally:
        n.signal(signal.SIGCONT)
    n.allow_log(r"exited on signal 9")
    return n.wait_workers(len(old), exclude=old)


@pytest.mark.parametrize("garbage", [False, True],
                         ids=["clean", "garbage"])
def test_always_kill9_with_30000_buffered_delivers_all(nginx, fake,
                                                       spool_dir, garbage):
    fake.script(*[("slow", 1.5)] * 4)
    n = H.publisher(nginx, conf(fake, spool_dir, spool_mode="always",
                                concurrency=2),
                    workers=2, server=METRICS)
    keys = ["a", "b", "c", ""]
    ok, errors = H.send(n, 30000, "k9", size=100, per_request=1000,
                        keys=keys)
    assert (ok, errors) == (30000, {})
    want = set(H.expected_datas(30000, "k9", 100, per_request=1000))
    lost = set()

    def spoil():
        # 4 KiB of garbage after every file, and one record in the middle
        # of one file overwritten: every other message still goes
        files = spool_files(spool_dir)
        assert len(files) == 2, files
        for name in files:
            with open(os.path.join(spool_dir, name), "ab") as f:
                f.write(os.urandom(4096))
        path = os.path.join(spool_dir, files[0])
        off, data = record_at(path, lambda live: live[len(live) * 3 // 4])
        with open(path, "r+b") as f:
            f.seek(off + 40)
            f.write(b"\xff" * 8)
        lost.add(data)

    kill_workers_with(n, spoil if garbage else None)
    assert wait_delivered(fake, want - lost)
    # only the batches in flight at the kill (4 at most) may come twice
    H.wait_for(lambda: fake.message_count >= 30000 - len(lost) + 4 * 250,
               5)
    dups = check_delivery(fake, want - lost, max_dups=4000)
    print("duplicates:", dups)
    check_order(fake, keyed_datas(30000, "k9", 100, 1000, keys))
    assert H.wait_for(lambda: spool_files(spool_dir) == [], 10), \
        spool_files(spool_dir)
    if garbage:
        n.wait_log(r"bytes after its end cut", count=2)
        n.wait_log(r"bytes of records that do not check skipped")
    # (one worker's figures: no events bus here)
    metrics = n.get("/metrics").text
    if garbage:
        errs = re.findall(r"loom_publish_spool_errors_total\{.*\} (\d+)",
                          metrics)
        assert sum(int(e) for e in errs) >= 1, metrics
    for fam in ("loom_publish_spooled_total", "loom_publish_replayed_total",
                "loom_publish_spool_bytes",
                "loom_publish_spool_errors_total"):
        assert "# TYPE " + fam in metrics
    replayed = re.findall(r"loom_publish_replayed_total\{.*\} (\d+)",
                          metrics)
    assert sum(int(r) for r in replayed) > 0


# -- a full disk ------------------------------------------------------------

@pytest.fixture
def tiny_disk():
    """a 1 MiB tmpfs (we are root), or a skip saying why not"""
    d = tempfile.mkdtemp(prefix="loom-tinyfs-")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs",
                          d], capture_output=True, text=True)
    if res.returncode != 0:
        os.rmdir(d)
        pytest.skip("cannot mount a tmpfs: %s" % res.stderr.strip())
    yield d
    subprocess.run(["umount", "-l", d])
    os.rmdir(d)


def test_full_disk_publishes_from_memory(nginx, fake, tiny_disk, tmp_path):
    err_file = str(tmp_path / "errors")
    c = conf(fake, tiny_disk, spool_mode="always", spool_max_bytes=4194304,
             batch_max_delay=0.05)
    n = H.publisher(nginx, c, workers=1)
    # 20,000 records of about 250 bytes while Pub/Sub is slow: more than
    # the 1 MiB disk holds
    ok, errors = H.send(n, 20000, "full", size=100, per_request=1000)
    assert (ok, errors) == (20000, {})
    st = stats(n)
    assert st["spool_errors"] >= 1 and 0 < st["spooled"] < 20000, st
    n.wait_log(r"spool: failed to allocate .*No space left on device; "
               r"messages are kept in memory only for now")
    # publishing went on: everything arrives
    want = H.expected_datas(20000, "full", 100, per_request=1000)
    assert wait_delivered(fake, want)
    check_delivery(fake, want, max_dups=0)
    n.stop()
    assert spool_files(tiny_disk) == []

    # exit mode on a disk that is full: the fast stop reports what it
    # cannot write, to on_error and in one log line
    filler = os.path.join(tiny_disk, "filler")
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    fake.script(("slow", 3))
    n2 = H.publisher(nginx, conf(fake, tiny_disk, concurrency=1,
                                 err_file=err_file), workers=1)
    n2.allow_log(r"messages not delivered at worker exit")
    ok, errors = H.send(n2, 3000, "stop", size=100, per_request=1000)
    assert (ok, errors) == (3000, {})
    stop_fast(n2)
    log = n2.error_log()
    assert re.search(r"3000 messages not delivered at worker exit \(not "
                     r"written to the spool: failed to allocate .*No space "
                     r"left on device\)", log), log[-3000:]
    reported = []
    for name in os.listdir(str(tmp_path)):
        with open(os.path.join(str(tmp_path), name)) as f:
            for line in f:
                entry = json.loads(line)
                assert entry["reason"].startswith(
                    "worker exiting: not written to the spool (failed to "
                    "allocate "), entry
                reported += [d.encode() for d in entry["datas"]]
    assert sorted(reported) == sorted(
        H.expected_datas(3000, "stop", 100, per_request=1000))
    assert spool_files(tiny_disk) == []


# -- a reload ---------------------------------------------------------------

def test_reload_mid_stream_loses_nothing(nginx, fake, spool_dir):
    # the old workers' flush (0.5 s) cannot send their backlog: they spool
    # the rest at exit, and the new workers adopt it once they are gone
    n = H.publisher(nginx, conf(fake, spool_dir, flush_timeout=0.5,
                                concurrency=2, batch_max_delay=0.05),
                    workers=2)
    sent = []
    stop = threading.Event()
    problems = []

    def stream():
        i = 0
        while not stop.is_set():
            try:
                ok, errors = H.send(n, 500, "re%d" % i, size=100)
            except Exception as e:     # noqa: BLE001 (reported below)
                problems.append(repr(e))
                return
            if errors:
                problems.append(errors)
            sent.append((i, ok))
            i += 1
            time.sleep(0.01)

    t = threading.Thread(target=stream)
    t.start()
    try:
        time.sleep(0.8)
        old = n.worker_pids()
        t0 = time.time()
        n.reload()
        # nobody waits for the spool to empty: the old workers leave
        # after their flush budget
        assert n.wait_gone(old, 10)
        print("old workers gone after %.2f s" % (time.time() - t0))
        time.sleep(0.8)
    finally:
        stop.set()
        t.join()
    assert problems == []
    want = []
    for i, ok in sent:
        assert ok == 500
        want += H.expected_datas(500, "re%d" % i, 100)
    print("sent:", len(want))
    assert wait_delivered(fake, want, 40)
    # messages cut in flight at the old workers' exit may come twice: up
    # to concurrency (2) batches of 1,000 per worker (5,000 was seen once:
    # a sender went on after its cut, see
    # test_exit_flush_sends_no_batch_after_one_was_cut)
    check_delivery(fake, want, max_dups=2 * 2 * 1000)
    kept = KEPT.findall(n.error_log())
    assert kept, "the old workers had nothing left to spool"
    print("kept at exit:", kept)


def test_exit_flush_sends_no_batch_after_one_was_cut(nginx, fake, spool_dir):
    # During the graceful exit's flush the fake takes every request and
    # then resets it: the sender cannot know, and its backoff would overrun
    # the budget, so the batch is kept for the spool (the next nginx sends
    # it again). The sender then stops: what may come twice is at most
    # `concurrency` batches per worker, not every batch the flush had time
    # to try (the reload test saw one batch more per worker so: a request
    # cut a moment before the deadline, by the timer's millisecond, and
    # another batch started in that moment).
    n = H.publisher(nginx, conf(fake, spool_dir, concurrency=1,
                                flush_timeout=1, retry_initial_backoff=10),
                    workers=1)
    keys = ["a", "b", "c"]      # one open batch of 100 per key
    ok, errors = H.send(n, 300, "cut", size=100, keys=keys)
    assert (ok, errors) == (300, {})
    fake.default = "ok_then_reset"
    n.allow_log(r"recv\(\) failed \(104: Connection reset by peer\)")
    n.quit()
    kept = KEPT.findall(n.error_log())
    assert len(kept) == 1 and int(kept[0][0]) == 300, n.error_log()[-3000:]
    taken = fake.message_count
    fake.default = "ok"
    n2 = H.publisher(nginx, conf(fake, spool_dir), workers=1)
    want = H.expected_datas(300, "cut", 100)
    assert wait_delivered(fake, want)
    assert H.wait_for(lambda: spool_files(spool_dir) == [], 10), \
        spool_files(spool_dir)
    # one batch (of the one sender) was taken at the exit, then sent again
    assert taken == 100, taken
    assert check_delivery(fake, want, max_dups=100) == 100
    assert "messages not delivered" not in n.error_log() + n2.error_log()


# -- a directory the workers cannot write to --------------------------------

@pytest.fixture
def open_tmp():
    d = tempfile.mkdtemp(prefix="loom-spool-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_unwritable_directory(nginx, fake, open_tmp):
    root_only = os.path.join(open_tmp, "root-only")
    os.mkdir(root_only, 0o755)          # the workers run as nobody
    # new() in init_worker: a clear error, no publisher
    n = H.publisher(nginx, conf(fake, root_only), workers=1, user="nobody nogroup")
    n.allow_log(r"publish_helper: opts.spool cannot be used")
    n.wait_log(r"publish_helper: opts.spool cannot be used: failed to "
               r"write to %s: Permission denied \(this worker runs as uid "
               r"\d+\)" % re.escape(root_only))
    # new() in init (the master, as root) leaves the check to the
    # workers: publish.init_worker() logs it, counts it, and the
    # publisher goes on from memory
    missing = os.path.join(root_only, "spool")
    blob = json.dumps(conf(fake, missing, batch_max_delay=0.05,
                           project="loom-proj", topic="topic-1"))
    n2 = nginx(workers=1, user="nobody nogroup", http="""
        init_by_lua_block {
            P = require("resty.loom.publish").new(
                require("cjson").decode([==[%s]==]))
        }
        init_worker_by_lua_block {
            assert(require("resty.loom.publish").init_worker())
        }""" % blob, server="""
        location = /send { content_by_lua_block {
            ngx.say(P:send(ngx.var.arg_data) and "ok") } }
        location = /stats { content_by_lua_block {
            ngx.say(require("cjson").encode(P:stats())) } }""")
    n2.allow_log(r"opts.spool cannot be used")
    n2.wait_log(r"loom-proj/topic-1: opts.spool cannot be used: failed to "
                r"create directory %s: Permission denied \(this worker runs "
                r"as uid \d+\); publishing from memory only"
                % re.escape(missing))
    assert not os.path.exists(missing)
    fake.default = "ok"
    for i in range(5):
        assert n2.get("/send?data=mem%d" % i).text.strip() == "ok"
    assert wait_delivered(fake, [b"mem%d" % i for i in range(5)])
    st = n2.get("/stats").json()
    assert st["spool_errors"] == 1 and st["spooled"] == 0, st


# -- options ----------------------------------------------------------------

OPTIONS_LUA = r"""
location = /bad { content_by_lua_block {
    local cjson = require "cjson"
    local publish = require "resty.loom.publish"
    local dir = ngx.var.arg_dir
    local base = { project = "p", topic = "topic-x",
                   emulator_host = "127.0.0.1:9" }
    local function with(extra)
        local o = {}
        for k, v in pairs(base) do o[k] = v end
        for k, v in pairs(extra) do o[k] = v end
        return o
    end
    local cases = {
        { "spool_dir", with({ spool_dir = dir }) },
        { "spool number", with({ spool = 5 }) },
        { "spool relative", with({ spool = "spool/x" }) },
        { "spool empty", with({ spool = "" }) },
        { "spool table", with({ spool = {} }) },
        { "mode", with({ spool = dir, spool_mode = "sometimes" }) },
        { "mode bool", with({ spool = dir, spool_mode = true }) },
        { "mode alone", with({ spool_mode = "always" }) },
        { "max alone", with({ spool_max_bytes = 1048576 }) },
        { "max small", with({ spool = dir, spool_max_bytes = 4096 }) },
        { "max fraction", with({ spool = dir, spool_max_bytes = 1e6 + .5 }) },
    }
    for _, v in ipairs({ 0/0, 1/0, -1/0, 0, -1, "1" }) do
        cases[#cases + 1] = { "max=" .. tostring(v),
                              with({ spool = dir, spool_max_bytes = v }) }
    end
    local out = {}
    for _, c in ipairs(cases) do
        local ok, err = pcall(publish.new, c[2])
        out[#out + 1] = { c[1], ok, ok and "" or tostring(err) }
    end
    local made = os.rename(dir, dir) and true or false
    -- and a good one, for contrast
    local p, err = publish.new(with({ spool = dir, spool_mode = "always",
                                      spool_max_bytes = 65536 }))
    local attrs = {}
    for i = 1, 100 do attrs["a" .. i] = "v" end
    local refused = p and {
        select(2, p:send("x", { loom_id = "mine" })),
        select(2, p:send("x", attrs)),
    }
    -- the records' CRC32C: the loom module's equals the Lua one
    local crc32c = require "resty.loom.crc32c"
    local ffi = require "ffi"
    local same = true
    for len = 0, 2000, 7 do
        local b = ffi.new("uint8_t[?]", len + 1)
        for i = 0, len - 1 do b[i] = math.random(0, 255) end
        same = same and crc32c.crc32c(b, len) == crc32c.lua(b, len)
    end
    ngx.say(cjson.encode({ results = out, made = made, refused = refused,
                           good = p and p:stats() or err,
                           crc = { native = crc32c.native, same = same } }))
} }
"""


def test_bad_spool_options_are_refused_before_anything_is_made(
        nginx, spool_dir):
    n = nginx(workers=1, server=OPTIONS_LUA)
    r = n.get("/bad?dir=" + urllib.parse.quote(spool_dir + "/bad"))
    assert r.status == 200, r
    out = r.json()
    res = {name: (ok, err) for name, ok, err in out["results"]}
    assert [name for name, (ok, _) in res.items() if ok] == []

    def says(case, text):
        assert text in res[case][1], (case, res[case][1])
    says("spool_dir", "opts.spool_dir is not an option")
    for case in ("spool number", "spool relative", "spool empty",
                 "spool table"):
        says(case, "opts.spool must be an absolute path (a directory)")
    says("mode", 'opts.spool_mode must be "exit" or "always"')
    says("mode bool", 'opts.spool_mode must be "exit" or "always"')
    says("mode alone", "opts.spool is required with opts.spool_mode or "
                       "opts.spool_max_bytes")
    says("max alone", "opts.spool is required with opts.spool_mode")
    for case in [c for c in res if c.startswith("max")
                 and c not in ("max alone",)]:
        says(case, "opts.spool_max_bytes must be a whole number from 65536 "
                   "to 1000000000000")
    # nothing was made for the refused ones; the good one makes its
    # directory
    assert out["made"] is False
    good = out["good"]
    assert isinstance(good, dict) and good["spooled"] == 0, good
    assert os.path.isdir(spool_dir + "/bad")
    assert out["crc"] == {"native": True, "same": True}
    # the id attribute is the spool's, and takes one of the 100
    assert out["refused"] == ["attribute key loom_id is reserved for the "
                              "spool's id", "too many attributes"]
