-- Acknowledgements: a publisher's events are acknowledged to it once every
-- live target has received them (the watermark); on_received takes what a
-- worker confirmed off its queue.


local frame = require "resty.loom.events.frame"
local bqueue = require "resty.loom.events.broker_queue"

local ngx_now = ngx.now

local T_ACK = frame.ACK

local wake_writer = bqueue.wake_writer


local _M = { _VERSION = "0.2.0" }


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


-- The acknowledgements' watermark (see above) and the rings': events older
-- than the second are in no queue at all, a slow or down worker's included
-- (a run stays in its ring while a queue holds its SHM frame).
local function watermarks(b, slow)
    local low = b.next_bidx
    local held = low
    local now = ngx_now()
    for _, q in pairs(b.queues) do
        if not q.gone then
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
            if i then
                if i < held then
                    held = i
                end
                if i < low and q.conn and not too_slow(q, now, slow) then
                    low = i
                end
            end
        end
    end
    return low, held
end


local function send_acks(b)
    local low, held = watermarks(b, b.slow_timeout)
    -- the runs no queue holds any more leave their publishers' rings
    -- (none while a worker may hold a frame from a broker before us: a
    -- release frees everything before it)
    if not b.rings_waiting then
        for wid, runs in pairs(b.rings) do
            local stop = runs:pop_below(held)
            if stop then
                b.shm:release(wid, stop)
            end
        end
    end
    for _, q in pairs(b.queues) do
        local c = q.conn
        local last = c and c.ackq and c.ackq:pop_below(low)
        if last then
            frame.put_empty(c.ctl, T_ACK, last)
            wake_writer(q)
        end
    end
end


-- Worker wid has connected to us: it holds no frame from a broker before
-- us. Once every worker has, the runs written before we started are free.
local function connected(b, wid)
    local waiting = b.rings_waiting
    if not (waiting and waiting[wid]) then
        return
    end
    waiting[wid] = nil
    if next(waiting) ~= nil then
        return
    end
    b.rings_waiting = nil
    for w, head in pairs(b.old_heads) do
        b.shm:release(w, head)
    end
    b.old_heads = nil
    send_acks(b)
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


_M.too_slow = too_slow
_M.send_acks = send_acks
_M.on_received = on_received
_M.connected = connected


return _M
