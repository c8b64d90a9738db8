-- The senders of a publisher: one timer running a pool of light threads
-- that take sealed batches from the buffer and publish them over
-- keep-alive connections, retrying transient failures with backoff and
-- jitter until a deadline; the timer's exit watch and its recycling.


local cjson = require "cjson.safe"
local buffer = require "resty.loom.publish.buffer"
local report = require "resty.loom.publish.report"
local shutdown = require "resty.loom.publish.shutdown"
local spool = require "resty.loom.publish.spool"
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
local json_decode = cjson.decode
local next_ready = buffer.next_batch
local take = buffer.take
local landed = buffer.landed
local pause = buffer.pause
local settle = buffer.settle
local call = report.call
local report_failure = report.failure
local note_trouble = report.note_trouble
local note_recovery = report.note_recovery
local abandon = shutdown.abandon
local spool_done = spool.done
local spool_feed = spool.feed
local spool_keep = spool.keep
local sub = string.sub
local tostring = tostring
local random = math.random
local min = math.min
local type = type
local xpcall = xpcall
local pcall = pcall

local LOG_TAG = "[loom.publish] "
local EXIT_WATCH = 3600
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


local _M = { _VERSION = "0.2.0" }


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


-- the next batch a sender may take, or nil and how long to wait
local function next_batch(self)
    local now = ngx_now()
    if not self.exiting and worker_exiting() then
        self.exiting = true
        self.exit_deadline = now + self.flush_timeout
    end
    local exiting = self.exiting
    if exiting and now >= self.exit_deadline then
        return nil, 0
    end
    return next_ready(self, now, exiting)
end


-- publishes batch b, retrying until its deadline, and tells the outcome
local function dispatch(self, b)
    local q = b.q
    local n, bytes = b.n, b.bytes
    local body = take(self, b)

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
    landed(self, b)

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
        if self.spool then
            spool_done(self, b)
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

    elseif self.spool and self.exiting and outcome ~= "fatal" then
        -- cut by the exit budget: kept for the spool (run() writes it),
        -- not reported; it may have arrived
        b.body = body
        local kept = self.kept
        kept[#kept + 1] = b

    else
        note_trouble(self, reason, n)
        report_failure(self, q, body, n, reason, attempts, status)
        if self.spool then
            spool_done(self, b)
        end
        if q.key ~= "" and not self.exiting then
            pause(self, q, reason)
        end
    end
    -- the body is garbage now: settle() may have the collector take it
    body = nil      -- luacheck: ignore
    settle(self, q, bytes)
    if self.spool then
        -- room in the buffer: read on in the files adopted
        spool_feed(self)
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
        if self.spool then
            -- what is left goes to the spool (reported when it cannot)
            spool_keep(self)
        elseif left > 0 then
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


_M.start = start
_M.run = run
_M.exit_watch = exit_watch


return _M
