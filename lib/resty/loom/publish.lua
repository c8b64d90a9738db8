-- Batched, non-blocking publishing to Google Cloud Pub/Sub.
--
-- send() validates a message against Pub/Sub's limits, encodes it straight
-- into the current batch's string.buffer (base64 written through the FFI:
-- no payload strings are created) and returns; it never yields.
-- Per worker and topic, batches are cut by count, bytes or delay, one batch
-- per ordering key at a time; a pool of light threads in one timer sends
-- them over keep-alive connections, retrying transient failures with
-- backoff and jitter until a deadline. On worker exit (QUIT, HUP reload) the
-- buffer is flushed within a time budget and whatever is left is reported.


local buffer = require "string.buffer"
local cjson = require "cjson.safe"
local semaphore = require "ngx.semaphore"
local http = require "resty.loom.http"
local auth = require "resty.loom.publish.auth"
local histogram = require "resty.loom.histogram"
local base64 = require "resty.loom.publish.base64"
local json = require "resty.loom.publish.json"
local at_close = require "resty.loom.at_close"
local error_handler = require("resty.loom.error_handler").handler

local ngx_now = ngx.now
local ngx_update_time = ngx.update_time
local ngx_sleep = ngx.sleep
local ngx_log = ngx.log
local ngx_ERR = ngx.ERR
local ngx_WARN = ngx.WARN
local ngx_NOTICE = ngx.NOTICE
local timer_at = ngx.timer.at
local thread_spawn = ngx.thread.spawn
local thread_wait = ngx.thread.wait
local worker_exiting = ngx.worker.exiting
local decode_base64 = ngx.decode_base64
local json_decode = cjson.decode
local buf_new = buffer.new
local b64_into = base64.encode_into
local put_string = json.put_string
local sub = string.sub
local match = string.match
local tostring = tostring
local ipairs = ipairs
local floor = math.floor
local random = math.random
local min = math.min
local type = type
local pairs = pairs
local next = next
local xpcall = xpcall
local error = error
local setmetatable = setmetatable
local pcall = pcall
local concat = table.concat
local tab_new = require "table.new"

local LOG_TAG = "[loom.publish] "
local MAX_MESSAGES = 1000             -- per publish request
local MAX_REQUEST_BYTES = 10000000    -- JSON body, per request
local MAX_ATTRIBUTES = 100
local MAX_KEY_BYTES = 256
local MAX_VALUE_BYTES = 1024
local MAX_ORDERING_KEY_BYTES = 1024
local ENVELOPE = #'{"messages":[]}'
local RECYCLE_BYTES = 2 * 1024 * 1024   -- keep batch buffers up to this
local BODY_PIECE = 64 * 1024
-- A new batch starts small and grows with what it takes: every ordering
-- key has a batch of its own, and thousands of keys with a message or two
-- each must cost what they hold (the buffer cap counts only messages)
local BATCH_START_BYTES = 1024
local BATCH_START_MESSAGES = 32
local IDLE_WAIT = 2
local EXIT_WATCH = 3600
local GC_STEP_BYTES = 4 * 1024 * 1024     -- collector steps while draining
local BACKLOG_BYTES = 16 * 1024 * 1024    -- a buffer this big is a backlog
-- Every new connection takes about 1.5 KB (the cosocket's state, the
-- light thread that resolves a name) from the pool of the timer the
-- senders run in, given back only when that timer ends: the senders move
-- to a fresh timer after this many requests.
local RECYCLE_REQUESTS = 1000

