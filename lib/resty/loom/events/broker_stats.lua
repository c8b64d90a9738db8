-- What the broker reports: stats() of its queues and counters, peers()
-- connected over the socket, and count_left() of the events it holds when
-- its worker stops.


local frame = require "resty.loom.events.frame"
local bqueue = require "resty.loom.events.broker_queue"
local acks = require "resty.loom.events.broker_acks"

local ngx_now = ngx.now
local tostring = tostring

local count = bqueue.count
local unwritten = bqueue.unwritten
local too_slow = acks.too_slow


local _M = { _VERSION = "0.2.0" }


-- The worker stops (a fast stop, or the end of a graceful one): counts
-- as dropped ("exit") and returns the events the broker holds that no
-- publisher reports: its own worker's (handed over, never acknowledged)
-- and, for a worker not connected, everyone's (acknowledged already).
-- What others published for a connected worker they count themselves.
function _M.count_left(bus)
    local b = bus.broker_state
    if not b then
        return 0
    end
    local held = 0
    for _, q in pairs(b.queues) do
        local p, n = q.buf:ref()
        held = held + frame.count_events(p, n, q.conn and bus.worker or nil)
    end
    if held > 0 then
        count(b.stats.dropped, "exit", held)
    end
    return held
end


-- Workers connected over the socket (the broker worker's own link is not).
function _M.peers(bus)
    local b = bus.broker_state
    return b and b.remote or 0
end


function _M.stats(bus)
    local b = bus.broker_state
    if not b then
        return nil
    end
    local queues = {}
    local slow = {}
    local now = ngx_now()
    for wid, q in pairs(b.queues) do
        local is_slow = q.conn ~= nil
                        and too_slow(q, now, b.slow_timeout) and true
                        or false
        queues[tostring(wid)] = {
            events = unwritten(q) + q.sent_events,
            bytes = #q.buf,
            connected = q.conn ~= nil,
            slow = is_slow,
            dropped = q.dropped,
        }
        if is_slow then
            slow[#slow + 1] = wid
        end
    end
    table.sort(slow)
    local s = b.stats
    return {
        connections = s.connections,
        accepted = s.accepted,
        rejected = s.rejected,
        forwarded = s.forwarded,
        unique_suppressed = s.unique_suppressed,
        dropped = s.dropped,
        slow_waits = s.slow_waits,
        urgent_missed = s.urgent_missed,
        over_bound = s.over_bound,
        slow = slow,
        queues = queues,
    }
end


return _M
