-- Dispatch to the handlers: the inbox of events for this worker's
-- handlers and the handler loop (a timer) that runs them, in the order
-- they subscribed; the bus's own events go to collect. Also the clock of
-- the publish-to-handler latency, and the gap hooks.


local ffi = require "ffi"
local buffer = require "string.buffer"
local collect = require "resty.loom.events.collect"
local evlog = require "resty.loom.events.log"
local yield = require("resty.loom.yield").yield
local on_error = require("resty.loom.error_handler").handler

local C = ffi.C
local ngx = ngx
local ipairs = ipairs
local xpcall = xpcall
local tonumber = tonumber
local type = type
local error = error
local pcall = pcall
local co_running = coroutine.running
local log = evlog.log
local warn_once = evlog.warn_once
local handle_internal = collect.handle_internal

local ERR = ngx.ERR

-- reads the bodies in a bus's raw buffer in place
local dec = buffer.new()
local dec_decode = dec.decode

local INTERNAL = collect.INTERNAL
-- Handlers run for SLICE seconds before they let requests in (the clock
-- read every CHECK_EVERY events). A count instead (256 events) made a
-- burst of cheap handlers yield to the loop 40 times per 10,000 events,
-- each turn serving every ready request first: most of the publish-to-
-- handler p99 under HTTP load. Time bounds what requests wait whatever
-- the handlers cost.
local SLICE = 0.001
local CHECK_EVERY = 16


ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } loom_timespec_t;
int clock_gettime(int clk, loom_timespec_t *ts);
]]

local CLOCK_MONOTONIC = 1
local ts = ffi.new("loom_timespec_t")


local _M = { _VERSION = "0.2.0", SLICE = SLICE }


local function mono()
    C.clock_gettime(CLOCK_MONOTONIC, ts)
    return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end
_M.mono = mono


local function inbox_len(self)
    return self.inbox:len()
end
_M.inbox_len = inbox_len


local function inbox_push(self, source, event, data, wid, latency, pid)
    self.inbox:push(source, event, data, wid, latency, pid)
    if self.handler_idle then
        self.handler_idle = false
        self.isema:post(1)
    end
end
_M.inbox_push = inbox_push


-- An event from another worker, as its encoded body (len bytes at p):
-- the bytes wait in self.raw and are decoded just before the handlers
-- run. A decoded table that waits in the inbox is marked by every GC
-- cycle meanwhile (a fifth of the reader's CPU in a burst), and an event
-- that no handler of this worker wants is never decoded past its names.
local function inbox_push_raw(self, p, len, wid, latency, pid)
    self.raw:putcdata(p, len)
    inbox_push(self, false, len, nil, wid, latency, pid)
end
_M.inbox_push_raw = inbox_push_raw


-- counts events of a publisher that never reached this worker, and tells
-- the gap hooks
local function report_gap(self, publisher, pid, missing)
    self.counters.gaps = self.counters.gaps + missing
    warn_once(self, "gap", "gap: ", missing, " event(s) from worker ",
              publisher, " (pid ", pid, ") missing; ", self.counters.gaps,
              " so far")
    for _, hook in ipairs(self.gap_hooks) do
        local ok, err = xpcall(hook, on_error, publisher, missing)
        if not ok then
            log(ERR, "gap hook failed: ", err)
        end
    end
end
_M.report_gap = report_gap


local function run_handler(self, sub, data, event, source, wid, pid)
    self.counters.handler_calls = self.counters.handler_calls + 1
    local ok, err = xpcall(sub.fn, on_error, data, event, source, wid, pid)
    if not ok then
        self.counters.handler_errors = self.counters.handler_errors + 1
        log(ERR, "handler for source=", source, " event=", event,
            " (subscribed at ", sub.site, ") failed: ", err)
    end
end


-- a live subscription to this source and event (wildcards included)
local function matches(sub, source, event)
    return not sub.removed
           and (sub.source == "*" or sub.source == source)
           and (sub.event == "*" or sub.event == event)
end


-- true when a live subscription matches
local function wanted(self, source, event)
    local list = self.sub_list
    for i = 1, #list do
        if matches(list[i], source, event) then
            return true
        end
    end
    return false
end


-- source, event and, when a handler wants it, data of the body of len
-- bytes at p; errors on bytes that are not a body this bus encoded
local function decode_body(self, p, len)
    dec:set(p, len)
    local source = dec_decode(dec)
    local event = dec_decode(dec)
    if type(source) ~= "string" or type(event) ~= "string" then
        error("malformed event body")
    end
    local data
    if source == INTERNAL or wanted(self, source, event) then
        data = dec_decode(dec)
        if #dec ~= 0 then
            error("malformed event body")
        end
    end
    return source, event, data
end


-- Decodes the next body in self.raw (len bytes), which it then drops:
-- source, event, data, or nothing when it is garbage.
local function decode_raw(self, len)
    local raw = self.raw
    local ok, source, event, data = pcall(decode_body, self, raw:ref(), len)
    raw:skip(len)
    if ok then
        return source, event, data
    end
end


local function dispatch(self, source, event, data, wid, pid)
    if source == INTERNAL then
        return handle_internal(self, event, data, wid)
    end
    self.counters.delivered = self.counters.delivered + 1
    -- registration order, across wildcard and exact subscriptions
    local list = self.sub_list
    for i = 1, #list do
        local sub = list[i]
        if matches(sub, source, event) then
            run_handler(self, sub, data, event, source, wid, pid)
        end
    end
end


-- runs the handlers of the next event in the inbox in coroutine me (the
-- caller's: coroutine.running() would stitch the trace); false when empty
local function dispatch_next(self, me)
    local source, event, data, wid, latency, pid = self.inbox:pop()
    if source == nil then
        return false
    end
    if not source then
        -- from another worker: event is the length of its body in raw
        source, event, data = decode_raw(self, event)
        if not source then
            local c = self.counters
            c.dropped.undecodable = (c.dropped.undecodable or 0) + 1
            warn_once(self, "undecodable", "dropped an undecodable event "
                      .. "from worker ", wid, " (pid ", pid, "); ",
                      c.dropped.undecodable, " so far")
            return true
        end
    end
    if latency and latency > 0 then
        self.latency:record(mono() - latency)
    end
    if self.rwaiters > 0 then
        self.rspace:post(1)
    end
    local d = self.dispatch
    d[1], d.waiting = me, false
    d.source, d.event = source, event
    dispatch(self, source, event, data, wid, pid)
    d[1] = nil
    return true
end
_M.dispatch_next = dispatch_next


local function handler_loop(premature, self)
    if premature then
        return
    end
    local run = 0
    local since = mono()
    local me = co_running()
    while true do
        if self.dispatch[1] then
            -- poll() runs handlers in a request: one event at a time, so
            -- wait (whoever pushes next wakes us)
            self.handler_idle = true
            self.isema:wait(1)
            self.handler_idle = false
            since = mono()
        elseif dispatch_next(self, me) then
            run = run + 1
            if run >= CHECK_EVERY then
                run = 0
                if mono() - since >= SLICE then
                    -- let requests in between long runs of handlers
                    yield()
                    since = mono()
                end
            end
        else
            -- (only once the bus closed: until then events keep coming,
            -- "current" ones even while the broker cannot be reached)
            if self.stopping and not self.connected then
                return
            end
            run = 0
            self.handler_idle = true
            self.isema:wait(1)
            self.handler_idle = false
            since = mono()
        end
    end
end
_M.handler_loop = handler_loop


return _M
