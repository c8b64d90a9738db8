-- Cross-worker collection: the collectors of this process, and collect()'s
-- requests and answers, which are urgent events (the bus's own, source
-- INTERNAL): sent ahead of what is queued, on the lane when there is one
-- (see lane.lua), and handled on arrival.


local buffer = require "string.buffer"
local semaphore = require "ngx.semaphore"
local frame = require "resty.loom.events.frame"
local broker = require "resty.loom.events.broker"
local log = require("resty.loom.events.log").log
local on_error = require("resty.loom.error_handler").handler

local ngx = ngx
local ngx_now = ngx.now
local buf_new = buffer.new
local type = type
local error = error
local pcall = pcall
local xpcall = xpcall
local tostring = tostring
local max = math.max

local ERR = ngx.ERR

local EVENT_SIZE = frame.EVENT_SIZE
local CHUNK = frame.CHUNK
local ALL = frame.ALL
local AGENT = frame.AGENT

local INTERNAL = "loom.bus"         -- source of the bus's own events


local _M = { _VERSION = "0.2.0", INTERNAL = INTERNAL }

local collectors = {}


local send_urgent

local function handle_internal(self, event, data, wid)
    if event == "collect" then
        local fn = collectors[data.name]
        local ok, value
        if fn then
            ok, value = xpcall(fn, on_error)
            if not ok then
                log(ERR, "collector ", data.name, " failed: ", value)
                value = nil
            end
        end
        local err
        ok, err = pcall(send_urgent, self, wid, "collected",
                        { id = data.id, worker = self.worker,
                          value = value })
        if not ok then
            log(ERR, "failed to answer collect(\"", data.name, "\"): ",
                err)
        end

    elseif event == "collected" then
        local pend = self.collecting and self.collecting[data.id]
        if pend then
            pend.results[tostring(data.worker)] = data.value or ngx.null
            pend.n = pend.n + 1
            pend.sema:post(1)
        end
    end
end


-- collect's requests and answers are urgent events (see frame.lua): sent
-- ahead of what is queued and handled on arrival, so that a bus full of
-- events (a feedback loop, a slow handler) still answers. An answer too
-- large for one frame takes the ordinary way. To this worker (or "all"):
-- handled here as well. Raises when data cannot be serialised.
function send_urgent(self, target, event, data)
    local size = frame.encode_body(INTERNAL, event, data)
    if size + EVENT_SIZE > CHUNK then
        local ok, err = self:publish(target == ALL and "all"
                                     or target == AGENT and "agent"
                                     or target, INTERNAL, event, data)
        if not ok then
            log(ERR, "failed to send ", event, ": ", err)
        end
        return
    end
    local link = self.local_link
    if target ~= self.worker and link then
        -- the broker worker: straight to the broker (its writer may be
        -- waiting there for room, with a batch of events)
        local out = buf_new(256)
        frame.put_urgent(out, target, self.worker, self.pid,
                         self.incarnation)
        local ok, err = broker.take_local(self, link, out)
        if not ok then
            log(ERR, "failed to hand an urgent event to the broker: ", err)
        end
    elseif target ~= self.worker then
        frame.put_urgent(self.urgent, target, self.worker, self.pid,
                         self.incarnation)
        local lane = self.lane
        if lane then
            lane.sema:post(1)
        elseif self.writer_idle then
            self.writer_idle = false
            self.wsema:post(1)
        end
    end
    if target == ALL or target == self.worker then
        handle_internal(self, event, data, self.worker)
    end
end
_M.handle_internal = handle_internal


local function receive_urgent(self, p, len)
    local e, why = frame.check_event(p, len)
    if not e then
        return nil, why
    end
    local ok, source, event, data = pcall(frame.decode_body, p + EVENT_SIZE,
                                          e.body_len)
    if not ok or source ~= INTERNAL or type(data) ~= "table" then
        return nil, "bad urgent event"
    end
    handle_internal(self, event, data, e.publisher)
    return true
end
_M.receive_urgent = receive_urgent


-- events.register_collector(name, fn) and bus:collect(name, timeout): see
-- events.lua
function _M.register_collector(name, fn)
    if type(name) ~= "string" then
        error("name must be a string", 2)
    end
    if type(fn) ~= "function" then
        error("fn must be a function", 2)
    end
    collectors[name] = fn
end


function _M.collect(self, name, timeout)
    timeout = timeout or 1
    local id = (self.collect_id or 0) + 1
    self.collect_id = id
    self.collecting = self.collecting or {}
    local pend = { results = {}, n = 0, sema = semaphore.new() }
    self.collecting[id] = pend
    local err = not self.initialized and "not initialized"
                or self.stopping and "closed"
    if not err then
        local ok, e = pcall(send_urgent, self, ALL, "collect",
                            { name = name, id = id })
        err = not ok and e
    end
    if err then
        self.collecting[id] = nil
        return nil, "failed to collect: " .. tostring(err)
    end
    local want = self.worker_count + (self.opts.privileged_agent and 1 or 0)
    local deadline = ngx_now() + timeout
    while pend.n < want do
        local left = deadline - ngx_now()
        if left <= 0 then
            break
        end
        pend.sema:wait(max(left, 0.001))
        ngx.update_time()
    end
    self.collecting[id] = nil
    return pend.results
end


return _M