-- canonical statuses worth retrying (the body's error.status)
local RETRY_STATUS = {
    UNAVAILABLE = true, DEADLINE_EXCEEDED = true, RESOURCE_EXHAUSTED = true,
    INTERNAL = true, ABORTED = true, UNKNOWN = true, CANCELLED = true,
}
-- HTTP codes worth retrying, whatever the body says
local RETRY_HTTP = {
    [408] = true, [429] = true, [499] = true, [500] = true, [502] = true,
    [503] = true, [504] = true,
}

-- every publisher of this worker by name, for the stats collector
local publishers = {}
-- every publisher of this worker that may hold messages, for exit_worker()
local living = setmetatable({}, { __mode = "k" })
local collector_registered = false


local _M = { _VERSION = "0.2.0" }
local mt = { __index = _M }


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


local function start(self)
    if self.running then
        return true
    end
    local ok, err = timer_at(0, self.run_fn, self)
    if not ok then
        return nil, err
    end
    ok, err = timer_at(EXIT_WATCH, self.exit_fn, self)
    if not ok then
        ngx_log(ngx_WARN, LOG_TAG, "failed to arm the exit watcher: ", err)
    end
    self.running = true
    return true
end


-- Encodes the attribute after key k of t (the first for k == nil) into s,
-- as the count-th one. Returns its key; nil when there is none left, or
-- nil and why the attribute is refused.
local function put_next_attribute(s, t, k, count)
    local v
    k, v = next(t, k)
    if k == nil then
        return nil
    end
    if count > MAX_ATTRIBUTES then
        return nil, "too many attributes"
    end
    if type(k) ~= "string" then
        return nil, "attribute key must be a string"
    end
    local klen = #k
    if klen == 0 or klen > MAX_KEY_BYTES then
        return nil, "attribute key must be 1 to 256 bytes"
    end
    if sub(k, 1, 4) == "goog" then
        return nil, "attribute key must not start with goog"
    end
    if type(v) ~= "string" then
        return nil, "attribute value must be a string"
    end
    if #v > MAX_VALUE_BYTES then
        return nil, "attribute value too long"
    end
    s:put(count == 1 and '"attributes":{' or ',')
    if not put_string(s, k) then
        return nil, "attribute key must be valid UTF-8"
    end
    s:put(':')
    if not put_string(s, v) then
        return nil, "attribute value must be valid UTF-8"
    end
    return k
end


-- ok, err = p:send(data, attributes?, ordering_key?)
-- Never yields. err: a validation message, "buffer full",
-- "ordering key paused" or "closed".
function _M.send(self, data, attributes, ordering_key)
    if type(data) ~= "string" then
        if data ~= nil then
            return nil, "data must be a string"
        end
        data = ""
    end
    local dlen = #data
    if dlen > MAX_REQUEST_BYTES then
        return nil, "message too large"
    end
    local key = ""
    if ordering_key ~= nil then
        if type(ordering_key) ~= "string" then
            return nil, "ordering key must be a string"
        end
        if #ordering_key > MAX_ORDERING_KEY_BYTES then
            return nil, "ordering key too long"
        end
        key = ordering_key
    end
    if self.closed then
        return nil, "closed"
    end

    -- the message before and after its data goes to two small buffers
    -- first: the data is base64-encoded straight into the batch once the
    -- message is known to be valid and where it goes
    local s = self.scratch
    s:reset()
    s:put(',{')
    local comma = ""
    if attributes ~= nil then
        if type(attributes) ~= "table" then
            return nil, "attributes must be a table"
        end
        -- the first four attributes without a loop: LuaJIT aborts a trace
        -- that meets an inner loop, so a loop would leave send() and its
        -- caller interpreted up to it (more attributes still take it)
        local k, err = put_next_attribute(s, attributes, nil, 1)
        if k ~= nil then
            k, err = put_next_attribute(s, attributes, k, 2)
        end
        if k ~= nil then
            k, err = put_next_attribute(s, attributes, k, 3)
        end
        if k ~= nil then
            k, err = put_next_attribute(s, attributes, k, 4)
        end
        local count = 4
        while k ~= nil do
            count = count + 1
            k, err = put_next_attribute(s, attributes, k, count)
        end
        if err then
            return nil, err
        end
        if #s > 2 then          -- more than the leading ',{'
            s:put('}')
            comma = ","
        end
    end
    -- the data is encoded last: with more than four attributes, only what
    -- follows their loop is compiled (as the loop's side trace)
    local b64len = 0
    local tail = self.scratch_tail
    tail:reset()
    if dlen > 0 then
        s:put(comma, '"data":"')
        b64len = floor((dlen + 2) / 3) * 4
        tail:put('"')
        comma = ","
    end
    if comma == "" then
        return nil, "message needs data or attributes"
    end
    if key ~= "" then
        tail:put(',"orderingKey":')
        if not put_string(tail, key) then
            return nil, "ordering key must be valid UTF-8"
        end
    end
    tail:put('}')
    local len = #s + b64len + #tail
    if len - 1 + ENVELOPE > MAX_REQUEST_BYTES then
        return nil, "message too large"
    end

    local q = self.queues[key]
    if q and q.paused then
        return nil, "ordering key paused"
    end

    -- buffer bounds: everything not yet acknowledged counts
    local msgs = self.queued_messages + self.inflight_messages + 1
    local bytes = self.queued_bytes + self.inflight_bytes + len
    if msgs > self.buffer_max_messages or bytes > self.buffer_max_bytes then
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
    end

    q = q or get_queue(self, key)
    local now = ngx_now()
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
    local out = b.buf
    out:put(s)
    if b64len > 0 then
        out:commit(b64_into(out:reserve(b64len), data, dlen))
    end
    out:put(tail)
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
    if not self.running then
        local ok, err = start(self)
        if not ok then
            ngx_log(ngx_ERR, LOG_TAG, "failed to start the sender: ", err)
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


local function call(self, fn, ...)
    local ok, err = xpcall(fn, error_handler, ...)
    if not ok then
        ngx_log(ngx_ERR, LOG_TAG, self.name, ": callback failed: ", err)
    end
end


-- the messages of a request body, for the error callback
local function decode_messages(body)
    local t = json_decode(body)
    local msgs = type(t) == "table" and t.messages or {}
    for i = 1, #msgs do
        local m = msgs[i]
        m.data = m.data and decode_base64(m.data) or ""
        m.ordering_key = m.orderingKey
        m.orderingKey = nil
    end
    return msgs
end


local function report_failure(self, q, body, n, reason, attempts, status)
    self.failed = self.failed + n
    if type(body) == "table" then
        body = concat(body)
    end
    if self.on_error then
        call(self, self.on_error, decode_messages(body), reason, {
            topic = self.topic, ordering_key = q.key ~= "" and q.key or nil,
            attempts = attempts, status = status,
        })
    else
        ngx_log(ngx_ERR, LOG_TAG, self.name, ": ", n,
                " messages not delivered: ", reason)
    end
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


-- classifies a response: "ok", "retry", "auth" or "fatal", and a reason
local function classify_response(res)
    local status = res.status
    if status >= 200 and status < 300 then
        return "ok"
    end
    local body = json_decode(res.body)
    local err = type(body) == "table" and body.error
    local canon = type(err) == "table" and err.status
    local msg = type(err) == "table" and err.message
    local reason = "status " .. status
    if type(canon) == "string" then
        reason = reason .. " " .. canon
    end
    if type(msg) == "string" then
        reason = reason .. ": " .. msg
    elseif type(body) ~= "table" and #res.body > 0 then
        reason = reason .. ": " .. sub(res.body, 1, 200)
    end
    if status == 401 or canon == "UNAUTHENTICATED" then
        return "auth", reason
    end
    -- either saying "retry" is enough: a proxy's 502 or 503 may carry a
    -- status word Pub/Sub never sends, and giving up would lose the batch
    if RETRY_HTTP[status] or RETRY_STATUS[canon] then
        return "retry", reason
    end
    return "fatal", reason
end


-- the kind of a failure, as counted in warnings: "status 503",
-- "failed to connect", ...
local function failure_kind(reason)
    return match(reason, "^status %d+") or match(reason, "^[^:(]+")
end


local function trouble_summary(t)
    local kinds = {}
    for k, c in pairs(t.kinds) do
        kinds[#kinds + 1] = k .. ": " .. c
    end
    return concat({ t.attempts, " failed attempts (", concat(kinds, ", "),
                    "), ", t.lost, " messages given up; last: ", t.last })
end


-- Logs trouble without flooding: the first failure after a quiet time at
-- once, then one summary with counts per warn_interval while failures go
-- on. lost: messages given up by this failure (0: it will be retried).
local function note_trouble(self, reason, lost)
    local now = ngx_now()
    local t = self.trouble
    if not t then
        self.trouble = {
            since = now, next_at = now + self.warn_interval,
            attempts = 0, lost = 0, kinds = {}, last = reason,
        }
        ngx_log(ngx_WARN, LOG_TAG, self.name, ": publish failed: ", reason,
                lost > 0 and (" (" .. lost .. " messages given up)")
                or " (retrying)")
        return
    end
    local kind = failure_kind(reason)
    t.attempts = t.attempts + 1
    t.lost = t.lost + lost
    t.kinds[kind] = (t.kinds[kind] or 0) + 1
    t.last = reason
    if now >= t.next_at then
        ngx_log(ngx_WARN, LOG_TAG, self.name, ": publish failing for ",
                floor(now - t.since), " s; in the last ",
                self.warn_interval, " s: ", trouble_summary(t))
        t.next_at = now + self.warn_interval
        t.attempts, t.lost, t.kinds = 0, 0, {}
    end
end


local function note_recovery(self)
    local t = self.trouble
    self.trouble = nil
    ngx_log(ngx_WARN, LOG_TAG, self.name, ": publish recovered after ",
            floor(ngx_now() - t.since), " s",
            t.attempts > 0 and ("; since the last warning: "
                                .. trouble_summary(t)) or "")
end


local function dispatch(self, b)
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

    local first = ngx_now()
    local deadline = first + self.retry_deadline
    local backoff = self.retry_initial
    local attempts = 0
    local refreshed = false
    local outcome, reason, res, status
    while true do
        attempts = attempts + 1
        local hard = self.exiting and self.exit_deadline
        if hard and hard < deadline then
            deadline = hard
        end
        -- no request runs past the deadline (the exit budget at exit)
        ngx_update_time()
        local left = deadline - ngx_now()
        local cok, tok, err, permanent = pcall(self.cred.get, self.cred,
                                               min(10, left))
        if not cok then
            tok, err, permanent = nil, "failed to get token: "
                                       .. tostring(tok), false
        end
        if self.cred.kind ~= "none" and not tok then
            outcome, reason = permanent and "fatal" or "retry", err
        elseif left <= 0.001 then
            outcome, reason = "retry", "timeout"
        else
            local headers = self.headers
            if tok then
                headers = headers .. "Authorization: Bearer " .. tok .. "\r\n"
            end
            self.requests = self.requests + 1
            local rok
            rok, res, err, permanent = pcall(self.client.request,
                                             self.client, "POST", self.path,
                                             headers, body,
                                             min(self.timeout, left))
            if not rok then
                res, err, permanent = nil, "failed to send: "
                                           .. tostring(res), false
            end
            if not res then
                outcome, reason, status = permanent and "fatal" or "retry",
                                          err, nil
            else
                status = res.status
                outcome, reason = classify_response(res)
                if outcome == "auth" then
                    if refreshed then
                        outcome = "fatal"
                    else
                        refreshed = true
                        self.cred:invalidate(tok)
                    end
                end
            end
        end
        if outcome == "ok" or outcome == "fatal" then
            break
        end
        ngx_update_time()
        local now = ngx_now()
        if outcome == "retry" then
            local sleep = backoff * (0.5 + random() * 0.5)
            if now + sleep >= deadline then
                reason = reason .. " (retry deadline reached after "
                         .. attempts .. " attempts)"
                break
            end
            note_trouble(self, reason, 0)
            self.retried = self.retried + 1
            ngx_sleep(sleep)
            backoff = min(backoff * 2, self.retry_max_backoff)
        else
            -- 401: retry at once with a fresh token
            self.retried = self.retried + 1
            if now >= deadline then
                break
            end
        end
    end

    ngx_update_time()
    local now = ngx_now()
    self.inflight_messages = self.inflight_messages - n
    self.inflight_bytes = self.inflight_bytes - bytes
    self.inflight = self.inflight - 1
    q.inflight = q.inflight - 1
    self.sending[b] = nil
    b.body = nil

    if outcome == "ok" then
        if self.trouble then
            note_recovery(self)
        end
        self.sent = self.sent + n
        local hist = self.latency
        local times = b.times
        for i = b.head, b.total do
            hist:record(now - times[i])
        end
        if self.on_success then
            local t = json_decode(res.body)
            local ids = type(t) == "table" and t.messageIds or {}
            call(self, self.on_success, ids, {
                topic = self.topic,
                ordering_key = q.key ~= "" and q.key or nil,
                attempts = attempts,
            })
        end

    else
        note_trouble(self, reason, n)
        report_failure(self, q, body, n, reason, attempts, status)
        if q.key ~= "" and not self.exiting then
            -- ordered delivery: later messages of this key would overtake
            -- the failed ones, so the key stops until p:resume(key)
            q.paused = reason
            fail_queued(self, q, "ordering key paused")
        end
    end
    if q.key ~= "" and not q.paused and q.inflight == 0
       and q.batches.first > q.batches.last
    then
        self.queues[q.key] = nil
    end
    -- The body pieces are garbage now. After a backlog the collector's
    -- threshold sits at about twice the peak buffer, and a worker that
    -- goes idle never reaches it: while draining one, pay for what was
    -- made, so that memory follows the buffer down. (Without a backlog the
    -- collector's own pace is fine, and costs nothing extra.)
    if self.backlog then
        body = nil      -- luacheck: ignore
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


-- reports and forgets everything still buffered (exit budget spent)
local function abandon(self)
    local lost = 0
    for _, q in pairs(self.queues) do
        lost = lost + fail_queued(self, q,
                                  "worker exiting: flush budget spent")
    end
    return lost
end


-- Reports and forgets everything this publisher still holds, queued or in
-- flight. For exit_worker(): nothing can be sent any more.
local function report_at_exit(self)
    local queued, unconfirmed = 0, 0
    for _, q in pairs(self.queues) do
        queued = queued + fail_queued(self, q, "worker exiting: not sent")
    end
    for b in pairs(self.sending) do
        self.sending[b] = nil
        unconfirmed = unconfirmed + b.n
        self.inflight_messages = self.inflight_messages - b.n
        self.inflight_bytes = self.inflight_bytes - b.bytes
        report_failure(self, b.q, b.body, b.n,
                       "worker exiting: sent, delivery not confirmed", 0, nil)
        b.body = nil
    end
    self.closed = true
    if queued + unconfirmed > 0 then
        ngx_log(ngx_ERR, LOG_TAG, self.name, ": ", queued + unconfirmed,
                " messages not delivered at worker exit (", queued,
                " not sent, ", unconfirmed, " sent but not confirmed)")
    end
end


local function sender(self)
    while true do
        local ok, err = xpcall(function()
            while true do
                if self.recycling then
                    return
                end
                local b, wait = next_batch(self)
                if b then
                    dispatch(self, b)
                    if self.requests >= self.recycle_at
                       and not self.exiting
                    then
                        self.recycling = true
                        self.sema:post(self.concurrency)
                        return
                    end
                else
                    if self.exiting then
                        if self.queued_messages == 0 then
                            return
                        end
                        ngx_update_time()
                        if ngx_now() >= self.exit_deadline then
                            return
                        end
                        wait = min(wait, 0.05)
                    end
                    self.sema:wait(wait)
                    ngx_update_time()
                end
            end
        end, error_handler)
        if ok then
            return
        end
        ngx_log(ngx_ERR, LOG_TAG, self.name, ": sender failed: ", err)
        ngx_sleep(0.1)
    end
end


local function run(premature, self)
    if premature then
        -- a worker that exits before the first run: flush what we have
        self.exiting = true
        self.exit_deadline = ngx_now() + self.flush_timeout
    end
    while true do
        self.recycle_at = self.requests + RECYCLE_REQUESTS
        local threads = {}
        for i = 1, self.concurrency do
            local t, err = thread_spawn(sender, self)
            if not t then
                ngx_log(ngx_ERR, LOG_TAG, "failed to spawn sender: ", err)
                break
            end
            threads[i] = t
        end
        for i = 1, #threads do
            thread_wait(threads[i])
        end
        if not self.recycling then
            break
        end
        self.recycling = false
        -- (an exiting worker starts no timer: go on in this one)
        if not self.exiting and timer_at(0, self.run_fn, self) then
            return
        end
    end
    if self.exiting then
        local left = self.queued_messages
        if left > 0 then
            left = abandon(self)
            ngx_log(ngx_ERR, LOG_TAG, self.name, ": ", left,
                    " messages not delivered at worker exit")
        end
        self.closed = true
        ngx_log(ngx_NOTICE, LOG_TAG, self.name, ": flushed at exit: sent ",
                self.sent, ", failed ", self.failed, ", dropped ",
                self.dropped)
    else
        self.running = false
    end
end


local function poke(_, self)
    self.sema:post(self.concurrency)
end


local function exit_watch(premature, self)
    if not premature then
        local ok = timer_at(EXIT_WATCH, self.exit_fn, self)
        if ok then
            return
        end
    end
    if not self.exiting then
        self.exiting = true
        ngx_update_time()
        self.exit_deadline = ngx_now() + self.flush_timeout
        -- a post made here is only seen after the event loop's next wait;
        -- a 0-delay timer posts from a context whose events run at once
        if not timer_at(0, poke, self) then
            self.sema:post(self.concurrency)
        end
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
    return true
end


-- lets an ordering key that failed take messages again
function _M.resume(self, ordering_key)
    local q = self.queues[ordering_key or ""]
    if q and q.paused then
        q.paused = nil
        if q.inflight == 0 and q.batches.first > q.batches.last then
            self.queues[q.key] = nil
        end
    end
    return true
end


local function export(self)
    local lat = self.latency
    local buckets = {}
    local nb = 0
    for i = 0, 255 do
        local c = lat.buckets[i]
        if c > 0 then
            nb = nb + 1
            buckets[nb] = { i, tonumber(c) }
        end
    end
    local st = self:stats()
    st.latency_buckets = buckets
    st.latency_sum = lat.sum
    st.latency_min = lat.min
    st.latency_max = lat.max
    return st
end


-- this worker's figures
function _M.stats(self)
    return {
        name = self.name,
        topic = self.topic,
        buffered_messages = self.queued_messages + self.inflight_messages,
        buffered_bytes = self.queued_bytes + self.inflight_bytes,
        queued_messages = self.queued_messages,
        in_flight = self.inflight,
        in_flight_messages = self.inflight_messages,
        sent = self.sent,
        failed = self.failed,
        retried = self.retried,
        dropped = self.dropped,
        rejected = self.rejected,
        batches = self.batches,
        mean_batch_size = self.batches > 0
                          and self.batched_messages / self.batches or 0,
        http_requests = self.requests,
        connections = self.client.connects,
        latency = self.latency:summary(),
        token_refreshes = self.cred:refresh_count(),
    }
end


local SUM_FIELDS = {
    "buffered_messages", "buffered_bytes", "queued_messages", "in_flight",
    "in_flight_messages", "sent", "failed", "retried", "dropped",
    "rejected", "batches", "http_requests", "connections",
}


-- merges exported per-worker figures of one publisher
local function merge(list)
    local total = {}
    for _, f in ipairs(SUM_FIELDS) do
        total[f] = 0
    end
    local hist = histogram.new()
    local batched = 0
    local refreshes = 0
    for _, st in ipairs(list) do
        total.name, total.topic = st.name, st.topic
        for _, f in ipairs(SUM_FIELDS) do
            total[f] = total[f] + (tonumber(st[f]) or 0)
        end
        batched = batched + (st.mean_batch_size or 0) * (st.batches or 0)
        refreshes = math.max(refreshes, st.token_refreshes or 0)
        for _, pair in ipairs(st.latency_buckets or {}) do
            hist.buckets[pair[1]] = hist.buckets[pair[1]] + pair[2]
            hist.count = hist.count + pair[2]
        end
        hist.sum = hist.sum + (st.latency_sum or 0)
        if st.latency_max and st.latency_max > hist.max then
            hist.max = st.latency_max
        end
        if st.latency_min and (not hist.min or st.latency_min < hist.min) then
            hist.min = st.latency_min
        end
    end
    total.mean_batch_size = total.batches > 0 and batched / total.batches
                            or 0
    total.latency = hist:summary()
    total.token_refreshes = refreshes
    return total
end


local function collect_local()
    local out = {}
    for name, p in pairs(publishers) do
        out[name] = export(p)
    end
    return out
end


-- all = publish.stats_all(timeout): per publisher name, the figures of all
-- live workers merged (or of this worker when no events bus exists), plus
-- .workers (how many answered)
function _M.stats_all(timeout)
    local per_worker
    local ok, events = pcall(require, "resty.loom.events")
    local bus = ok and type(events) == "table" and events.get
                and events.get()
    if bus and collector_registered then
        local res, err = bus:collect("loom.publish", timeout or 1)
        if res then
            per_worker = res
        else
            ngx_log(ngx_WARN, LOG_TAG, "collect failed: ", err)
        end
    end
    if not per_worker then
        per_worker = { [ngx.worker.id() or 0] = collect_local() }
    end
    local by_name = {}
    local workers = 0
    for _, pubs in pairs(per_worker) do
        workers = workers + 1
        if type(pubs) ~= "table" then
            pubs = {}
        end
        for name, st in pairs(pubs) do
            local l = by_name[name]
            if not l then
                l = {}
                by_name[name] = l
            end
            l[#l + 1] = st
        end
    end
    local out = { workers = workers, publishers = {} }
    for name, l in pairs(by_name) do
        out.publishers[name] = merge(l)
    end
    return out
end


local function register_collector()
    if collector_registered then
        return
    end
    local ok, events = pcall(require, "resty.loom.events")
    if ok and type(events) == "table" and events.register_collector then
        local rok, err = pcall(events.register_collector, "loom.publish",
                               collect_local)
        if rok then
            collector_registered = true
        else
            ngx_log(ngx_WARN, LOG_TAG, "no stats collector: ", err)
        end
    end
end


-- At VM close (see resty.loom.at_close): what every publisher still holds
-- then is exactly what no report covered (publish.exit_worker() not
-- called, or worker_shutdown_timeout cut the drain).
local function unreported_at_close()
    local n = 0
    local names = {}
    for p in pairs(living) do
        local held = p.queued_messages + p.inflight_messages
        if held > 0 then
            n = n + held
            names[#names + 1] = p.name
        end
    end
    if n > 0 then
        return "error", concat({
            LOG_TAG, n, " messages lost at worker exit without a report (",
            concat(names, ", "), "): call ",
            "require(\"resty.loom.publish\").exit_worker() in ",
            "exit_worker_by_lua_block" })
    end
end


-- every option new() takes
local OPTIONS = {
    project = true, topic = true, credentials = true, endpoint = true,
    emulator_host = true, ssl_verify = true, server_name = true,
    batch_max_messages = true, batch_max_bytes = true,
    batch_max_delay = true, buffer_max_messages = true,
    buffer_max_bytes = true, overflow = true, concurrency = true,
    timeout = true, retry_deadline = true, retry_initial_backoff = true,
    retry_max_backoff = true, flush_timeout = true, warn_interval = true,
    on_success = true, on_error = true, user_project = true, name = true,
}
local MAX_SECONDS = 86400


-- a number option: finite, above 0, at most hi, whole when integer
local function num(opts, name, default, hi, integer)
    local v = opts[name]
    if v == nil then
        return default
    end
    if type(v) ~= "number" or not (v > 0 and v <= hi)
       or (integer and v % 1 ~= 0)
    then
        error("opts." .. name .. " must be "
              .. (integer and "a whole number from 1" or "a number above 0")
              .. " to " .. hi, 3)
    end
    return v
end


local function str(opts, name)
    local v = opts[name]
    if v ~= nil and (type(v) ~= "string" or v == "") then
        error("opts." .. name .. " must be a non-empty string", 3)
    end
    return v
end


-- p = publish.new(opts): see docs/publish.md for every option. Every
-- option is checked before anything is created.
function _M.new(opts)
    if type(opts) ~= "table" then
        error("opts must be a table", 2)
    end
    for k in pairs(opts) do
        if not OPTIONS[k] then
            error("opts." .. tostring(k) .. ": unknown option", 2)
        end
    end
    local project, topic = opts.project, opts.topic
    if type(project) ~= "string" or not project:match("^[%w][%w.:-]*$") then
        error("opts.project must be a project id", 2)
    end
    if type(topic) ~= "string" or #topic < 3 or #topic > 255
       or not topic:match("^%a[%w%-_.~+%%]*$") or sub(topic, 1, 4) == "goog"
    then
        error("opts.topic must be a topic id (3-255 characters, starting "
              .. "with a letter)", 2)
    end
    local overflow = opts.overflow or "reject"
    if overflow ~= "reject" and overflow ~= "drop_oldest" then
        error("opts.overflow must be \"reject\" or \"drop_oldest\"", 2)
    end
    for _, cb in ipairs({ "on_success", "on_error" }) do
        if opts[cb] ~= nil and type(opts[cb]) ~= "function" then
            error("opts." .. cb .. " must be a function", 2)
        end
    end
    if opts.ssl_verify ~= nil and type(opts.ssl_verify) ~= "boolean" then
        error("opts.ssl_verify must be a boolean", 2)
    end
    local name = str(opts, "name")
    local user_project = str(opts, "user_project")
    local server_name = str(opts, "server_name")

    local emulator = opts.emulator_host
    if emulator == nil then
        emulator = os.getenv("PUBSUB_EMULATOR_HOST")
        if emulator == "" then
            emulator = nil
        end
    end
    local endpoint = opts.endpoint or "https://pubsub.googleapis.com"
    local cred_opts = opts.credentials
    if emulator then
        if type(emulator) ~= "string" then
            error("opts.emulator_host must be host:port or false", 2)
        end
        -- unused here, but a mistake in them must not wait for production
        if cred_opts ~= nil then
            auth.check(cred_opts, "opts.credentials")
        end
        endpoint = "http://" .. emulator
        cred_opts = { type = "none" }
    elseif cred_opts == nil then
        error("opts.credentials is required (or opts.emulator_host)", 2)
    end
    local scheme, host, port = http.parse_url(endpoint)
    if not scheme then
        error("opts.endpoint: " .. host, 2)
    end

    local timeout = num(opts, "timeout", 10, 3600)
    local concurrency = num(opts, "concurrency", 4, 64, true)
    local retry_initial = num(opts, "retry_initial_backoff", 0.1, 3600)
    local retry_max_backoff = num(opts, "retry_max_backoff", 10, 3600)
    if retry_initial > retry_max_backoff then
        error("opts.retry_initial_backoff must be at most "
              .. "opts.retry_max_backoff (" .. retry_max_backoff .. ")", 2)
    end
    local batch_max_messages = num(opts, "batch_max_messages", MAX_MESSAGES,
                                   MAX_MESSAGES, true)
    local batch_max_bytes = num(opts, "batch_max_bytes", 1000000,
                                MAX_REQUEST_BYTES - ENVELOPE, true)
    local batch_max_delay = num(opts, "batch_max_delay", 0.05, 3600)
    local buffer_max_messages = num(opts, "buffer_max_messages", 100000, 1e9,
                                    true)
    local buffer_max_bytes = num(opts, "buffer_max_bytes", 64 * 1024 * 1024,
                                 1e12, true)
    local retry_deadline = num(opts, "retry_deadline", 60, MAX_SECONDS)
    local flush_timeout = num(opts, "flush_timeout", 3, 3600)
    local warn_interval = num(opts, "warn_interval", 10, MAX_SECONDS)
    -- the credentials check their own options (and raise) before the
    -- client is made
    local cred = auth.new(cred_opts, "opts.credentials")

    local self = {
        name = name or (project .. "/" .. topic),
        project = project,
        topic = topic,
        path = "/v1/projects/" .. project .. "/topics/" .. topic
               .. ":publish",
        headers = "Content-Type: application/json\r\n"
                  .. (user_project and ("X-Goog-User-Project: "
                      .. user_project .. "\r\n") or ""),
        batch_max_messages = batch_max_messages,
        batch_max_bytes = batch_max_bytes,
        batch_max_delay = batch_max_delay,
        buffer_max_messages = buffer_max_messages,
        buffer_max_bytes = buffer_max_bytes,
        overflow = overflow,
        concurrency = concurrency,
        timeout = timeout,
        retry_deadline = retry_deadline,
        retry_initial = retry_initial,
        retry_max_backoff = retry_max_backoff,
        flush_timeout = flush_timeout,
        warn_interval = warn_interval,
        on_success = opts.on_success,
        on_error = opts.on_error,
        cred = cred,
        client = http.new({
            scheme = scheme, host = host, port = port,
            ssl_verify = opts.ssl_verify, server_name = server_name,
            connect_timeout = min(timeout, 5), send_timeout = timeout,
            read_timeout = timeout, timeout = timeout,
            pool_size = concurrency * 2, keepalive_timeout = 60,
        }),
        -- state
        queues = {},
        opening = fifo_new(),    -- batches by creation time (deadlines)
        sealed = fifo_new(),     -- batches ready to go
        sending = {},            -- batches in flight (set)
        sema = semaphore.new(0),
        scratch = buf_new(2048),
        scratch_tail = buf_new(2048),
        free_bufs = {},
        backlog = false,         -- draining a big buffer: see dispatch()
        garbage = 0,             -- bytes of body pieces not yet collected
        running = false,
        recycling = false,       -- senders moving to a fresh timer
        recycle_at = 0,          -- self.requests when they do
        exiting = false,
        exit_deadline = nil,
        closed = false,
        run_fn = run,
        exit_fn = exit_watch,
        trouble = nil,           -- failures since the last warning
        -- figures
        queued_messages = 0,
        queued_bytes = 0,
        inflight_messages = 0,
        inflight_bytes = 0,
        inflight = 0,
        sent = 0,
        failed = 0,
        retried = 0,
        dropped = 0,
        rejected = 0,
        batches = 0,
        batched_messages = 0,
        requests = 0,
        latency = histogram.new(),
    }
    setmetatable(self, mt)
    local phase = ngx.get_phase()
    if phase ~= "init" then
        local ok, err = self.cred:start()
        if not ok then
            return nil, err
        end
    end
    publishers[self.name] = self
    living[self] = true
    at_close.register(unreported_at_close)
    register_collector()
    return self
end


-- publish.exit_worker(), in exit_worker_by_lua*: hands whatever is still
-- buffered to on_error and logs the count. A fast stop (SIGTERM, nginx -s
-- stop) runs no timer and no cosocket: this hook is all that runs.
function _M.exit_worker()
    for p in pairs(living) do
        report_at_exit(p)
    end
    return true
end


-- in init_worker, for publishers made in init: starts token refreshers
function _M.init_worker()
    for _, p in pairs(publishers) do
        local ok, err = p.cred:start()
        if not ok then
            return nil, err
        end
    end
    register_collector()
    return true
end


return _M
