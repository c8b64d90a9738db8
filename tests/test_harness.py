"""The harness itself: start, requests, logs, kill, reload, quit."""

import signal


def test_serves_and_reports_worker_pids(nginx):
    n = nginx(workers=2, server="""
        location /pid { content_by_lua_block { ngx.say(ngx.worker.pid()) } }
    """)
    pids = n.worker_pids()
    assert len(pids) == 2
    seen = {int(n.get("/pid").text) for _ in range(40)}
    assert seen <= set(pids) and seen


def test_kill_reload_quit(nginx):
    n = nginx(workers=2, server="""
        location /t { content_by_lua_block { ngx.say("ok") } }
    """)
    victim = n.worker_pids()[0]
    n.kill(victim, signal.SIGKILL)
    pids = n.wait_workers(2, exclude=[victim])
    assert victim not in pids
    n.allow_log(r"exited on signal 9")
    new = n.reload()
    assert not set(new) & set(pids)
    assert n.get("/t").text == "ok\n"
    n.quit()
    assert n.master_pid is None


def test_error_lines_are_caught(nginx):
    n = nginx(workers=1, server="""
        location /e { content_by_lua_block {
            ngx.log(ngx.ERR, "boom for the harness")
            ngx.say("x")
        } }
    """)
    n.get("/e")
    n.wait_log("boom for the harness")
    assert any("boom for the harness" in line for line in n.bad_log_lines())
    n.allow_log("boom for the harness")
    assert n.bad_log_lines() == []
