-- The buffer of accepted messages of one publisher: a queue of batches per
-- ordering key (each batch the JSON of its messages in a string.buffer),
-- which batch is open, sealed or next for a sender, what overflow drops,
-- and how queued batches are given up.


local report = require "resty.loom.publish.report"

local ngx_now = ngx.now
local worker_exiting = ngx.worker.exiting
local buf_new = require("string.buffer").new
local report_failure = report.failure
local min = math.min
local tab_new = require "table.new"

-- A new batch starts small and grows with what it takes: every ordering
-- key has a batch of its own, and thousands of keys with a message or two
-- each must cost what they hold (the buffer cap counts only messages)
local BATCH_START_BYTES = 1024
local BATCH_START_MESSAGES = 32
local IDLE_WAIT = 2


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


local function new_batch(self, q, now)
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
    local b = {
        q = q,
        buf = buf,
        lens = tab_new(cap, 0),
        times = tab_new(cap, 0),
        head = 1,
        total = 0,          -- messages ever added (index of the last)
        n = 0,              -- live messages
        bytes = 0,          -- live encoded bytes, commas included
        t0 = now,
        sealed = false,
        dead = false,
    }
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


-- the next batch a sender may take, or nil and how long to wait
local function next_batch(self)
    local now = ngx_now()
    local delay = self.batch_max_delay
    if not self.exiting and worker_exiting() then
        self.exiting = true
        self.exit_deadline = now + self.flush_timeout
    end
    local exiting = self.exiting
    if exiting and now >= self.exit_deadline then
        return nil, 0
    end
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
            b.buf:skip(1)
            report_failure(self, q, '{"messages":['
                           .. b.buf:tostring() .. ']}', b.n, reason, 0, nil)
        end
    end
    q.open = nil
    return n
end


_M.fifo_new = fifo_new
_M.fifo_pop = fifo_pop
_M.get_queue = get_queue
_M.seal = seal
_M.new_batch = new_batch
_M.drop_one = drop_one
_M.next_batch = next_batch
_M.fail_queued = fail_queued


return _M
