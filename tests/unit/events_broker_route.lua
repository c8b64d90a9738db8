-- Unit tests of the broker's fan-out of a run of events (pure LuaJIT, no
-- nginx): route.run_length / route.forward_run against the per-event
-- route.forward they stand in for.

-- the parts of ngx the broker's modules touch at load and in these paths;
-- a semaphore wait would mean a yield, which forward_run must never do
_G.ngx = { now = function() return 0 end,
           crc32_short = function(s) return #s end,
           log = function() end, WARN = 5, ERR = 4, INFO = 7 }
package.loaded["ngx.semaphore"] = {
    new = function()
        return { post = function() end, count = function() return 0 end,
                 wait = function() error("a wait (would yield)") end }
    end,
}
package.loaded["resty.loom.at_close"] = { renew = function() end,
                                          register = function() end }

local buffer = require "string.buffer"
local frame = require "resty.loom.events.frame"
local bqueue = require "resty.loom.events.broker_queue"
local route = require "resty.loom.events.broker_route"
local unit = require "unit"
local case = unit.case
local eq = unit.eq


local function broker(workers, backlog)
    local bus = { worker_count = workers,
                  opts = { max_backlog = backlog, max_queue_bytes = 1e9,
                           privileged_agent = false, slow_timeout = 1,
                           unique_window = 1, max_payload = 1e6 } }
    return bus, bqueue.state(bus)
end

-- n events from worker `from` to `target`, as its client frames them
local function events(n, target, from)
    local buf = buffer.new()
    for i = 1, n do
        frame.encode_body("src", "ev", i)
        frame.put_event(buf, i, target, from, 1, 1, i, 0, nil)
    end
    return buf
end

local function per_event(bus, b, c, buf)
    local p, n = buf:ref()
    local off = 0
    while off < n do
        local h, pp, size = frame.peek_at(p + off, n - off, frame.CHUNK)
        assert(route.forward(bus, b, c, frame.seq(h), pp, h.len))
        off = off + size
    end
end

local function acks()
    local got = {}
    return { got = got,
             push = function(_, bidx, seq)
                 got[#got + 1] = bidx .. ":" .. seq
             end }
end


case("a run goes to each queue as the per-event path would put it", function()
    local buf = events(50, frame.ALL, 1)
    local bus, b = broker(3, 1000)
    local c = { wid = 1, ackq = acks() }
    local p, n = buf:ref()
    local k, bytes = route.run_length(p, n)
    eq(k, 50, "run length")
    eq(bytes, n, "run bytes")
    eq(route.forward_run(bus, b, c, p, k, bytes), true, "forwarded")

    local bus2, b2 = broker(3, 1000)
    local c2 = { wid = 1, ackq = acks() }
    per_event(bus2, b2, c2, buf)
    for _, wid in ipairs({ 0, 2 }) do
        local q, q2 = b.queues[wid], b2.queues[wid]
        eq(q.buf:tostring(), q2.buf:tostring(), "queue " .. wid .. " bytes")
        eq(q.n, q2.n, "queue " .. wid .. " events")
        eq(q.by[1], q2.by[1], "queue " .. wid .. " by publisher")
        eq(q.first_bidx, q2.first_bidx, "queue " .. wid .. " first index")
    end
    eq(b.queues[1], nil, "no queue for the publisher itself")
    eq(b.stats.forwarded, b2.stats.forwarded, "forwarded")
    eq(b.next_bidx, b2.next_bidx, "next index")
    eq(table.concat(c.ackq.got, ","), table.concat(c2.ackq.got, ","),
       "acknowledgements")
end)

case("a run a queue has no room for is refused whole, even a new queue",
     function()
    -- worker 0's queue does not exist yet (it never connected); the
    -- per-event path queues max_backlog events and drops the rest
    local buf = events(100, frame.ALL, 1)
    local bus, b = broker(2, 10)
    local c = { wid = 1 }
    local p, n = buf:ref()
    local k, bytes = route.run_length(p, n)
    eq(route.forward_run(bus, b, c, p, k, bytes), false, "refused")
    eq(b.queues[0].n, 0, "nothing queued")
    eq(b.stats.forwarded, 0, "nothing counted")

    per_event(bus, b, c, buf)
    eq(b.queues[0].n, 10, "per event: max_backlog queued")
    eq(b.stats.dropped["worker down, queue full"], 90, "per event: dropped")
end)

case("a run ends at an event to one worker", function()
    local buf = events(3, frame.ALL, 1)
    buf:put(events(1, 0, 1):tostring())
    buf:put(events(2, frame.OTHERS, 1):tostring())
    local p, n = buf:ref()
    local k = route.run_length(p, n)
    eq(k, 3, "stops before the event to worker 0")
    local at, off = {}, 0
    while off < n do
        at[#at + 1] = off
        local _, _, size = frame.peek_at(p + off, n - off, frame.CHUNK)
        off = off + size
    end
    eq(route.run_length(p + at[2], n - at[2]), 2, "from the second event")
    eq(route.run_length(p + at[4], n - at[4]), 0, "none starts at worker 0's")
    eq(route.run_length(p + at[5], n - at[5]), 2, "then two to others")
end)

case("a run ends at a frame that is not whole or not valid", function()
    local buf = events(2, frame.ALL, 1)
    local p, n = buf:ref()
    -- a copy with its second frame's version broken
    local bad = buffer.new()
    bad:putcdata(p, n)
    local bp = bad:ref()
    local _, _, size = frame.peek_at(bp, n, frame.CHUNK)
    local h2 = frame.at(bp + size)
    h2.version = h2.version + 1
    eq(select(2, frame.peek_at(bp + size, n - size, frame.CHUNK)),
       "bad version", "the second frame")
    eq(route.run_length(bp, n), 1, "stops before the bad frame")
    -- only part of the second frame has arrived
    eq(route.run_length(p, n - 1), 1, "stops before the cut frame")
end)
