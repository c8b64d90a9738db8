-- lua-resty-events' API (resty.events 0.3.x) on top of resty.loom.events,
-- so code written for it runs unchanged: the same options, validation
-- messages, return values, handler arguments and handler order.
-- Differences are listed in docs/events.md, "Compatibility".


local events = require "resty.loom.events"
local common = require "resty.loom.compat.common"
local frame = require "resty.loom.events.frame"

local type = type
local error = error
local pcall = pcall
local tostring = tostring
local setmetatable = setmetatable
local ceil = math.ceil
local max = math.max
local huge = math.huge
local str_sub = string.sub
local str_gsub = string.gsub
local tab_remove = table.remove
local ngx_md5 = ngx.md5
local timer_at = ngx.timer.at
local local_event = common.local_event
local unwrap = common.unwrap
local call = common.call

local MAX_PAYLOAD_LIMIT = 16 * 1024 * 1024
local UNIQUE_KEY_MAX = frame.KEY_MAX
-- the bus bounds bytes too; lua-resty-events bounds events only
local QUEUE_BYTES = 64 * 1024 * 1024
local EVENT_ROOM = 8192

-- the bus's errors in lua-resty-events' words
local ERRORS = { ["queue full"] = "queue overflow" }


local _M = { _VERSION = "0.3.1" }
local mt = { __index = _M }


-- The options are checked in lua-resty-events' order, and a value it
-- refuses gets its message; NaN, infinities and a fractional broker_id,
-- which it takes, are refused too. Defaults are filled into opts, as it
-- does. Each number: name, default, whether a value is in range, and the
-- messages for a value that is not a number and for one out of range.
local BROKER_ID = {
    "broker_id", 0,
    function(v) return v >= 0 and v < ngx.worker.count() and v % 1 == 0 end,
    '"broker_id" option must be a number', '"broker_id" option is invalid',
}
local NUMBERS = {
    {
        "unique_timeout", 5, function(v) return v > 0 end,
        'optional "unique_timeout" option must be a number',
        '"unique_timeout" must be greater than 0',
    }, {
        "max_queue_len", 10240, function(v) return v > 0 end,
        '"max_queue_len" option must be a number',
        '"max_queue_len" option is invalid',
    }, {
        "max_payload_len", 65536,
        function(v) return v > 0 and v <= MAX_PAYLOAD_LIMIT end,
        '"max_payload_len" option must be a number',
        '"max_payload_len" option is invalid',
    },
}


-- the message for a bad number, else nil
local function bad_number(opts, spec)
    local name = spec[1]
    local v = opts[name] or spec[2]
    opts[name] = v
    if type(v) ~= "number" then
        return spec[4]
    end
    if not spec[3](v) then
        return spec[5]
    end
    if v == huge or v == -huge then
        return '"' .. name .. '" option must be a finite number'
    end
    return nil
end


local function bad_listening(v)
    if not v then
        return '"listening" option required to start'
    end
    if type(v) ~= "string" then
        return '"listening" option must be a string'
    end
    if str_sub(v, 1, 5) ~= "unix:" then
        return '"listening" option must start with unix:'
    end
    return nil
end


local KNOWN = {
    broker_id = true, listening = true, unique_timeout = true,
    max_queue_len = true, max_payload_len = true,
    enable_privileged_agent = true, testing = true,
}


-- the message for the first bad option, else nil
local function bad_options(opts)
    if type(opts) ~= "table" then
        return "Expected a table, got " .. type(opts)
    end
    local err = bad_number(opts, BROKER_ID) or bad_listening(opts.listening)
    for i = 1, #NUMBERS do
        err = err or bad_number(opts, NUMBERS[i])
    end
    if err then
        return err
    end
    local agent = opts.enable_privileged_agent
    if agent ~= nil and type(agent) ~= "boolean" then
        return '"enable_privileged_agent" option must be a boolean'
    end
    opts.testing = opts.testing or false
    if type(opts.testing) ~= "boolean" then
        return '"testing" option must be a boolean'
    end
    return nil
end


local function run_list(funcs, list, data, event, source, wid)
    if not list then
        return
    end
    local i = 1
    while i <= #list do
        local fn = funcs[list[i]]
        if fn then
            call(fn, "wid", data, event, source, wid)
            i = i + 1
        else
            -- unsubscribed: forget it here too
            tab_remove(list, i)
        end
    end
end


-- runs the callbacks of one event as lua-resty-events does: those for
-- ("*", "*"), then (source, "*"), then (source, event)
local function dispatch(self, source, event, data, wid)
    local funcs = self.funcs
    local buckets = self.buckets
    local any = buckets["*"]
    run_list(funcs, any and any["*"], data, event, source, wid)
    local by_event = buckets[source]
    if by_event then
        run_list(funcs, by_event["*"], data, event, source, wid)
        run_list(funcs, by_event[event], data, event, source, wid)
    end
end


