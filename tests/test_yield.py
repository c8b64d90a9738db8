"""resty.loom.yield: a long loop in a timer that yields lets requests in.

ngx.sleep(0) does not, on a stock nginx (the control case shows it): in a
coroutine resumed by a timer it is a 0 ms timer that runs again in the same
pass, so the loop holds the worker until it ends."""

import threading
import time

HTTP = """
lua_shared_dict yt 1m;
init_worker_by_lua_block {
    local yield = require("resty.loom.yield").yield
    local shm = ngx.shared.yt
    local function spin(ms)
        local t = os.clock()
        while os.clock() - t < ms / 1000 do end
    end
    -- %(threads)d light threads, each spinning 2 ms %(rounds)d times with a
    -- pause between rounds; "running" is set while any of them runs
    ngx.timer.at(0.5, function()
        shm:set("running", 1)
        local done = 0
        local threads = {}
        for i = 1, %(threads)d do
            threads[i] = ngx.thread.spawn(function()
                for _ = 1, %(rounds)d do
                    spin(2)
                    %(pause)s
                end
                done = done + 1
            end)
        end
        for i = 1, #threads do
            ngx.thread.wait(threads[i])
        end
        shm:set("running", 0)
        shm:set("done", done)
    end)
}
"""

SERVER = """
location = /t {
    content_by_lua_block {
        local shm = ngx.shared.yt
        ngx.say(shm:get("running") or 0, " ", shm:get("done") or 0)
    }
}
"""


def answers_during_loop(nginx, pause, threads=1, rounds=400):
    """Polls /t from another thread while the loop runs; returns the
    number of answers that saw the loop still running, and how many
    threads finished."""
    n = nginx(workers=1, http=HTTP % {"pause": pause, "threads": threads,
                                      "rounds": rounds},
              server=SERVER)
    seen = []
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            seen.append(n.get("/t").text.split())
            time.sleep(0.01)

    t = threading.Thread(target=poll)
    t.start()
    deadline = time.time() + 30
    while time.time() < deadline:
        if seen and seen[-1][1] != "0":
            break
        time.sleep(0.05)
    stop.set()
    t.join()
    assert seen and seen[-1][1] == str(threads), seen[-5:]
    return sum(1 for running, _ in seen if running == "1")


def test_yield_lets_requests_in(nginx):
    # 0.8 s of spinning: polled every ~10 ms, dozens of answers in between
    assert answers_during_loop(
        nginx, 'require("resty.loom.yield").yield()') >= 10


def test_many_threads_yield_in_turn(nginx):
    # 8 threads share the worker's semaphore; every one of them finishes
    # and requests still get in between their turns
    assert answers_during_loop(
        nginx, 'require("resty.loom.yield").yield()', threads=8,
        rounds=50) >= 10


def test_sleep_zero_does_not(nginx):
    # the control: the same loop with ngx.sleep(0) answers nothing while it
    # runs (what yield() exists for)
    assert answers_during_loop(nginx, "ngx.sleep(0)") == 0
