"""The publish and receive paths compile: no NYI bytecodes or builtins in
the traces of the bus's own files."""

import re

import eventsconf as ec

JIT = ec.SERVER + """
location /jit { content_by_lua_block {
    local v = require "jit.v"
    v.on(ngx.config.prefix() .. "logs/jit.log")
    local bus = require("resty.loom.events").get()
    local t = { n = 0, name = "x" }
    for i = 1, 100000 do
        t.n = i
        assert(bus:publish("all", "bench", "ev", t))
        if i % 20000 == 0 then ngx.sleep(0.05) end
    end
    ngx.sleep(0.5)
    v.off()
    ngx.say("ok")
} }
"""

# (jit.v names a file by its base name: the bus's are events.lua and those
# in events/)
OURS = re.compile(r"\b(events|frame|fifo|broker(_\w+)?|histogram|dispatch|"
                  r"own|receive|client|lane|collect|exit|handshake|log)\.lua")
BAD = re.compile(r"NYI: (bytecode|FastFunc|unsupported|C function)")


def test_no_nyi_in_bus_traces(nginx):
    n = nginx(workers=1, http=ec.http("overflow = 'wait'"), server=JIT)
    ec.wait_ready(n)
    assert n.get("/jit", timeout=60).text.strip() == "ok"
    log = open(n.prefix + "/logs/jit.log").read()
    compiled = [x for x in log.splitlines()
                if re.match(r"\[TRACE\s+\d+ ", x) and OURS.search(x)]
    assert len(compiled) >= 5, log[-3000:]
    bad = [x for x in log.splitlines() if BAD.search(x) and OURS.search(x)]
    assert bad == [], "\n".join(bad[:20])
