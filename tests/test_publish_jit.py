"""send() stays on compiled traces: no trace aborts in resty.loom.publish
while messages are queued."""

import os


def test_send_compiles_without_aborts(nginx):
    n = nginx(workers=1, server="""
    location = /jit { content_by_lua_block {
        local p = require("resty.loom.publish").new({
            project = "loom-proj", topic = "topic-1",
            emulator_host = "127.0.0.1:9",      -- never reached
            batch_max_delay = 3600, buffer_max_messages = 1000000,
            buffer_max_bytes = 1e9 })
        local data = string.rep("0123456789abcdef", 64)
        local attrs = { host = "edge-1", path = "/x", seq = "1" }
        require("jit.v").on(ngx.var.arg_log)
        for i = 1, 30000 do
            local ok, err = p:send(data, attrs, (i % 3 == 0) and "k" or nil)
            if not ok then error(err) end
        end
        require("jit.v").off()
        ngx.say(p:stats().queued_messages)
    } }""")
    log = os.path.join(n.prefix, "logs", "jit.log")
    r = n.get("/jit?log=" + log)
    assert r.status == 200 and r.text.strip() == "30000"
    with open(log) as f:
        lines = f.read().splitlines()
    traces = [l for l in lines if "publish.lua" in l]
    assert traces, lines
    aborts = [l for l in traces if l.startswith("[TRACE ---")]
    assert aborts == [], aborts
