-- A queue's writer: one per queue at a time, it sends what is queued for a
-- worker over the connection attached (or hands it to the broker worker's
-- own handlers), and keeps what it wrote until the worker acknowledges it.


local ffi = require "ffi"
local frame = require "resty.loom.events.frame"
local clear = require "table.clear"
local acks = require "resty.loom.events.broker_acks"

local ffi_string = ffi.string
local ngx_log = ngx.log
local ngx_now = ngx.now

local ERR = ngx.ERR

local WRITE_MAX = frame.WRITE_MAX

local send_acks = acks.send_acks


local _M = { _VERSION = "0.2.0" }


local function log(level, ...)
    ngx_log(level, "[loom.events] ", ...)
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


_M.release = release
_M.writer = writer


return _M
