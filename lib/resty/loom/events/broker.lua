-- The broker side of the bus: runs in one worker, serves each worker's
-- connection (one request on the `listen unix:` server each; its own
-- worker's client is linked in-process), and forwards events to
-- per-worker queues. A publisher's events are acknowledged once they have
-- been written to every connected target's socket (or taken by the broker
-- worker's handler queue), so the publisher can re-send what was not
-- acknowledged after a broker crash. Queues are keyed by worker id and
-- outlive connections, so a restarting worker gets what was published
-- while it was down.


local ffi = require "ffi"
local buffer = require "string.buffer"
local frame = require "resty.loom.events.frame"
local fifo = require "resty.loom.events.fifo"
local ring = require "resty.loom.events.ring"
local semaphore = require "ngx.semaphore"
local clear = require "table.clear"
local yield = require("resty.loom.yield").yield
local at_close = require "resty.loom.at_close"

local C = ffi.C
local ffi_string = ffi.string
local frame_seq = frame.seq
local ngx = ngx
local ngx_log = ngx.log
local ngx_var = ngx.var
local ngx_now = ngx.now
local ngx_exit = ngx.exit
local spawn = ngx.thread.spawn
local kill = ngx.thread.kill
local buf_new = buffer.new
local pcall = pcall
local tostring = tostring
local crc32 = ngx.crc32_short

local ERR = ngx.ERR
local WARN = ngx.WARN
local INFO = ngx.INFO

local T_HELLO = frame.HELLO
local T_WELCOME = frame.WELCOME
local T_EVENT = frame.EVENT
local T_ACK = frame.ACK
local T_PING = frame.PING
local T_PONG = frame.PONG
local T_REJECT = frame.REJECT
local T_BYE = frame.BYE
local T_URGENT = frame.URGENT
local T_OWN_RUN = frame.OWN_RUN
local T_OWN_SKIP = frame.OWN_SKIP
local FRAME_SIZE = frame.FRAME_SIZE
local EVENT_SIZE = frame.EVENT_SIZE
local ALL = frame.ALL
local OTHERS = frame.OTHERS
local UNIQUE = frame.UNIQUE
local AGENT = frame.AGENT

local READ_SIZE = frame.READ_SIZE
local YIELD_BYTES = frame.YIELD_BYTES
local WRITE_MAX = frame.WRITE_MAX
local EXACT_MIN = frame.EXACT_MIN
local CHUNK = frame.CHUNK
local HELLO_TIMEOUT = 2            -- seconds to send a valid hello
local SEND_TIMEOUT = 60            -- seconds a write to a busy worker may take
local LOG_INTERVAL = 10            -- seconds between repeated warnings


ffi.cdef [[
int ngx_loom_ffi_is_sibling(int pid);
unsigned int geteuid(void);
]]


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


local function reject(b, sock, reason, detail)
    count(b.stats.rejected, reason)
    -- during a reload, the new generation knocks on the old broker's door
    -- until it exits: expected, not worth a warning
    log(reason == "other generation" and INFO or WARN,
        "rejected a connection: ", reason, detail and (": " .. detail)
        or "")
    if sock then
        local out = buf_new()
        frame.put_control(out, T_REJECT, 0, reason)
        sock:send(out:get())
    end
end


-- Events older than the returned index have been received by every live
-- target (it acknowledged them), except a target that has been too slow:
-- one whose events are being dropped, whose write has waited
-- slow_timeout, or that has not acknowledged a write that old. It holds
-- nobody's acknowledgements back (what is queued for it is then lost to
-- it if the broker crashes as well).
local function too_slow(q, now, slow)
    local _, _, _, _, sent_at = q.sent:first()
    return q.overflowing or (q.send_since and now - q.send_since >= slow)
           or (sent_at and now - sent_at >= slow)
end


local function watermark(b, slow)
    local low = b.next_bidx
    local now = ngx_now()
    for _, q in pairs(b.queues) do
        if q.conn and not too_slow(q, now, slow) then
            local _, _, _, sent_bidx = q.sent:first()
            -- the oldest of: unacknowledged, being written, queued (an
            -- enqueue that waited may put an earlier event behind a send)
            local i = sent_bidx
            local f = q.inflight_bidx
            if f and (not i or f < i) then
                i = f
            end
            f = q.first_bidx
            if f and (not i or f < i) then
                i = f
            end
            if i and i < low then
                low = i
            end
        end
    end
    return low
end


