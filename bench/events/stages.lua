-- Per-event cost of each stage of the bus's worker side, in plain LuaJIT
-- (no nginx, no sockets): the poster's encode / queue / own copy and the
-- receiver's frame parse / sequence bookkeeping / decode / inbox / dispatch,
-- on the Kong scenario's payload. Run from the checkout's root:
--
--     luajit bench/events/stages.lua [events per round]
--
-- Prints "stage | µs per event" (best of 5 rounds). The socket read, the
-- broker and the event loop are not here: see docs/benchmarks.md#events.

package.path = "lib/?.lua;" .. package.path

-- just enough of ngx for the worker-side modules
ngx = { -- luacheck: ignore 121
    ERR = 4, WARN = 5, log = function() end, now = os.clock,
    worker = { id = function() return 1 end, pid = function() return 1 end },
    get_phase = function() return "timer" end,
}
package.preload["ngx.semaphore"] = function()
    return { new = function() return { post = function() end,
                                       wait = function() end,
                                       count = function() return 0 end } end }
end
package.preload["resty.loom.yield"] = function()
    return { yield = function() end }
end
package.preload["resty.loom.events.collect"] = function()
    return { INTERNAL = "loom.bus", handle_internal = function() end,
             receive_urgent = function() return true end }
end

local buffer = require "string.buffer"
local frame = require "resty.loom.events.frame"
local ring = require "resty.loom.events.ring"
local fifo = require "resty.loom.events.fifo"
local dispatch = require "resty.loom.events.dispatch"
local receive = require "resty.loom.events.receive"
local histogram = require "resty.loom.histogram"

local N = tonumber(arg and arg[1]) or 10000
local ROUNDS = 5
local mono = dispatch.mono

local payload = {
    seq = 0, kind = "health", upstream = "upstream-0001",
    host = "10.0.0.1", port = 8080, status = "healthy",
    checked = "2026-11-22T06:00:00Z",
}

local function bus()
    local recv = 0
    local self = {
        opts = { max_payload = 1024 * 1024, max_backlog = 10 * N },
        worker = 1, pid = 1,
        inbox = ring.new(), own = ring.new(), held = ring.new(),
        raw = buffer.new(),
        handler_idle = false, rwaiters = 0,
        dispatch = { waiting = false },
        last_seq = {}, last_all = {}, last_others = {}, last_direct = {},
        counters = { delivered = 0, handler_calls = 0, handler_errors = 0,
                     gaps = 0, duplicates = 0 },
        latency = histogram.new(), last_warn = {}, gap_hooks = {},
        sub_list = { { source = "bench", event = "ev",
                       fn = function() recv = recv + 1 end, site = "" } },
    }
    return self
end

-- fn(), after setup() when given, timed; the best round's µs per event
local function best(fn, setup)
    local b
    for _ = 1, ROUNDS do
        if setup then
            setup()
        end
        collectgarbage()
        local t0 = mono()
        fn()
        local us = (mono() - t0) * 1e6 / N
        if not b or us < b then
            b = us
        end
    end
    return b
end

-- frames as the broker forwards them (what worker 1 reads)
local wire = buffer.new()
for i = 1, N do
    payload.seq = i
    frame.encode_body("bench", "ev", payload)
    frame.put_event(wire, i, frame.ALL, 0, 1, 7, i, i % 8 == 0 and 1 or 0)
end
local wire_str = wire:get()

local rows = {}
local function row(name, us)
    rows[#rows + 1] = { name, us }
end

-- poster
row("encode (encode_body: source, event, data)", best(function()
    for i = 1, N do
        payload.seq = i
        frame.encode_body("bench", "ev", payload)
    end
end))
local unsent = buffer.new(65536)
row("encode + frame into the queue (put_event)", best(function()
    unsent:reset()
    for i = 1, N do
        payload.seq = i
        frame.encode_body("bench", "ev", payload)
        frame.put_event(unsent, i, frame.ALL, 0, 1, 7, i, 0)
    end
end))
row("own copy (copy_data)", best(function()
    for i = 1, N do
        payload.seq = i
        frame.copy_data(payload)
    end
end))
local q, own = fifo.new(), ring.new()
row("bookkeeping (unsent_q + own ring push/pop)", best(function()
    for i = 1, N do
        q:push(i, 100)
        own:push(i, "bench", "ev", payload, 0, false)
    end
    for _ = 1, N do
        q:pop()
        own:pop()
    end
end))

-- receiver
local rbuf = buffer.new()
row("read copy (rbuf:put of what a read returns)", best(function()
    rbuf:reset()
    rbuf:put(wire_str)
end))
local self = bus()
-- (the inbox and raw are emptied between rounds, outside the timing)
local function drain()
    while self.inbox:pop() ~= nil do end -- luacheck: ignore
    self.raw:reset()
    self.last_seq, self.last_all = {}, {}
    rbuf:reset()
    rbuf:put(wire_str)
end
row("parse + seq + inbox push (consume)", best(function()
    receive.consume(self, rbuf, { got = 0 })
end, drain))
row("  of which decode (decode_body)", best(function()
    local p, n = frame.ptr(wire_str)
    local off = 0
    while off < n do
        local h, pp, size = frame.at(p + off)
        frame.decode_body(pp + frame.EVENT_SIZE, h.len - frame.EVENT_SIZE)
        off = off + size
    end
end))
local me = {}
row("inbox pop + decode + dispatch to 1 handler (dispatch_next)",
    best(function()
        while dispatch.dispatch_next(self, me) do end -- luacheck: ignore
    end, function()
        drain()
        receive.consume(self, rbuf, { got = 0 })
    end))

for _, r in ipairs(rows) do
    print(string.format("| %s | %.3f |", r[1], r[2]))
end
