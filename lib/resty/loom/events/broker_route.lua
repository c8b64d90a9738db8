-- Fan-out: an event a worker publishes goes to the queue of each of its
-- targets (all, others, a unique key's worker, one worker) within the
-- queue's bounds; an urgent event skips the queues.


local ffi = require "ffi"
local frame = require "resty.loom.events.frame"
local bqueue = require "resty.loom.events.broker_queue"
local fifo = require "resty.loom.events.fifo"
local run_end = require("resty.loom.events.shm").run_end

local ffi_string = ffi.string
local peek_at = frame.peek_at
local whole = frame.whole
local check_event = frame.check_event
local frame_at = frame.at
local frame_seq = frame.seq
local ngx_now = ngx.now
local crc32 = ngx.crc32_short

local T_EVENT = frame.EVENT
local T_URGENT = frame.URGENT
local T_OWN_RUN = frame.OWN_RUN
local T_OWN_SKIP = frame.OWN_SKIP
local EVENT_SIZE = frame.EVENT_SIZE
local ALL = frame.ALL
local OTHERS = frame.OTHERS
local UNIQUE = frame.UNIQUE
local AGENT = frame.AGENT
local CHUNK = frame.CHUNK
local RUN_MAX = 256                -- events forwarded as one run at most

local queue = bqueue.queue
local wake_writer = bqueue.wake_writer
local count = bqueue.count
local drop = bqueue.drop
local unwritten = bqueue.unwritten


local _M = { _VERSION = "0.2.0" }


-- the worker for a unique key: the same for the same key whoever is
-- connected, so an event re-sent after a broker restart lands where it
-- went before (queues outlive connections); its publisher knows too
local function unique_target(key, nworkers)
    return crc32(key) % nworkers
end
_M.unique_target = unique_target


local function seen_unique(b, key, window)
    local now = ngx_now()
    local exp = b.unique[key]
    if exp and exp > now then
        return true
    end
    if not exp then
        b.unique_count = b.unique_count + 1
    end
    b.unique[key] = now + window
    if b.unique_count > 10000 then
        -- sweep expired keys now and then so the table stays bounded
        local n = 0
        for k, e in pairs(b.unique) do
            if e <= now then
                b.unique[k] = nil
            else
                n = n + 1
            end
        end
        b.unique_count = n
    end
    return false
end


local function fits(q, k, len, max_n, max_bytes)
    local left = unwritten(q)
    return (left == 0 or left + k <= max_n)
           and #q.buf - q.sent_bytes + len <= max_bytes
end


-- Whether q takes k more events (len bytes) from worker `from`, waiting
-- (up to slow_timeout) for room when q is full and its worker is
-- connected. When it does not, the k events are dropped: counted, logged
-- at most once per interval (with the event at p, len when given).
local function room(bus, b, q, from, k, len, p, plen)
    if q.gone then
        -- (nobody will read it: its worker is exiting, and no successor
        -- comes in this generation)
        drop(b, q, "worker gone", k, from, p, plen)
        return false
    end
    local opts = bus.opts
    local max_n, max_bytes = opts.max_backlog, opts.max_queue_bytes
    -- (a run larger than the bound goes into an empty queue)
    local left = unwritten(q)
    local full = left > 0 and left + k > max_n
    local mine = q.by[from] or 0
    local others = q.publishers - (mine > 0 and 1 or 0)
    if full and others > 0 and (mine + k) * (others + 1) <= max_n then
        -- Fair shares: a publisher within its share of what is queued
        -- (max_backlog over the publishers with events in it) does not
        -- wait behind others that flood the queue; only those beyond
        -- their share wait for room, so the queue holds at most about
        -- twice max_backlog events (its bytes stay bounded)
        full = false
        b.stats.over_bound = b.stats.over_bound + 1
    end
    full = full or #q.buf - q.sent_bytes + len > max_bytes
    if full and q.conn and not q.overflowing then
        b.stats.slow_waits = b.stats.slow_waits + 1
        local deadline = ngx_now() + opts.slow_timeout
        while q.conn and not fits(q, k, len, max_n, max_bytes)
              and ngx_now() < deadline do
            q.space_sema:wait(0.1)
        end
    end
    if full and not fits(q, k, len, max_n, max_bytes) then
        -- no more waiting for this worker until its writer catches up
        q.overflowing = true
        drop(b, q, q.conn and "subscriber too slow"
                   or "worker down, queue full", k, from, p, plen)
        return false
    end
    return true
end


-- k events from worker `from` are in q (bidx the first)
local function queued(q, from, k, bidx)
    q.n = q.n + k
    local mine = q.by[from] or 0
    if mine == 0 then
        q.publishers = q.publishers + 1
    end
    q.by[from] = mine + k
    -- the oldest unwritten event: another publisher's earlier event may be
    -- enqueued after a later one when an enqueue waited
    if not q.first_bidx or bidx < q.first_bidx then
        q.first_bidx = bidx
    end
    wake_writer(q)
end


-- Appends one event (payload p, len) to q when it has room (see room()).
-- Returns false when it had to drop it.
local function enqueue(bus, b, q, from, seq, bidx, p, len)
    if not room(bus, b, q, from, 1, len, p, len) then
        return false
    end
    frame.put_chunked(q.buf, T_EVENT, seq, p, len)
    queued(q, from, 1, bidx)
    return true
end


-- An urgent event (collect) goes at once to each target's connection,
-- ahead of what is queued for it; to a worker not connected it is lost,
-- counted (its sender waits for its answer with a timeout).
local function forward_urgent(bus, b, c, p, len)
    local e, why = frame.check_event(p, len)
    if not e then
        return nil, why
    end
    local target = e.target
    local first, last = target, target
    if target == ALL or target == OTHERS then
        first = bus.opts.privileged_agent and AGENT or 0
        last = bus.worker_count - 1
    elseif not ((target >= 0 and target < bus.worker_count)
                or (target == AGENT and bus.opts.privileged_agent)) then
        count(b.stats.dropped, "bad target")
        return true
    end
    for wid = first, last do
        local q = b.queues[wid]
        local to = q and q.conn
        local lane = q and q.lane
        if wid == c.wid then -- luacheck: ignore 542
            -- (the sender answers itself)
        elseif not to then
            b.stats.urgent_missed = b.stats.urgent_missed + 1
        elseif to.urgent then
            -- the broker worker's own link
            to.urgent(p, len)
        elseif lane and not lane.closed then
            frame.put_chunked(lane.ctl, T_URGENT, 0, p, len)
            lane.sema:post(1)
        else
            -- (a worker whose lane is not up yet: ahead of its queue, but
            -- behind the send under way)
            frame.put_chunked(to.ctl, T_URGENT, 0, p, len)
            wake_writer(q)
        end
    end
    return true
end


-- The run of frames at p (n bytes there) that forward_run() can take: at
-- most RUN_MAX, each a valid frame with a whole event to "all" or
-- "others". Returns their number and bytes (0, 0: the first is not one).
local function run_length(p, n)
    local k, off = 0, 0
    while k < RUN_MAX do
        local h, pp, size = peek_at(p + off, n - off, CHUNK)
        if not h or h.type ~= T_EVENT or not whole(h, pp) then
            break
        end
        local e = check_event(pp, h.len)
        local target = e and e.target
        if target ~= ALL and target ~= OTHERS then
            break
        end
        k, off = k + 1, off + size
    end
    return k, off
end


-- Forwards the run of k events (bytes at p, see run_length) from c's
-- worker when every target's queue has room for all of it: each queue
-- takes the frames as they came, in one copy (they are the frames the
-- broker would make). Returns false, having done nothing, when one has
-- not: the caller forwards them one at a time (they may wait, or drop),
-- and only then takes them off its buffer, so that an event is always in
-- the buffer or in its queues, never in neither (what a fast stop counts).
local function forward_run(bus, b, c, p, k, bytes)
    local opts = bus.opts
    local max_n, max_bytes = opts.max_backlog, opts.max_queue_bytes
    local from = c.wid
    local first, last = opts.privileged_agent and AGENT or 0,
                        bus.worker_count - 1
    for wid = first, last do
        -- (a queue made here is empty: the run must fit it too)
        local q = wid ~= from and queue(b, wid)
        if q and (q.gone or unwritten(q) + k > max_n
                  or #q.buf - q.sent_bytes + bytes > max_bytes) then
            return false
        end
    end
    local bidx = b.next_bidx
    b.next_bidx = bidx + k
    b.stats.forwarded = b.stats.forwarded + k
    for wid = first, last do
        if wid ~= from then
            local q = queue(b, wid)
            q.buf:putcdata(p, bytes)
            queued(q, from, k, bidx)
        end
    end
    local ackq = c.ackq
    if ackq then
        local off = 0
        for i = 0, k - 1 do
            local h, _, size = frame_at(p + off)
            ackq:push(bidx + i, frame_seq(h))
            off = off + size
        end
    end
    return true
end


local function forward(bus, b, c, seq, p, len)
    local e, why = frame.check_event(p, len)
    if not e then
        return nil, why
    end
    local target = e.target
    local nworkers = bus.worker_count
    local bidx = b.next_bidx
    b.next_bidx = bidx + 1
    b.stats.forwarded = b.stats.forwarded + 1

    if target == ALL or target == OTHERS then
        -- (a publisher hands its own copy of "all" to its handlers)
        local skip = c.wid
        for wid = bus.opts.privileged_agent and AGENT or 0, nworkers - 1 do
            if wid ~= skip then
                enqueue(bus, b, queue(b, wid), c.wid, seq, bidx, p, len)
            end
        end

    elseif target == UNIQUE then
        local key = ffi_string(p + EVENT_SIZE, e.key_len)
        local wid = unique_target(key, nworkers)
        local run = not seen_unique(b, key, bus.opts.unique_window)
        if not run then
            b.stats.unique_suppressed = b.stats.unique_suppressed + 1
        end
        if wid == c.wid then
            -- its publisher holds a copy for its handlers, to run in
            -- publish order with its other own events: it only needs to
            -- know whether to (ahead of the ack, which ends its wait)
            if c.own then
                c.own(seq, run)
            else
                frame.put_empty(c.ctl, run and T_OWN_RUN or T_OWN_SKIP, seq)
                wake_writer(c.q)
            end
        elseif run and not enqueue(bus, b, queue(b, wid), c.wid, seq, bidx,
                                   p, len) then
            -- not delivered: a later publish of the key may be
            b.unique[key] = nil
        end

    elseif (target >= 0 and target < nworkers)
           or (target == AGENT and bus.opts.privileged_agent) then
        enqueue(bus, b, queue(b, target), c.wid, seq, bidx, p, len)

    else
        count(b.stats.dropped, "bad target")
    end

    -- only now: the enqueues above may have waited, and the ack must not
    -- overtake an event that is in no queue yet (our own worker needs no
    -- acks: its events die with the broker)
    local ackq = c.ackq
    if ackq then
        ackq:push(bidx, seq)
    end
    return true
end


-- An SHM frame (at p, size bytes; s its payload) from c's worker: the
-- run of s.events events to "all" or "others" in its ring goes to every
-- other worker's queue as that one frame, counted as the events it
-- stands for. The ring keeps the run until no queue holds the frame
-- (see broker_acks: release_rings).
local function forward_shm(bus, b, c, seq, p, size, s)
    local k = s.events
    local from = c.wid
    local bidx = b.next_bidx
    b.next_bidx = bidx + k
    b.stats.forwarded = b.stats.forwarded + k
    for wid = bus.opts.privileged_agent and AGENT or 0,
              bus.worker_count - 1 do
        if wid ~= from then
            local q = queue(b, wid)
            if room(bus, b, q, from, k, size) then
                q.buf:putcdata(p, size)
                queued(q, from, k, bidx)
            end
        end
    end
    local last = bidx + k - 1
    local ackq = c.ackq
    if ackq then
        ackq:push(last, seq)
    end
    local rings = b.rings[from]
    if not rings then
        rings = fifo.new()
        b.rings[from] = rings
    end
    rings:push(last, run_end(s.pos, s.len))
end


_M.forward = forward
_M.forward_shm = forward_shm
_M.run_length = run_length
_M.forward_run = forward_run
_M.forward_urgent = forward_urgent


return _M
