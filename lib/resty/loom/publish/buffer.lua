-- The buffer of a publisher's accepted messages, queued and in flight: a
-- queue of batches per ordering key (each the JSON of its messages in a
-- string.buffer), its bounds and overflow, and the hand-over of batches to
-- the senders (next_batch, take, landed, settle). With a spool, a batch's
-- refs say where each message is in it; batches read back from it go
-- before their key's messages (replay_batch).


local report = require "resty.loom.publish.report"
local spoolfile = require "resty.loom.publish.spoolfile"

local buf_new = require("string.buffer").new
local report_failure = report.failure
local release = spoolfile.release
local min = math.min
local floor = math.floor
local tab_new = require "table.new"

-- A new batch starts small and grows with what it takes: every ordering
-- key has a batch of its own, and thousands of keys with a message or two
-- each must cost what they hold (the buffer cap counts only messages)
local BATCH_START_BYTES = 1024
local BATCH_START_MESSAGES = 32
local IDLE_WAIT = 2
local RECYCLE_BYTES = 2 * 1024 * 1024   -- keep batch buffers up to this
local BODY_PIECE = 64 * 1024
local GC_STEP_BYTES = 4 * 1024 * 1024     -- collector steps while draining
local BACKLOG_BYTES = 16 * 1024 * 1024    -- a buffer this big is a backlog


local _M = { _VERSION = "0.2.0" }


local function fifo_new()
    return { first = 1, last = 0 }
end


local function fifo_push(f, v)
    local last = f.last + 1
    f.last = last
    f[last] = v
end


local function fifo_pop(f)
    local first = f.first
    if first > f.last then
        return nil
    end
    local v = f[first]
    f[first] = nil
    if first == f.last then
        f.first, f.last = 1, 0
    else
        f.first = first + 1
    end
    return v
end


local function get_queue(self, key)
    local q = self.queues[key]
    if not q then
        q = {
            key = key,
            batches = fifo_new(),   -- unsent, oldest first
            open = nil,             -- the batch taking new messages
            inflight = 0,
            paused = nil,           -- ordered keys: reason after a failure
        }
        self.queues[key] = q
    end
    return q
end


local function seal(self, b)
    if not b.sealed then
        b.sealed = true
        if b.q.open == b then
            b.q.open = nil
        end
        fifo_push(self.sealed, b)
        local sema = self.sema
        if sema:count() < self.concurrency then
            sema:post(1)
        end
    end
end


-- a batch for queue q; put in it with fifo_push() or a replay's place
local function make_batch(self, q, now, refs)
    local free = self.free_bufs
    local nfree = #free
    local buf
    if nfree > 0 then
        buf = free[nfree]
        free[nfree] = nil
    else
        buf = buf_new(BATCH_START_BYTES)
    end
    local cap = min(self.batch_max_messages, BATCH_START_MESSAGES)
    return {
        q = q,
        buf = buf,
        lens = tab_new(cap, 0),
        times = tab_new(cap, 0),
        -- where each message is in the spool (always mode, replays)
        refs = refs and tab_new(cap, 0) or nil,
        head = 1,
        total = 0,          -- messages ever added (index of the last)
        n = 0,              -- live messages
        bytes = 0,          -- live encoded bytes, commas included
        t0 = now,
        sealed = false,
        dead = false,
        replay = false,     -- read back from the spool
    }
end


local function new_batch(self, q, now)
    local b = make_batch(self, q, now, self.spool_always)
    fifo_push(q.batches, b)
    q.open = b
    fifo_push(self.opening, b)
    local sema = self.sema
    if sema:count() < self.concurrency then
        sema:post(1)
    end
    return b
end


-- drops the oldest unsent message of queue q; false when there is none
local function drop_one(self, q)
    local b = q.batches[q.batches.first]
    if not b or b.n == 0 then
        return false
    end
    local h = b.head
    local len = b.lens[h]
    b.buf:skip(len)
    b.lens[h] = nil
    b.times[h] = nil
    local refs = b.refs
    if refs and refs[h] then
        release(self.spool, refs[h])
        refs[h] = nil
    end
    b.head = h + 1
    b.n = b.n - 1
    b.bytes = b.bytes - len
    self.queued_messages = self.queued_messages - 1
    self.queued_bytes = self.queued_bytes - len
    self.dropped = self.dropped + 1
    if b.n == 0 then
        b.dead = true
        fifo_pop(q.batches)
        if q.open == b then
            q.open = nil
        end
    end
    return true
end


