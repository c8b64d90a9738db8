-- lua-resty-events' resty.events.compat (the worker-events style API over
-- resty.events that Kong 3.x calls), on top of resty.loom.compat.events:
-- one instance per process, made and started by configure(opts) in
-- init_worker. Differences are listed in docs/events.md, "Compatibility".


local compat_events = require "resty.loom.compat.events"

local type = type
local select = select


local _M = { _VERSION = compat_events._VERSION }

local ev
local configured
-- callback -> its subscription ids
local handlers = {}


-- configure(opts): the options of resty.events' new(); raises on a bad
-- one, returns nil, err when init_worker() fails
function _M.configure(opts)
    ev = compat_events.new(opts)
    local ok, err = ev:init_worker()
    if not ok then
        return nil, err
    end
    configured = true
    return true
end


function _M.configured()
    return configured
end


function _M.run()
    return ev:run()
end


-- "done" once published, else nil, err
local function publish(target, source, event, data)
    local ok, err = ev:publish(target, source, event, data)
    if ok then
        return "done"
    end
    return nil, err
end


-- post(source, event, data, unique): to every worker, or to the one that
-- takes the unique target
function _M.post(source, event, data, unique)
    return publish(unique or "all", source, event, data)
end


function _M.post_local(source, event, data)
    return publish("current", source, event, data)
end


-- register(callback, source?, event?, ...): callback(data, event, source,
-- wid) for each event named (all of a source without one, every event
-- without a source)
function _M.register(callback, source, ...)
    local ids = handlers[callback] or {}
    handlers[callback] = ids
    local n = select("#", ...)
    if n == 0 then
        ids[#ids + 1] = ev:subscribe(source or "*", "*", callback)
    end
    for i = 1, n do
        ids[#ids + 1] = ev:subscribe(source or "*", (select(i, ...)) or "*",
                                     callback)
    end
end


-- held strongly, as resty.events.compat does: code written for it may
-- keep no other reference to a handler
_M.register_weak = _M.register


-- unregister(callback): removes every subscription of callback
function _M.unregister(callback)
    local ids = handlers[callback]
    if type(ids) ~= "table" then
        return
    end
    handlers[callback] = nil
    for i = 1, #ids do
        ev:unsubscribe(ids[i])
    end
end


-- runs the handlers of the events already received; "done" (or
-- "recursive" from a handler), also before configure() as in the peer
function _M.poll()
    local bus = ev and ev.bus
    if bus then
        return bus:poll()
    end
    return "done"
end


return _M
