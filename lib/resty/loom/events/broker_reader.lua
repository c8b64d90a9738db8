-- Reads one worker's connection: consume() handles the frames it sent
-- (events, urgent events, pings, acks, its goodbye); reader() is the loop
-- that reads them from the socket.


local frame = require "resty.loom.events.frame"
local yield = require("resty.loom.yield").yield
local bqueue = require "resty.loom.events.broker_queue"
local acks = require "resty.loom.events.broker_acks"
local route = require "resty.loom.events.broker_route"

local frame_seq = frame.seq
local tostring = tostring

local T_EVENT = frame.EVENT
local T_ACK = frame.ACK
local T_PING = frame.PING
local T_PONG = frame.PONG
local T_BYE = frame.BYE
local T_URGENT = frame.URGENT
local T_SHM = frame.SHM

local READ_SIZE = frame.READ_SIZE
local YIELD_BYTES = frame.YIELD_BYTES
local EXACT_MIN = frame.EXACT_MIN
local CHUNK = frame.CHUNK
local HELLO_TIMEOUT = 2            -- seconds to send a valid hello
local SEND_TIMEOUT = 60            -- seconds a write to a busy worker may take

local wake_writer = bqueue.wake_writer
local send_acks = acks.send_acks
local on_received = acks.on_received
local forward = route.forward
local forward_run = route.forward_run
local forward_shm = route.forward_shm
local run_length = route.run_length
local forward_urgent = route.forward_urgent


local _M = { _VERSION = "0.2.0" }


-- Handles the whole frames at the front of rbuf, from c's worker (a
-- chunked event is collected in c.partial across calls; a run of events
-- to "all" or "others" goes on as one, see forward_run). Returns the
-- bytes still missing of the next frame (0: unknown), true when the
-- worker said bye, or nil and what was wrong.
local function consume(bus, b, c, rbuf)
    local max_payload = bus.opts.max_payload
    local single = 0        -- events of a run to forward one at a time
    while true do
        local h, pp, size = frame.peek(rbuf, CHUNK)
        if h == nil then
            return pp
        end
        if h == false then
            return nil, pp
        end
        local typ = h.type
        local run = 0           -- bytes of a run forwarded as one
        if typ == T_EVENT and single == 0 and not c.partial then
            -- events to "all" or "others" in a row: one copy per queue
            local p, n = rbuf:ref()
            local k, bytes = run_length(p, n)
            if k > 0 then
                if forward_run(bus, b, c, p, k, bytes) then
                    run = bytes
                else
                    single = k
                end
            end
        end
        if run > 0 then
            size = run

        elseif typ == T_EVENT then
            if single > 0 then
                single = single - 1
            end
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

        elseif typ == T_SHM then
            local sh = frame.check_shm(pp, h.len)
            if not sh or sh.publisher ~= c.wid or sh.events == 0
               or c.partial
               or not (bus.rings
                       and bus.rings:check(c.wid, sh.pos, sh.len,
                                           sh.events)) then
                return nil, "bad SHM frame"
            end
            forward_shm(bus, b, c, frame_seq(h), rbuf:ref(), size, sh)

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


_M.HELLO_TIMEOUT = HELLO_TIMEOUT
_M.SEND_TIMEOUT = SEND_TIMEOUT
_M.consume = consume
_M.reader = reader


return _M
