-- The broker's state, in the broker worker only: per-worker queues (keyed
-- by worker id, so they outlive connections) and its counters; drop()
-- counts and warns about the events a queue could not take.


local buffer = require "string.buffer"
local frame = require "resty.loom.events.frame"
local ring = require "resty.loom.events.ring"
local semaphore = require "ngx.semaphore"
local at_close = require "resty.loom.at_close"

local ngx = ngx
local ngx_log = ngx.log
local ngx_now = ngx.now
local buf_new = buffer.new
local pcall = pcall
local tostring = tostring

local WARN = ngx.WARN

local EVENT_SIZE = frame.EVENT_SIZE
local LOG_INTERVAL = 10            -- seconds between repeated warnings


local _M = { _VERSION = "0.2.0" }


local function log(level, ...)
    ngx_log(level, "[loom.events] ", ...)
end


-- Broker state lives in the broker worker only, created on first use.
local function state(bus)
    local b = bus.broker_state
    if b then
        return b
    end
    b = {
        queues = {},         -- worker id -> queue
        -- the publishers' rings (see shm.lua), and per publisher worker
        -- id the (last bidx, end) of each run forwarded
        shm = bus.rings,
        rings = {},
        remote = 0,          -- connections over the socket
        next_bidx = 1,       -- broker-wide index of forwarded events
        unique = {},         -- key -> expiry
        unique_count = 0,
        stats = {
            connections = 0,
            accepted = 0,
            rejected = {},   -- reason -> count
            forwarded = 0,
            unique_suppressed = 0,
            dropped = {},    -- reason -> count
            slow_waits = 0,
            urgent_missed = 0,   -- urgent events for a worker not connected
            over_bound = 0,      -- events queued within a publisher's share
                                 -- of a full queue
        },
        last_warn = {},      -- reason -> time of its last warning
        slow_timeout = bus.opts.slow_timeout,
    }
    bus.broker_state = b
    if b.shm and b.shm:held_any() then
        -- A broker before us (killed) may have sent a worker SHM frames it
        -- has not read yet (its inbox full): the runs it had not freed
        -- stay in the rings until every worker has connected to us, which
        -- it does only once it has read its old connection to the end
        -- (broker_acks.connected). (The first broker finds nothing held.)
        local waiting = {}
        for wid = 0, ngx.worker.count() - 1 do
            waiting[wid] = true
        end
        if bus.opts.privileged_agent then
            waiting[frame.AGENT] = true
        end
        b.rings_waiting = waiting
        b.old_heads = b.shm:heads()
    end
    return b
end


local function queue(b, wid)
    local q = b.queues[wid]
    if not q then
        q = {
            wid = wid,
            buf = buf_new(65536),
            n = 0,              -- events queued
            first_bidx = nil,   -- oldest event not yet taken by the writer
            inflight_bidx = nil,-- oldest event in the send under way
            conn = nil,         -- the connection currently attached
            overflowing = false,-- dropping until the writer catches up
            gone = false,       -- its worker said goodbye: exiting
            -- publisher worker id -> its events queued (not yet taken by
            -- the writer), and how many publishers have some: fair shares
            by = {},
            publishers = 0,
            dropped = 0,        -- events dropped for it
            writer = nil,       -- the connection whose writer owns buf
            -- buf starts with what was written to the worker and not yet
            -- acknowledged by it: sent_bytes, sent_events; a record per
            -- write (events written by then, bytes, oldest index, time)
            sent_bytes = 0,
            sent_events = 0,
            sent = ring.new(),
            data_sema = semaphore.new(),
            space_sema = semaphore.new(),
            writer_sema = semaphore.new(),
        }
        b.queues[wid] = q
        -- (what the queue holds is counted when the worker stops, also
        -- at VM close: see at_close.renew)
        at_close.renew()
    end
    return q
end


-- wakes q's writer when it waits for work (a post per event would pile
-- up counts the writer then spins through)
local function wake_writer(q)
    if q.writer_idle then
        q.writer_idle = false
        q.data_sema:post(1)
    end
end


local function count(t, key, n)
    t[key] = (t[key] or 0) + (n or 1)
end


-- counts n events dropped for q's worker; a warning per reason at most
-- once per interval, naming the publisher and the event when given
local function drop(b, q, reason, n, from, p, len)
    local dropped = b.stats.dropped
    count(dropped, reason, n)
    q.dropped = q.dropped + n
    local now = ngx_now()
    if now - (b.last_warn[reason] or 0) >= LOG_INTERVAL then
        b.last_warn[reason] = now
        local what = ""
        if p then
            local e = frame.check_event(p, len)
            local off = EVENT_SIZE + e.key_len
            local ok, source, event = pcall(frame.decode_body, p + off,
                                            e.body_len)
            what = " from worker " .. tostring(from)
                   .. (ok and (", source=" .. source .. " event=" .. event)
                       or "")
        end
        log(WARN, "dropping events for worker ", q.wid, ": ", reason, what,
            " (", dropped[reason], " so far)")
    end
end


-- Events in q not written yet: those queued, and what the send under way
-- has not written of its batch. What is bounded: what was written and
-- not yet acknowledged is not, or a worker whose acknowledgements wait
-- behind its own events, which the broker is not reading while it waits
-- for room, would hold up the queue that would make room.
local function unwritten(q)
    local n = q.n
    local w = q.writer
    if w and w.batch_events then
        n = n + w.batch_events - w.written
    end
    return n
end


_M.state = state
_M.queue = queue
_M.wake_writer = wake_writer
_M.count = count
_M.drop = drop
_M.unwritten = unwritten


return _M