-- The batch that takes the next message of ordering key `key`, len
-- encoded bytes, when the buffer's bounds allow it (with overflow
-- "drop_oldest", after dropping the key's oldest messages); or nil and
-- "ordering key paused" or "buffer full". The caller writes the message
-- into the batch's buf, then calls added().
function _M.batch_for(self, key, len, now)
    local q = self.queues[key]
    if q and q.paused then
        return nil, "ordering key paused"
    end

    -- buffer bounds: everything not yet acknowledged counts (and, in
    -- the spool's always mode, its bytes: records of about len + #key)
    local msgs = self.queued_messages + self.inflight_messages + 1
    local bytes = self.queued_bytes + self.inflight_bytes + len
    local sp = self.spool_always
    local extra = len + #key + 20
    if msgs > self.buffer_max_messages or bytes > self.buffer_max_bytes
       or (sp and sp.bytes + extra > sp.max)
    then
        if self.overflow ~= "drop_oldest" then
            self.rejected = self.rejected + 1
            return nil, "buffer full"
        end
        q = q or get_queue(self, key)
        repeat
            if not drop_one(self, q) then
                self.rejected = self.rejected + 1
                return nil, "buffer full"
            end
            msgs = self.queued_messages + self.inflight_messages + 1
            bytes = self.queued_bytes + self.inflight_bytes + len
        until msgs <= self.buffer_max_messages
              and bytes <= self.buffer_max_bytes
              and not (sp and sp.bytes + extra > sp.max)
    end

    q = q or get_queue(self, key)
    local b = q.open
    if b and (b.n >= self.batch_max_messages
              or b.bytes + len > self.batch_max_bytes)
    then
        seal(self, b)
        b = nil
    end
    if not b then
        b = new_batch(self, q, now)
    end
    return b
end


-- counts the message of len bytes just written into batch b
function _M.added(self, b, len, now)
    local total = b.total + 1
    b.total = total
    b.lens[total] = len
    b.times[total] = now
    b.n = b.n + 1
    b.bytes = b.bytes + len
    self.queued_messages = self.queued_messages + 1
    self.queued_bytes = self.queued_bytes + len
    if b.n >= self.batch_max_messages or b.bytes >= self.batch_max_bytes then
        seal(self, b)
    end
end


-- seals every open batch so senders take them now
function _M.flush(self)
    local opening = self.opening
    while opening.first <= opening.last do
        local b = fifo_pop(opening)
        if not b.sealed and not b.dead then
            seal(self, b)
        end
    end
end


-- The next batch a sender may take (for an ordering key, while none of
-- its batches is in flight), after sealing the open batches whose delay
-- is up (all of them when exiting); or nil and how long to wait.
function _M.next_batch(self, now, exiting)
    local delay = self.batch_max_delay
    local opening = self.opening
    local wait = IDLE_WAIT
    while opening.first <= opening.last do
        local b = opening[opening.first]
        if b.sealed or b.dead then
            fifo_pop(opening)
        elseif exiting or b.t0 + delay <= now then
            fifo_pop(opening)
            seal(self, b)
        else
            wait = min(b.t0 + delay - now, IDLE_WAIT)
            break
        end
    end
    local sealed = self.sealed
    for i = sealed.first, sealed.last do
        local b = sealed[i]
        if b and not b.dead then
            local q = b.q
            if (q.key == "" or q.inflight == 0) and not q.paused
               and q.batches[q.batches.first] == b
            then
                sealed[i] = false
                while sealed.first <= sealed.last
                      and not sealed[sealed.first]
                do
                    fifo_pop(sealed)
                end
                return b
            end
        elseif i == sealed.first then
            sealed[i] = false
        end
    end
    while sealed.first <= sealed.last and not sealed[sealed.first] do
        fifo_pop(sealed)
    end
    return nil, wait
end


-- reports every batch still queued on q as failed with reason, and
-- forgets them; returns how many messages that was
local function fail_queued(self, q, reason)
    local n = 0
    while true do
        local b = fifo_pop(q.batches)
        if not b then
            break
        end
        b.dead = true
        if b.n > 0 then
            n = n + b.n
            self.queued_messages = self.queued_messages - b.n
            self.queued_bytes = self.queued_bytes - b.bytes
            -- reported: out of the spool
            local refs = b.refs
            if refs then
                for i = b.head, b.total do
                    if refs[i] then
                        release(self.spool, refs[i])
                    end
                end
            end
            b.buf:skip(1)
            report_failure(self, q, '{"messages":['
                           .. b.buf:tostring() .. ']}', b.n, reason, 0, nil)
        end
    end
    q.open = nil
    return n
end


-- Takes batch b (from next_batch()) out of its queue to be sent: its
-- messages count as in flight until landed(). Returns the request body,
-- in pieces; the batch's string.buffer goes back to the free list.
function _M.take(self, b)
    local q = b.q
    fifo_pop(q.batches)
    local n, bytes = b.n, b.bytes
    if self.queued_bytes + self.inflight_bytes >= BACKLOG_BYTES then
        self.backlog = true
    end
    self.queued_messages = self.queued_messages - n
    self.queued_bytes = self.queued_bytes - bytes
    self.inflight_messages = self.inflight_messages + n
    self.inflight_bytes = self.inflight_bytes + bytes
    self.inflight = self.inflight + 1
    q.inflight = q.inflight + 1
    self.batches = self.batches + 1
    self.batched_messages = self.batched_messages + n

    local buf = b.buf
    buf:skip(1)     -- the first message's leading comma
    -- the body as pieces below LuaJIT's mmap threshold: one string of a
    -- megabyte would be mapped, faulted in and unmapped for every batch
    local body = { '{"messages":[' }
    while #buf > 0 do
        body[#body + 1] = buf:get(BODY_PIECE)
    end
    body[#body + 1] = ']}'
    b.buf = nil
    b.body = body       -- reported by exit_worker() if the worker stops
    self.sending[b] = true
    buf:reset()
    local free = self.free_bufs
    if bytes <= RECYCLE_BYTES and #free < self.concurrency + 2 then
        free[#free + 1] = buf
    else
        buf:free()
    end
    return body
end


-- batch b is back from its sender, delivered or not: no longer in flight
function _M.landed(self, b)
    local q = b.q
    local n, bytes = b.n, b.bytes
    self.inflight_messages = self.inflight_messages - n
    self.inflight_bytes = self.inflight_bytes - bytes
    self.inflight = self.inflight - 1
    q.inflight = q.inflight - 1
    self.sending[b] = nil
    b.body = nil
end


-- Ordered delivery: after a batch of ordering key queue q failed for good,
-- later messages of the key would overtake the failed ones. Its queued
-- messages are reported failed, and send() refuses the key until resume().
function _M.pause(self, q, reason)
    q.paused = reason
    fail_queued(self, q, "ordering key paused")
end


-- lets the ordering key that failed take messages again
function _M.resume(self, key)
    local q = self.queues[key]
    if q and q.paused then
        q.paused = nil
        if q.inflight == 0 and q.batches.first > q.batches.last then
            self.queues[q.key] = nil
        end
    end
end


-- After a batch of queue q, bytes long, has landed and its outcome is
-- told: forgets an ordering key's queue with nothing left, lets the
-- collector catch up after a backlog, and wakes a sender.
function _M.settle(self, q, bytes)
    if q.key ~= "" and not q.paused and q.inflight == 0
       and q.batches.first > q.batches.last
    then
        self.queues[q.key] = nil
    end
    -- The body pieces are garbage now (the sender dropped them). After a
    -- backlog the collector's threshold sits at about twice the peak
    -- buffer, and a worker that goes idle never reaches it: while draining
    -- one, pay for what was made, so that memory follows the buffer down.
    -- (Without a backlog the collector's own pace is fine, and costs
    -- nothing extra.)
    if self.backlog then
        local garbage = self.garbage + bytes
        local empty = self.queued_bytes + self.inflight_bytes == 0
        if garbage >= GC_STEP_BYTES or empty then
            collectgarbage("step", floor(garbage / 1024) + 1)
            garbage = 0
            if empty then
                self.backlog = false
                -- the recycled buffers grew with the backlog
                local free = self.free_bufs
                for i = #free, 1, -1 do
                    free[i]:free()
                    free[i] = nil
                end
            end
        end
        self.garbage = garbage
    end
    local sema = self.sema
    if sema:count() < self.concurrency then
        sema:post(1)
    end
end


-- A batch for messages of ordering key `key` read back from the spool:
-- it goes after the key's earlier replays and before its other batches
-- (sent or not, its messages are older). Filled with replayed(), then
-- sealed.
function _M.replay_batch(self, key, now)
    local q = get_queue(self, key)
    local b = make_batch(self, q, now, true)
    b.replay = true
    local f = q.batches
    local at = f.first
    while at <= f.last and f[at].replay do
        at = at + 1
    end
    for i = f.last, at, -1 do
        f[i + 1] = f[i]
    end
    f[at] = b
    f.last = f.last + 1
    return b
end


-- counts the message of len bytes (its leading comma included) just
-- written into replay batch b, from spool record ref
function _M.replayed(self, b, len, now, ref)
    local total = b.total + 1
    b.total = total
    b.lens[total] = len
    b.times[total] = now
    b.refs[total] = ref
    b.n = b.n + 1
    b.bytes = b.bytes + len
    self.queued_messages = self.queued_messages + 1
    self.queued_bytes = self.queued_bytes + len
end


_M.fifo_new = fifo_new
_M.fail_queued = fail_queued
_M.seal = seal


return _M
