-- The client's reading side: frames from the broker (events into the
-- inbox, acknowledgements that free the publish queue, the broker's word
-- on our unique events, urgent events), read while the handlers keep up.


local buffer = require "string.buffer"
local frame = require "resty.loom.events.frame"
local dispatch = require "resty.loom.events.dispatch"
local own = require "resty.loom.events.own"
local collect = require "resty.loom.events.collect"
local yield = require("resty.loom.yield").yield

local frame_seq = frame.seq
local ngx_now = ngx.now
local buf_new = buffer.new
local pcall = pcall
local tostring = tostring
local min = math.min
local mono = dispatch.mono
local inbox_len = dispatch.inbox_len
local inbox_push_raw = dispatch.inbox_push_raw
local report_gap = dispatch.report_gap
local warn_once = require("resty.loom.events.log").warn_once
local own_unique = own.own_unique
local receive_urgent = collect.receive_urgent

local T_EVENT = frame.EVENT
local T_ACK = frame.ACK
local T_PONG = frame.PONG
local T_REJECT = frame.REJECT
local T_URGENT = frame.URGENT
local T_OWN_RUN = frame.OWN_RUN
local T_OWN_SKIP = frame.OWN_SKIP
local T_SHM = frame.SHM
local EVENT_SIZE = frame.EVENT_SIZE
local ALL = frame.ALL
local OTHERS = frame.OTHERS
local READ_SIZE = frame.READ_SIZE
local EXACT_MIN = frame.EXACT_MIN
local CHUNK = frame.CHUNK
-- the broker keeps the events it wrote to a worker until the worker
-- confirms them: every ACK_EVERY events, else ACK_DELAY s after the last
local ACK_EVERY = 256
local ACK_DELAY = 0.01
local CONNECT_TIMEOUT = 2
local SEND_TIMEOUT = 30
-- seconds spent handling what was read before the reader yields (the
-- handlers' slice: see dispatch.lua)
local SLICE = dispatch.SLICE
local MORE = -1         -- consume() stopped with whole frames left


local _M = {
    _VERSION = "0.2.0",
    ACK_EVERY = ACK_EVERY,
    ACK_DELAY = ACK_DELAY,
    MORE = MORE,
    CONNECT_TIMEOUT = CONNECT_TIMEOUT,
    SEND_TIMEOUT = SEND_TIMEOUT,
}


-- bookkeeping of one publisher's sequence numbers: drops duplicates (a
-- re-send after a broker restart) and counts gaps
local function accept_seq(self, e, seq)
    local pid = e.pid
    local inc = e.incarnation
    local last = self.last_seq[inc]
    if last and seq <= last then
        self.counters.duplicates = self.counters.duplicates + 1
        return false
    end
    self.last_seq[inc] = seq

    local target = e.target
    local stream = e.stream_seq
    if stream > 0 then
        local book = target == ALL and self.last_all
                     or target == OTHERS and self.last_others
                     or self.last_direct
        local prev = book[inc]
        book[inc] = stream
        if prev and stream > prev + 1 then
            report_gap(self, e.publisher, pid, stream - prev - 1)
        end
    end
    return true
end


local function receive_event(self, seq, p, len)
    local e, why = frame.check_event(p, len)
    if not e then
        return nil, why
    end
    local off = EVENT_SIZE + e.key_len
    if not accept_seq(self, e, seq) then
        return true
    end
    -- the body waits undecoded (see dispatch.lua: inbox_push_raw)
    inbox_push_raw(self, p + off, e.body_len, e.publisher, e.published_at,
                   e.pid)
    return true
end


-- n events left the queue: as many publishers waiting for room may go on
-- (the semaphore counts its waiters, also when one is killed)
local function wake_publishers(self, n)
    local waiting = -self.space:count()
    if waiting > 0 then
        self.space:post(min(n, waiting))
    end
end
_M.wake_publishers = wake_publishers


local function on_ack(self, seq)
    local q = self.unacked_q
    local freed = 0
    while true do
        local s, bytes = q:peek()
        if not s or s > seq then
            break
        end
        q:pop()
        self.unacked:skip(bytes)
        self.pending = self.pending - 1
        self.pending_bytes = self.pending_bytes - bytes
        freed = freed + 1
    end
    if freed > 0 then
        wake_publishers(self, freed)
    end
    self.ring_runs:pop_below(seq + 1)
end


local consume


-- A run of events in a publisher's ring (SHM frame payload at pp, len
-- bytes): copied out and handled as if they had come on the socket. A run
-- written over before we read it is lost; the gap shows at the
-- publisher's next event.
local function receive_run(self, pp, len, st)
    local s = frame.check_shm(pp, len)
    if not s then
        return nil, "bad SHM frame"
    end
    local bytes = s.len
    local rings = self.rings
    if not rings then
        return nil, "an SHM frame, and no rings"
    end
    local buf = self.ring_buf
    if not rings:get(s.publisher, s.pos, s.len, buf) then
        local c = self.counters
        c.overwritten = c.overwritten + s.events
        st.got = st.got + s.events
        warn_once(self, "overwritten", s.events, " event(s) from worker ",
                  s.publisher, " written over in its ring before this "
                  .. "worker read them; ", c.overwritten, " so far")
        return bytes
    end
    local got = st.got
    local need, err = consume(self, buf, st, true)
    if need ~= 0 or #buf > 0 then
        return nil, err or "a partial frame in a ring's run"
    end
    if st.got - got ~= s.events then
        return nil, "a ring's run of " .. s.events .. " events held "
                    .. st.got - got
    end
    return bytes