local function send_acks(b)
    local low = watermark(b, b.slow_timeout)
    for _, q in pairs(b.queues) do
        local c = q.conn
        if c and c.ackq and c.ackq:len() > 0 then
            local last
            while true do
                local bidx, seq = c.ackq:peek()
                if not bidx or bidx >= low then
                    break
                end
                c.ackq:pop()
                last = seq
            end
            if last then
                frame.put_empty(c.ctl, T_ACK, last)
                wake_writer(q)
            end
        end
    end
end


-- Ends c's turn as q's writer. Whatever of its batch was not written is
-- still at the front of q.buf (see send_queued): counted again, it goes
-- to the next connection of that worker id (a reconnecting process drops
-- what it had already seen by sequence number). Called when the writer
-- returns, and after it was killed in a send.
local function release(q, c)
    local events = c.batch_events
    if events then
        c.batch_events = nil
        q.n = q.n + events - c.written
        local bidx = c.batch_bidx
        if bidx and (not q.first_bidx or bidx < q.first_bidx) then
            q.first_bidx = bidx
        end
        q.inflight_bidx = nil
        q.send_since = nil
    end
    if q.writer == c then
        -- written but not acknowledged: sent again, from the front
        local _, _, _, bidx = q.sent:first()
        if bidx and (not q.first_bidx or bidx < q.first_bidx) then
            q.first_bidx = bidx
        end
        q.n = q.n + q.sent_events
        q.sent_bytes, q.sent_events = 0, 0
        while q.sent:pop() do
            -- (dropped: the records counted this connection's writes)
        end
        q.writer = nil
        local waiting = -q.writer_sema:count()
        if waiting > 0 then
            q.writer_sema:post(waiting)
        end
    end
end


-- Sends `left` bytes of q.buf after what is awaiting acknowledgement (the
-- batch: whole events) in writes of whole frames up to WRITE_MAX bytes
-- (see frame.lua). Written events stay in q.buf until the worker
-- acknowledges them (on_received), and join the sent part only once
-- their last frame is written: a connection that breaks leaves whole
-- events, and the next one starts with the first the worker did not
-- confirm (a connection must not start in the middle of a chunked
-- event). c.written counts the events written. Returns false when the
-- send failed.
local function send_queued(q, c, left, bidx)
    local sock = c.sock
    local buf = q.buf
    local ctl = c.ctl
    local off = 0       -- bytes written of the event still open
    while left > 0 do
        if #ctl > 0 and off == 0 then
            -- acks, pongs and urgent events do not wait for the batch
            -- (between whole frames)
            local ok, err = sock:send(ctl:get())
            if not ok then
                c.closed = true
                c.error = "failed to send: " .. err
                return false
            end
        end
        -- (the pointer and the sent part again after every send: enqueue
        -- appends, and acknowledgements take from the front, meanwhile)
        local p = buf:ref() + q.sent_bytes
        local size, events, open = frame.whole_frames(p + off, left,
                                                      WRITE_MAX)
        local ok, err = sock:send(ffi_string(p + off, size))
        if not ok then
            c.closed = true
            c.error = "failed to send: " .. err
            return false
        end
        left = left - size
        c.written = c.written + events
        if not open then
            local n = q.sent_events + events
            c.sent = c.sent + events
            -- (a later batch may hold an earlier index, after an enqueue
            -- that waited: the oldest record keeps the least index)
            if bidx then
                q.sent:lower(4, bidx)
            end
            q.sent:push(c.sent, off + size, events, bidx, ngx_now())
            q.sent_bytes = q.sent_bytes + off + size
            q.sent_events = n
            off = 0
        else
            -- (a run that ends inside an event is that event's frame
            -- alone: CHUNK > WRITE_MAX, so events is 0 here)
            off = off + size
        end
    end
    return true
end


-- The worker has received the first n events written on connection c:
-- they leave the queue.
local function on_received(b, q, c, n)
    if q.writer ~= c then
        -- (a connection whose writer waits for the previous one's turn to
        -- end has had nothing written yet)
        return
    end
    local sent = q.sent
    local freed = 0
    while true do
        local upto, bytes, events = sent:first()
        if not upto or upto > n then
            break
        end
        sent:pop()
        q.buf:skip(bytes)
        q.sent_bytes = q.sent_bytes - bytes
        q.sent_events = q.sent_events - events
        freed = freed + events
    end
    if freed > 0 then
        send_acks(b)
    end
end


-- the broker worker's own handlers take what is queued in this process
-- (enqueue fills the spare buffer meanwhile)
local function deliver_queued(q, c)
    local batch = q.buf
    q.buf, c.spare = c.spare, batch
    -- taken: room for what waits to be queued meanwhile (the handlers may
    -- keep deliver waiting, as a socket keeps what it was written)
    c.written = c.batch_events
    local waiting = -q.space_sema:count()
    if waiting > 0 then
        q.space_sema:post(waiting)
    end
    local ok, err = c.deliver(batch)
    batch:reset()
    if not ok then
        -- frames we made ourselves: a bug, not a peer's fault
        log(ERR, "failed to deliver to this worker: ", err)
    end
end


local function writer(b, q, c)
    local sock = c.sock
    local sema = q.data_sema
    local ctl = c.ctl
    -- one writer per queue: a connection that took q over from one whose
    -- send is still under way waits for that writer to let go of q.buf
    while q.writer and not c.closed do
        q.writer_sema:wait(1)
    end
    if c.closed then
        return
    end
    q.writer = c
    while not c.closed do
        if #q.buf == q.sent_bytes and #ctl == 0 then
            q.writer_idle = true
            sema:wait(1)
            q.writer_idle = false
        end
        if c.closed then
            break
        end
        if #ctl > 0 then
            local ok, err = sock:send(ctl:get())
            if not ok then
                c.closed = true
                c.error = "failed to send: " .. err
                break
            end
        end
        if #q.buf > q.sent_bytes then
            -- what is queued now is one batch for the acks
            local bidx = q.first_bidx
            q.inflight_bidx = bidx
            q.first_bidx = nil
            local events = q.n
            q.n = 0
            clear(q.by)
            q.publishers = 0
            c.batch_events, c.batch_bidx, c.written = events, bidx, 0
            q.send_since = ngx_now()
            if c.deliver then
                -- (handed over in this process: received at once)
                deliver_queued(q, c)
            elseif not send_queued(q, c, #q.buf - q.sent_bytes, bidx) then
                break
            end
            c.batch_events = nil
            q.inflight_bidx = nil
            q.send_since = nil
            if events > 0 then
                -- room for what waits to be queued
                q.overflowing = false
                local waiting = -q.space_sema:count()
                if waiting > 0 then
                    q.space_sema:post(waiting)
                end
                if c.deliver then
                    -- (a socket's events are acknowledged once the worker
                    -- confirms them: on_received)
                    send_acks(b)
                end
            end
        end
    end
    release(q, c)
end


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


-- Appends one event (payload p, len) to q, waiting (up to slow_timeout)
-- for room when q is full and its worker is connected. Returns false when
-- it had to drop it (counted, logged at most once per interval).
local function enqueue(bus, b, q, from, seq, bidx, p, len)
    if q.gone then
        -- (nobody will read it: its worker is exiting, and no successor
        -- comes in this generation)
        drop(b, q, "worker gone", 1, from, p, len)
        return false
    end
    local opts = bus.opts
    local max_n, max_bytes = opts.max_backlog, opts.max_queue_bytes
    local full = unwritten(q) >= max_n
    local mine = q.by[from] or 0
    local others = q.publishers - (mine > 0 and 1 or 0)
    if full and others > 0 and (mine + 1) * (others + 1) <= max_n then
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
        while q.conn and (unwritten(q) >= max_n
                          or #q.buf - q.sent_bytes + len > max_bytes)
              and ngx_now() < deadline do
            q.space_sema:wait(0.1)
        end
    end
    if full and (unwritten(q) >= max_n
                 or #q.buf - q.sent_bytes + len > max_bytes) then
        -- no more waiting for this worker until its writer catches up
        q.overflowing = true
        drop(b, q, q.conn and "subscriber too slow"
                   or "worker down, queue full", 1, from, p, len)
        return false
    end
    frame.put_chunked(q.buf, T_EVENT, seq, p, len)
    q.n = q.n + 1
    if mine == 0 then
        q.publishers = q.publishers + 1
    end
    q.by[from] = mine + 1
    -- the oldest unwritten event: another publisher's earlier event may be
    -- enqueued after a later one when an enqueue waited
    if not q.first_bidx or bidx < q.first_bidx then
        q.first_bidx = bidx
    end
    wake_writer(q)
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


-- Handles the whole frames at the front of rbuf, from c's worker (a
-- chunked event is collected in c.partial across calls). Returns the
-- bytes still missing of the next frame (0: unknown), true when the
-- worker said bye, or nil and what was wrong.
local function consume(bus, b, c, rbuf)
    local max_payload = bus.opts.max_payload
    while true do
        local h, pp, size = frame.peek(rbuf, CHUNK)
        if h == nil then
            return pp
        end
        if h == false then
            return nil, pp
        end
        local typ = h.type
        if typ == T_EVENT then
            local seq = frame_seq(h)
            local ok, why = true
            local p, len = frame.collect(c, seq, h, pp, max_payload)
            if p == false then
                return nil, len
            end
            if p then
                ok, why = forward(bus, b, c, seq, p, len)
                c.partial = nil
            end
            if not ok then
                return nil, why
            end

        elseif typ == T_URGENT then
            local ok, why = forward_urgent(bus, b, c, pp, h.len)
            if not ok then
                return nil, why
            end

        elseif typ == T_PING then
            frame.put_empty(c.ctl, T_PONG, frame_seq(h))
            wake_writer(c.q)

        elseif typ == T_BYE then
            -- the worker is leaving and has sent all it had; it reads
            -- until we close
            return true

        elseif typ == T_ACK then
            -- the worker has received this many events of ours
            on_received(b, c.q, c, frame_seq(h))

        elseif typ ~= T_PONG then
            -- (a stray pong is harmless)
            return nil, "unexpected frame type " .. tostring(typ)
        end
        rbuf:skip(size)
    end
end


-- Reads frames from one worker until it goes away or misbehaves.
local function reader(bus, b, c)
    local sock = c.sock
    local rbuf = c.rbuf

    -- clients ping twice per heartbeat: silence this long means trouble;
    -- a send may wait much longer for a subscriber that is busy
    sock:settimeouts(HELLO_TIMEOUT * 1000, SEND_TIMEOUT * 1000,
                     bus.opts.heartbeat * 3000)

    local need = 0
    local since_yield = 0
    while true do
        -- the rest of a frame, or what is there: see frame.lua
        local data, err
        if need > EXACT_MIN then
            data, err = sock:receive(need)
        else
            data, err = sock:receiveany(READ_SIZE)
        end
        if c.closed then
            -- the writer failed, or another connection took over
            return nil, c.error or "replaced"
        end
        if not data then
            return nil, err == "timeout" and "heartbeat timeout" or err
        end
        rbuf:put(data)
        local why
        need, why = consume(bus, b, c, rbuf)
        if need == true then
            return true
        end
        if not need then
            return nil, why
        end
        -- once per read, not per event: acks for what is written
        send_acks(b)
        since_yield = since_yield + #data
        if since_yield >= YIELD_BYTES then
            -- a long run of reads: let requests in
            since_yield = 0
            yield()
        end
    end
end


local function read_hello(sock)
    sock:settimeout(HELLO_TIMEOUT * 1000)
    local hdr, err = sock:receive(FRAME_SIZE)
    if not hdr then
        return nil, "no hello: " .. err
    end
    local rbuf = buf_new()
    rbuf:put(hdr)
    local h = ffi.cast("loom_ev_frame_t *", (rbuf:ref()))
    if h.version ~= frame.VERSION then
        return nil, "wrong version"
    end
    if h.type ~= T_HELLO then
        return nil, "first frame is not a hello"
    end
    if h.len > 4096 then
        return nil, "hello too large"
    end
    local len = h.len
    local rest
    rest, err = sock:receive(len + frame.TRAILER_SIZE)
    if not rest then
        return nil, "no hello: " .. err
    end
    rbuf:put(rest)
    local hd, p = frame.peek(rbuf, 4096)
    if not hd then
        return nil, "bad hello"
    end
    local ok, hello = pcall(frame.decode_control, p, len)
    if not ok or type(hello) ~= "table" then
        return nil, "bad hello"
    end
    return hello
end


-- Reads a worker's lane: urgent events and pings only.
local function lane_reader(bus, b, l)
    local sock = l.sock
    local rbuf = buf_new(READ_SIZE)
    sock:settimeouts(HELLO_TIMEOUT * 1000, SEND_TIMEOUT * 1000,
                     bus.opts.heartbeat * 3000)
    local err
    while not l.closed do
        local data
        data, err = sock:receiveany(READ_SIZE)
        if not data then
            break
        end
        rbuf:put(data)
        while true do
            local h, pp, size = frame.peek(rbuf, CHUNK)
            if not h then
                err = h == false and pp or nil
                break
            end
            if h.type == T_URGENT then
                local ok, why = forward_urgent(bus, b, l, pp, h.len)
                if not ok then
                    err = why
                    break
                end
            elseif h.type == T_PING then
                frame.put_empty(l.ctl, T_PONG, frame_seq(h))
                l.sema:post(1)
            else
                err = "unexpected frame type " .. tostring(h.type)
                    .. " on the lane"
                break
            end
            rbuf:skip(size)
        end
        if err then
            break
        end
    end
    if err and err ~= "closed" and not ngx.worker.exiting() then
        log(WARN, "closed worker ", l.wid, "'s lane: ", err)
    end
    l.closed = true
    l.sema:post(1)
end


-- Serves a worker's lane: a second connection that carries only urgent
-- events (collect and its answers) both ways, so that they never wait
-- behind the events of its connection, which the broker and the worker
-- stop reading while a queue is full (back-pressure). It lives as long
-- as the worker's connection, whose liveness decides.
local function serve_lane(bus, b, q, sock, pid)
    local l = {
        sock = sock,
        wid = q.wid,
        pid = pid,
        ctl = buf_new(256),
        sema = semaphore.new(),
        closed = false,
    }
    local out = buf_new()
    frame.put_control(out, T_WELCOME, 0, { broker_pid = ngx.worker.pid() })
    local ok = sock:send(out:get())
    if not ok then
        return ngx_exit(444)
    end
    if q.lane then
        q.lane.closed = true
        q.lane.sema:post(1)
    end
    q.lane = l
    local rt = spawn(lane_reader, bus, b, l)
    while not l.closed do
        if #l.ctl == 0 then
            l.sema:wait(1)
        end
        if #l.ctl > 0 and not sock:send(l.ctl:get()) then
            break
        end
    end
    l.closed = true
    kill(rt)
    if q.lane == l then
        q.lane = nil
    end
    return ngx_exit(444)
end


-- c takes q over: the connection that held it (a process with this id
-- that is gone, or lost its connection) is closed
local function attach(b, q, c)
    if q.conn then
        q.conn.closed = true
        q.data_sema:post(1)
    end
    q.conn = c
    q.gone = false
    if c.sock then
        b.remote = b.remote + 1
    end
    b.stats.accepted = b.stats.accepted + 1
    b.stats.connections = b.stats.connections + 1
end


local function detach(b, q, c)
    if q.conn == c then
        q.conn = nil
        -- (a replaced connection's writer may still be sending: its batch
        -- stays in flight until release())
        if not q.writer or q.writer == c then
            q.inflight_bidx = nil
            q.send_since = nil
        end
        if c.bye and not q.writer then
            -- its worker is exiting: what it did not confirm, and what
            -- comes for it from now on, is dropped and counted, not kept
            -- for a successor that this generation will not start
            q.gone = true
            if q.n > 0 then
                drop(b, q, "worker gone", q.n)
            end
            q.buf:reset()
            q.n, q.first_bidx = 0, nil
        end
    end
    if c.sock then
        b.remote = b.remote - 1
    end
    b.stats.connections = b.stats.connections - 1
    send_acks(b)
end


-- Serves one worker's connection; called from content_by_lua on the bus's
-- `listen unix:` server. Returns when the connection ends.
function _M.serve(bus)
    local b = state(bus)
    local opts = bus.opts

    if ngx.worker.id() ~= opts.broker then
        count(b.stats.rejected, "not the broker")
        log(ERR, "connection on worker ", ngx.worker.id(),
            " which is not the broker (", opts.broker, ")")
        return ngx_exit(444)
    end

    -- who is at the other end: same user, a worker of this master
    local uid = tonumber(ngx_var.loom_peer_uid)
    local pid = tonumber(ngx_var.loom_peer_pid)
    if not uid or uid ~= C.geteuid() then
        reject(b, nil, "peer uid", tostring(uid))
        return ngx_exit(444)
    end
    if not pid or C.ngx_loom_ffi_is_sibling(pid) ~= 1 then
        reject(b, nil, "peer not a worker", tostring(pid))
        return ngx_exit(444)
    end

    if ngx.req.get_headers()["upgrade"] ~= "loom-events/1" then
        reject(b, nil, "bad upgrade")
        return ngx_exit(400)
    end

    ngx.status = 101
    ngx.header["Upgrade"] = "loom-events/1"
    ngx.header["Content-Type"] = nil
    ngx.send_headers()
    ngx.flush(true)

    local sock, err = ngx.req.socket(true)
    if not sock then
        log(ERR, "failed to take the raw socket: ", err)
        return ngx_exit(444)
    end

    local hello
    hello, err = read_hello(sock)
    if not hello then
        reject(b, nil, err == "wrong version" and err or "bad hello", err)
        return ngx_exit(444)
    end

    local wid = hello.worker
    if hello.version ~= frame.VERSION then
        reject(b, sock, "wrong version", tostring(hello.version))
        return ngx_exit(444)
    end
    if hello.generation ~= bus.generation then
        reject(b, sock, "other generation")
        return ngx_exit(444)
    end
    if hello.pid ~= pid then
        reject(b, sock, "hello pid differs from peer", tostring(hello.pid))
        return ngx_exit(444)
    end
    if type(wid) ~= "number"
       or not ((wid >= 0 and wid < bus.worker_count)
               or (wid == AGENT and opts.privileged_agent)) then
        reject(b, sock, "bad worker id", tostring(wid))
        return ngx_exit(444)
    end

    local q = queue(b, wid)
    -- (the broker worker's own client is linked in-process: its id never
    -- comes over a socket, whatever the pid)
    if wid == opts.broker
       or (q.conn and q.conn.pid ~= pid
           and C.ngx_loom_ffi_is_sibling(q.conn.pid) == 1) then
        reject(b, sock, "worker id in use", tostring(wid))
        return ngx_exit(444)
    end
    if hello.lane then
        if not (q.conn and q.conn.pid == pid) then
            reject(b, sock, "lane without a connection", tostring(wid))
            return ngx_exit(444)
        end
        return serve_lane(bus, b, q, sock, pid)
    end
    local c = {
        sock = sock,
        wid = wid,
        pid = pid,
        q = q,
        rbuf = buf_new(READ_SIZE),
        ackq = fifo.new(),
        ctl = buf_new(256),     -- acks and pongs, sent ahead of events
        sent = 0,               -- events written on this connection
        closed = false,
    }
    attach(b, q, c)

    -- the welcome goes first, before anything queued for this worker
    local out = buf_new()
    frame.put_control(out, T_WELCOME, 0, { broker_pid = ngx.worker.pid() })
    local ok
    ok, err = sock:send(out:get())
    if not ok then
        log(INFO, "worker ", wid, " went away during the handshake: ", err)
    else
        log(INFO, "worker ", wid, " (pid ", pid, ") connected")
        local wt = spawn(writer, b, q, c)
        local rok, rerr = reader(bus, b, c)
        c.bye = rok == true
        c.closed = true
        q.data_sema:post(1)
        -- a writer stuck in a send to a dead peer is stopped here; what
        -- it had not written goes to the next connection
        kill(wt)
        release(q, c)
        if not rok and not ngx.worker.exiting() then
            if rerr == "closed" or rerr == "replaced" then
                log(INFO, "worker ", wid, " disconnected")
            else
                count(b.stats.rejected, "protocol error")
                log(WARN, "closed worker ", wid, "'s connection: ", rerr)
            end
        end
    end

    detach(b, q, c)
    return ngx_exit(444)
end


-- The broker worker's own link: no socket, no acks. deliver(buf) hands
-- the whole frames in buf to this worker's handlers and returns true, or
-- nil and an error; urgent(p, len) handles an urgent event's payload;
-- own(seq, run) says whether this worker's unique event seq, which lands
-- on it, runs. Starts the writer in the caller's context; returns the
-- link for take_local() and detach_local().
function _M.attach_local(bus, deliver, urgent, own)
    local b = state(bus)
    local wid = ngx.worker.id()
    local q = queue(b, wid)
    local c = {
        wid = wid,
        pid = ngx.worker.pid(),
        q = q,
        ctl = buf_new(64),      -- stays empty: no pings, no acks
        spare = buf_new(65536),
        deliver = deliver,
        urgent = urgent,
        own = own,
        closed = false,
    }
    attach(b, q, c)
    c.thread = spawn(writer, b, q, c)
    return c
end


-- Forwards the events in buf (whole frames, as the client writer makes
-- them) from this worker; may wait for a slow worker's queue. Returns
-- true, or nil and an error.
function _M.take_local(bus, c, buf)
    local b = bus.broker_state
    local need, err = consume(bus, b, c, buf)
    if not need then
        return nil, err
    end
    send_acks(b)
    return true
end


function _M.detach_local(bus, c)
    local b = bus.broker_state
    local q = c.q
    -- (only at exit)
    c.bye = true
    c.closed = true
    q.data_sema:post(1)
    ngx.thread.wait(c.thread)
    detach(b, q, c)
end


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
