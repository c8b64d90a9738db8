-- lua-resty-worker-events' API on top of resty.loom.events, so code written
-- for it runs unchanged. The bus itself is created in init_by_lua with
-- resty.loom.events.new() (it needs its `listen unix:` server); configure()
-- then connects this worker. Differences are listed in docs/events.md.


local events = require "resty.loom.events"

local type = type
local error = error
local select = select
local setmetatable = setmetatable
local tostring = tostring

local SELF = "resty-worker-events"


local _M = { _VERSION = "0.1.0" }

local bus
local configured = false
-- callback -> { [sub id] = true }; weak callbacks in a weak-keyed table
local strong = {}
local weak = setmetatable({}, { __mode = "k" })


function _M.configure(opts)
    if opts ~= nil and type(opts) ~= "table" then
        error("opts must be a table", 2)
    end
    bus = events.get()
    if not bus then
        return nil, "failed to configure: no resty.loom.events bus; create "
                    .. "one with resty.loom.events.new() in init_by_lua"
    end
    local ok, err = bus:init_worker()
    if not ok then
        return nil, err
    end
    if not configured then
        -- once per process, as worker-events does
        configured = true
        bus:publish("current", SELF, "started", nil)
    end
    return true
end


function _M.configured()
    return configured
end


local function check()
    if not configured then
        error("worker-events not configured", 3)
    end
end


-- handlers may be registered before configure(), as worker-events allows:
-- the bus exists from init_by_lua on
local function the_bus()
    local b = bus or events.get()
    if not b then
        error("no resty.loom.events bus; create one with "
              .. "resty.loom.events.new() in init_by_lua", 3)
    end
    return b
end


-- post(source, event, data, unique): to every worker, or to exactly one
-- when "unique" names the event
function _M.post(source, event, data, unique)
    check()
    local target = "all"
    if unique ~= nil then
        target = "unique:" .. tostring(unique)
    end
    local ok, err = bus:publish(target, source, event, data)
    if not ok then
        return nil, err
    end
    return true
end


function _M.post_local(source, event, data)
    check()
    local ok, err = bus:publish("current", source, event, data)
    if not ok then
        return nil, err
    end
    return true
end


-- The events are pushed to this worker as they come; poll() runs the
-- handlers of those already received right away. Returns "done" or
-- "recursive".
function _M.poll()
    check()
    return bus:poll()
end


local function add(b, book, callback, source, ...)
    local ids = book[callback] or {}
    book[callback] = ids
    -- handlers get (data, event, source, pid), as worker-events gives
    local function adapter(data, event, src, _, pid)
        return callback(data, event, src, pid)
    end
    local weak_ids
    if weak == book then
        -- the subscription must not keep the callback alive; once it is
        -- collected, its subscriptions remove themselves
        local ref = setmetatable({ callback }, { __mode = "v" })
        callback = nil
        weak_ids = {}
        adapter = function(data, event, src, _, pid)
            local cb = ref[1]
            if cb then
                return cb(data, event, src, pid)
            end
            for id in pairs(weak_ids) do
                b:unsubscribe(id)
            end
        end
    end
    local function sub(s, e)
        local id = b:subscribe(s, e, adapter)
        ids[id] = { s, e }
        if weak_ids then
            weak_ids[id] = true
        end
    end
    local n = select("#", ...)
    if source == nil then
        sub("*", "*")
    elseif n == 0 then
        sub(source, "*")
    else
        for i = 1, n do
            sub(source, (select(i, ...)))
        end
    end
    return true
end


function _M.register(callback, source, ...)
    if type(callback) ~= "function" then
        error("expected function, got " .. type(callback), 2)
    end
    return add(the_bus(), strong, callback, source, ...)
end


function _M.register_weak(callback, source, ...)
    if type(callback) ~= "function" then
        error("expected function, got " .. type(callback), 2)
    end
    return add(the_bus(), weak, callback, source, ...)
end


-- unregister(callback [, source [, event, ...]]): removes the registration
-- made with the same arguments (the catch-all one, the one for a whole
-- source, or those for the events named), as worker-events does; true if
-- anything was removed
function _M.unregister(callback, source, ...)
    if type(callback) ~= "function" then
        error("expected function, got " .. type(callback), 2)
    end
    local b = the_bus()
    local removed = false
    local n = select("#", ...)
    for _, book in ipairs({ strong, weak }) do
        local ids = book[callback]
        if ids then
            for id, key in pairs(ids) do
                local match
                if source == nil then
                    match = key[1] == "*"
                elseif key[1] == source then
                    match = n == 0 and key[2] == "*"
                    for i = 1, n do
                        if key[2] == select(i, ...) then
                            match = true
                        end
                    end
                end
                if match then
                    b:unsubscribe(id)
                    ids[id] = nil
                    removed = true
                end
            end
            if next(ids) == nil then
                book[callback] = nil
            end
        end
    end
    return removed
end


-- A table of event names that errors on a name it does not hold.
function _M.event_list(source, ...)
    local list = { _source = source }
    for i = 1, select("#", ...) do
        local ev = select(i, ...)
        list[ev] = ev
    end
    return setmetatable(list, {
        __index = function(_, key)
            error("event '" .. tostring(key) .. "' is an unknown event", 2)
        end,
    })
end


-- the library's own events; "stopping" is never posted (see the docs)
_M.events = _M.event_list(SELF, "started", "stopping")


return _M