function _M.new(opts)
    local err = bad_options(opts)
    if err then
        error(err, 2)
    end
    local self = setmetatable({
        opts = opts,
        funcs = {},         -- id -> callback
        buckets = {},       -- source -> event -> ids, in subscribe order
        counter = 0,
        early = {},         -- published before init_worker()
        ready = false,      -- testing mode only
    }, mt)
    if not opts.testing then
        local payload = ceil(opts.max_payload_len)
        local ok, bus = pcall(events.new, {
            socket = opts.listening,
            broker = opts.broker_id,
            unique_window = max(opts.unique_timeout, 0.001),
            max_queue = ceil(opts.max_queue_len),
            max_payload = payload,
            max_queue_bytes = max(QUEUE_BYTES, payload * 4 + EVENT_ROOM),
            privileged_agent = opts.enable_privileged_agent == true,
        })
        if not ok then
            -- the bus's own checks (an absolute path, its directory), at
            -- the caller's line as the ones above
            error((str_gsub(tostring(bus), "^[^:]*:%d+: ", "")), 2)
        end
        self.bus = bus
        self.bus:subscribe("*", "*", function(data, event, source, wid)
            local d, is_local = unwrap(data)
            if is_local then
                wid = nil
            end
            return dispatch(self, source, event, d, wid)
        end)
    end
    return self
end


local function set_ready(premature, self)
    if not premature then
        self.ready = true
    end
end


function _M.init_worker(self)
    if ngx.worker.id() == (self.opts.testing and 0 or self.opts.broker_id)
    then
        -- (from new(), in init_by_lua, it would go to stderr only)
        common.warn_unknown("resty.events", self.opts, KNOWN)
    end
    if self.opts.testing then
        -- lua-resty-events is ready once its first timer ran
        local ok, err = timer_at(0, set_ready, self)
        if not ok then
            return nil, "failed to start the events timer: " .. err
        end
        return true
    end
    if ngx.worker.id() == nil
       and self.opts.enable_privileged_agent ~= true
    then
        -- the privileged agent takes part only when enabled explicitly
        return true
    end
    local ok, err = self.bus:init_worker()
    if not ok then
        return nil, err
    end
    -- what was published before: queued in order, as lua-resty-events
    -- keeps it until the connection is up
    local early = self.early or {}
    self.early = nil
    for i = 1, #early do
        local e = early[i]
        local pok, perr = self:publish(e[1], e[2], e[3], e[4])
        if not pok then
            ngx.log(ngx.ERR, "failed to publish event queued before "
                    .. "init_worker(): ", perr)
        end
    end
    return true
end


function _M.run(self)
    if self.opts.testing then
        return ngx.exit(444)
    end
    return self.bus:serve()
end


function _M.is_ready(self)
    if self.opts.testing then
        return self.ready
    end
    return self.bus:is_ready()
end


-- raises, at the line of publish()'s or subscribe()'s caller, as
-- lua-resty-events does for a missing source or event
local function check_names(source, event)
    if type(source) ~= "string" or source == "" then
        error("source is required", 3)
    end
    if type(event) ~= "string" or event == "" then
        error("event is required", 3)
    end
end


-- publish(target, source, event, data): target "all", "current", or any
-- other string naming a unique event (delivered to one worker)
function _M.publish(self, target, source, event, data)
    if type(target) ~= "string" or target == "" then
        error("target is required", 2)
    end
    check_names(source, event)
    if self.opts.testing then
        -- synchronous, in this process, as lua-resty-events' testing mode
        dispatch(self, source, event, data, nil)
        return true
    end
    local early = self.early
    if early then
        -- bounded as lua-resty-events' publisher queue is
        if #early >= self.opts.max_queue_len then
            return nil, "failed to publish event: queue overflow"
        end
        early[#early + 1] = { target, source, event, data }
        return true
    end

    if target == "current" then
        data = local_event(data)
    elseif target ~= "all" then
        if #target > UNIQUE_KEY_MAX then
            target = ngx_md5(target)
        end
        target = "unique:" .. target
    end
    local ok, err = self.bus:publish(target, source, event, data)
    if not ok then
        if err == "payload too large" then
            err = "payload exceeds the limitation ("
                  .. self.opts.max_payload_len .. ")"
        end
        return nil, "failed to publish event: " .. (ERRORS[err] or err)
    end
    return true
end


-- subscribe(source, event, callback): callback(data, event, source, wid);
-- returns an id for unsubscribe()
function _M.subscribe(self, source, event, callback)
    check_names(source, event)
    if type(callback) ~= "function" then
        error("expected function, got: " .. type(callback), 2)
    end
    -- ids are "1", "2", ...: the peer's, which callers may keep as keys
    self.counter = self.counter + 1
    local id = tostring(self.counter)
    self.funcs[id] = callback
    local by_event = self.buckets[source]
    if not by_event then
        by_event = {}
        self.buckets[source] = by_event
    end
    local list = by_event[event]
    if not list then
        list = {}
        by_event[event] = list
    end
    list[#list + 1] = id
    return id
end


function _M.unsubscribe(self, id)
    if type(id) ~= "string" or id == "" then
        error("id is required", 2)
    end
    self.funcs[id] = nil
end


return _M
