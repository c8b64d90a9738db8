-- Dispatch to the handlers: the inbox of events for this worker's
-- handlers and the handler loop (a timer) that runs them, in the order
-- they subscribed; the bus's own events go to collect. Also the clock of
-- the publish-to-handler latency, and the gap hooks.


local ffi = require "ffi"
local collect = require "resty.loom.events.collect"
local evlog = require "resty.loom.events.log"
local yield = require("resty.loom.yield").yield
local on_error = require("resty.loom.error_handler").handler

local C = ffi.C
local ngx = ngx
local ipairs = ipairs
local xpcall = xpcall
local tonumber = tonumber
local co_running = coroutine.running
local log = evlog.log
local warn_once = evlog.warn_once
local handle_internal = collect.handle_internal

local ERR = ngx.ERR

local INTERNAL = collect.INTERNAL
local SLICE = 256                   -- events handled between yields


ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } loom_timespec_t;
int clock_gettime(int clk, loom_timespec_t *ts);
]]

local CLOCK_MONOTONIC = 1
local ts = ffi.new("loom_timespec_t")


local _M = { _VERSION = "0.2.0" }


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


local function dispatch(self, source, event, data, wid, pid)
    if source == INTERNAL then
        return handle_internal(self, event, data, wid)
    end
    self.counters.delivered = self.counters.delivered + 1
    -- registration order, across wildcard and exact subscriptions
    local list = self.sub_list
    for i = 1, #list do
        local sub = list[i]
        if not sub.removed
           and (sub.source == "*" or sub.source == source)
           and (sub.event == "*" or sub.event == event) then
            run_handler(self, sub, data, event, source, wid, pid)
        end
    end
end


-- runs the handlers of the next event in the inbox in coroutine me (the
-- caller's: coroutine.running() would stitch the trace); false when empty
local function dispatch_next(self, me)
    local source, event, data, wid, latency, pid = self.inbox:pop()
    if not source then
        return false
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
    local me = co_running()
    while true do
        if self.dispatch[1] then
            -- poll() runs handlers in a request: one event at a time, so
            -- wait (whoever pushes next wakes us)
            self.handler_idle = true
            self.isema:wait(1)
            self.handler_idle = false
        elseif dispatch_next(self, me) then
            run = run + 1
            if run >= SLICE then
                -- let requests in between long runs of handlers
                run = 0
                yield()
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
        end
    end
end
_M.handler_loop = handler_loop


return _M