end


-- Handles the whole frames at the front of rbuf (st collects a chunked
-- event across calls; inner: rbuf is a ring's run, events only). Returns
-- the bytes still missing of the next frame (0: unknown), MORE when it
-- stopped before the end of what is there (the inbox is full, or it took
-- a read's worth from the rings: a small SHM frame stands for up to
-- WRITE_MAX bytes of events), or nil and what was wrong.
function consume(self, rbuf, st, inner)
    local max_payload = self.opts.max_payload
    local from_rings = 0
    while true do
        local h, pp, size = frame.peek(rbuf, CHUNK)
        if h == nil then
            return pp
        end
        if h == false then
            return nil, pp
        end
        local typ = h.type
        local ok, err
        if typ == T_EVENT then
            local seq = frame_seq(h)
            local p, len = frame.collect(st, seq, h, pp, max_payload)
            if p == false then
                return nil, len
            end
            ok = true
            if p then
                ok, err = receive_event(self, seq, p, len)
                st.partial = nil
                st.got = st.got + 1
            end
            if not ok then
                return nil, err
            end

        elseif inner then
            return nil, "unexpected frame type " .. tostring(typ)
                        .. " in a ring's run"

        elseif typ == T_SHM then
            local bytes
            bytes, err = receive_run(self, pp, h.len, st)
            if not bytes then
                return nil, err
            end
            from_rings = from_rings + bytes
            if from_rings >= READ_SIZE
               or inbox_len(self) >= self.opts.max_backlog then
                rbuf:skip(size)
                return MORE
            end

        elseif typ == T_ACK then
            on_ack(self, frame_seq(h))

        elseif typ == T_OWN_RUN or typ == T_OWN_SKIP then
            own_unique(self, frame_seq(h), typ == T_OWN_RUN)

        elseif typ == T_URGENT then
            ok, err = receive_urgent(self, pp, h.len)
            if not ok then
                return nil, err
            end

        elseif typ == T_REJECT then
            local _, reason = pcall(frame.decode_control, pp, h.len)
            return nil, "rejected by the broker: " .. tostring(reason)

        elseif typ ~= T_PONG then
            -- (a pong needs nothing: arriving resets the read timeout,
            -- which is the heartbeat)
            return nil, "unexpected frame type " .. tostring(typ)
        end
        rbuf:skip(size)
    end
end
_M.consume = consume


-- back-pressure: no more events while the handlers are behind, unless a
-- handler waits for room to publish (see make_room)
local function wait_inbox_room(self, link)
    local d = self.dispatch
    while inbox_len(self) >= self.opts.max_backlog and not link.closed
          and not (d.waiting and d[1]) do
        self.rwaiters = self.rwaiters + 1
        self.rspace:wait(1)
        self.rwaiters = self.rwaiters - 1
    end
end
_M.wait_inbox_room = wait_inbox_room


local function reader(self, sock, link)
    local rbuf = buf_new(READ_SIZE)
    local need = 0
    local busy = 0          -- seconds spent in consume() since a yield
    -- (the chunk being collected, and the events received: link.got)
    local st = link
    -- the broker answers our pings: silence this long means it is gone;
    -- a send may wait longer while the broker is busy with a slow worker
    sock:settimeouts(CONNECT_TIMEOUT * 1000, SEND_TIMEOUT * 1000,
                     self.opts.heartbeat * 3000)

    while true do
        wait_inbox_room(self, link)

        local err
        if need ~= MORE then
            -- the rest of a frame, or what is there: see frame.lua for why
            local data
            if need > EXACT_MIN then
                data, err = sock:receive(need)
            else
                data, err = sock:receiveany(READ_SIZE)
            end
            if not data then
                if link.error then
                    return nil, link.error
                end
                return nil, err == "timeout" and "broker heartbeat timeout"
                            or err
            end
            rbuf:put(data)
            if link.error and not link.draining then
                -- our write failed: the broker is gone (or stuck). What it
                -- sent before is in our socket's buffer, whole frames in
                -- order: handle them, waiting no more than 1 ms for the
                -- next bytes (a re-send after the reconnect is dropped as
                -- a duplicate)
                link.draining = true
                sock:settimeouts(CONNECT_TIMEOUT * 1000, SEND_TIMEOUT * 1000,
                                 1)
            end
        end
        local t0 = mono()
        need, err = consume(self, rbuf, st)
        if not need then
            return nil, err
        end
        busy = busy + (mono() - t0)
        if link.got > link.acked then
            -- the broker holds these until we confirm them: the writer
            -- does within ACK_DELAY, or at once for a long run
            if not link.since then
                link.since = ngx_now()
            end
            if self.writer_idle
               and (not link.short or link.got - link.acked >= ACK_EVERY) then
                self.writer_idle = false
                self.wsema:post(1)
            end
        end
        if busy >= SLICE then
            -- a long run of reads: let requests in (the time a read
            -- waited does not count: the loop turned then)
            busy = 0
            yield()
        end
    end
end
_M.reader = reader


return _M
