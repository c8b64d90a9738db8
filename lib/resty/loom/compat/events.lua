-- lua-resty-events' API (resty.events) on top of resty.loom.events, so
-- code written for it runs unchanged. Differences are listed in
-- docs/events.md.


local events = require "resty.loom.events"

local type = type
local error = error
local tostring = tostring
local setmetatable = setmetatable


local _M = { _VERSION = "0.1.0" }
local mt = { __index = _M }


local function opt(opts, name, kind)
    local v = opts[name]
    if v ~= nil and type(v) ~= kind then
        error('"' .. name .. '" option is invalid', 3)
    end
    return v
end


-- raises lua-resty-events' error for a missing or empty name, blaming the
-- caller of the API function
local function require_name(value, what)
    if type(value) ~= "string" or value == "" then
        error(what .. " is required", 3)
    end
end


-- new(opts): listening ("unix:<path>", required), broker_id,
-- unique_timeout, max_queue_len, max_payload_len, enable_privileged_agent,
-- testing
function _M.new(opts)
    if type(opts) ~= "table" then
        error("opts must be a table", 2)
    end
    local listening = opt(opts, "listening", "string")
    if not listening or listening:sub(1, 5) ~= "unix:" then
        error('"listening" option is invalid', 2)
    end
    local testing = opt(opts, "testing", "boolean")
    local self = { testing = testing, subs = {}, next_id = 0 }
    if not testing then
        local max_payload = opt(opts, "max_payload_len", "number")
        local max_queue = opt(opts, "max_queue_len", "number")
        self.bus = events.new({
            socket = listening,
            broker = opt(opts, "broker_id", "number"),
            unique_window = opt(opts, "unique_timeout", "number"),
            max_queue = max_queue,
            max_payload = max_payload,
            max_queue_bytes = max_payload
                              and (max_payload * 4 + 64 * 1024 * 1024) or nil,
            privileged_agent = opt(opts, "enable_privileged_agent",
                                   "boolean") or false,
        })
    end
    return setmetatable(self, mt)
end


function _M.init_worker(self)
    if self.testing then
        return true
    end
    return self.bus:init_worker()
end


function _M.run(self)
    if self.testing then
        return ngx.exit(444)
    end
    return self.bus:serve()
end


function _M.is_ready(self)
    return self.testing or self.bus:is_ready()
end


-- publish(target, source, event, data): target "all", "current", or any
-- other string naming a unique event (delivered to one worker)
function _M.publish(self, target, source, event, data)
    require_name(target, "target")
    require_name(source, "source")
    require_name(event, "event")
    if self.testing then
        -- synchronous, in this process, as lua-resty-events' testing mode
        for _, sub in pairs(self.subs) do
            if (sub[1] == "*" or sub[1] == source)
               and (sub[2] == "*" or sub[2] == event) then
                sub[3](data, event, source, nil)
            end
        end
        return true
    end
    if target ~= "all" and target ~= "current" then
        target = "unique:" .. target
    end
    local ok, err = self.bus:publish(target, source, event, data)
    if not ok then
        return nil, "failed to publish event: " .. err
    end
    return true
end


-- subscribe(source, event, callback): callback(data, event, source, wid);
-- returns an id for unsubscribe()
function _M.subscribe(self, source, event, callback)
    require_name(source, "source")
    require_name(event, "event")
    if type(callback) ~= "function" then
        error("expected function, got " .. type(callback), 2)
    end
    self.next_id = self.next_id + 1
    local id = tostring(self.next_id)
    if self.testing then
        self.subs[id] = { source, event, callback }
    else
        self.subs[id] = self.bus:subscribe(source, event, callback)
    end
    return id
end


function _M.unsubscribe(self, id)
    local sub = self.subs[id]
    if sub == nil then
        return
    end
    self.subs[id] = nil
    if not self.testing then
        self.bus:unsubscribe(sub)
    end
end


return _M
