-- lua-resty-worker-events' API (resty.worker.events 2.x) on top of
-- resty.loom.events, so code written for it runs unchanged: the same
-- options and messages, handler arguments (data, event, source, pid),
-- handler order and unique-event claims in the shared dict. The bus is
-- created in init_by_lua with resty.loom.events.new() (it needs its
-- `listen unix:` server); configure() connects this worker to it.
-- Differences are listed in docs/events.md, "Compatibility".


local events = require "resty.loom.events"
local common = require "resty.loom.compat.common"

local type = type
local error = error
local select = select
local ipairs = ipairs
local tostring = tostring
local setmetatable = setmetatable
local unpack = unpack
local huge = math.huge
local traceback = debug.traceback
local ngx_log = ngx.log
local ERR = ngx.ERR
local DEBUG = ngx.DEBUG
local local_event = common.local_event
local unwrap = common.unwrap
local call = common.call

local KEY_ONE = "events-one:"           -- shm key claiming a unique event
-- the field of the table a unique event travels in
local UNIQUE = "\0resty-worker-events.unique"

-- seconds: less than the bus's exit watch (365 days), so it fires first
local STOPPING_WATCH = 300 * 86400

-- a level's handler lists, in calling order, and their counts
local KINDS = { "weak", "strong" }
local COUNTS = { "nweak", "nstrong" }


local _M = { _VERSION = "2.0.1" }

local bus
local dict                  -- the shm: configured once set
local settings = {}         -- the options configure() accepted

-- handlers: a level holds weak and strong lists (called in that order)
-- and, below it, the levels of each source, then of each event
local function new_level()
    return {
        weak = setmetatable({}, { __mode = "v" }), nweak = 0,
        strong = {}, nstrong = 0,
        subs = {},
    }
end

local root = new_level()


local function level(source, event)
    local l = root
    for _, key in ipairs({ source, event }) do
        local sub = l.subs[key]
        if not sub then
            sub = new_level()
            l.subs[key] = sub
        end
        l = sub
    end
    return l
end


-- calls the handlers of a level, weak ones first; removed or collected
-- handlers leave a hole that the last one fills, as in worker-events
local function run_level(l, data, event, source, pid)
    if not l then
        return
    end
    for k = 1, 2 do
        local kind, count = KINDS[k], COUNTS[k]
        local list = l[kind]
        local i = 1
        while i <= l[count] do
            local fn = list[i]
            if type(fn) ~= "function" then
                list[i] = list[l[count]]
                list[l[count]] = nil
                l[count] = l[count] - 1
            else
                call(fn, "pid", data, event, source, pid)
                i = i + 1
            end
        end
    end
end


local function run_handlers(source, event, data, pid)
    ngx_log(DEBUG, "worker-events: handling event; source=", source,
            ", event=", event, ", pid=", pid)
    run_level(root, data, event, source, pid)
    local by_source = root.subs[source]
    if by_source then
        run_level(by_source, data, event, source, pid)
        run_level(by_source.subs[event], data, event, source, pid)
    end
end


-- a unique event runs in the worker that claims it first, for
-- settings.timeout seconds, as worker-events does with its shm
local function claim(unique)
    local key = KEY_ONE .. tostring(unique)
    local ok, err = dict:add(key, ngx.worker.pid(), settings.timeout)
    if ok then
        return true
    end
    if err == "exists" then
        ngx_log(DEBUG, "worker-events: skipping event ", tostring(unique),
                " was handled by worker ", tostring(dict:get(key)))
    else
        ngx_log(ERR, "worker-events: cannot determine who handles event ",
                tostring(unique), ", dropping it: ", err)
    end
    return false
end


local function on_event(data, event, source, _, pid)
    local d, is_local = unwrap(data)
    if is_local then
        pid = nil
    elseif type(d) == "table" and d[UNIQUE] ~= nil then
        if not claim(d[UNIQUE]) then
            return
        end
        d = d.data
    end
    return run_handlers(source, event, d, pid)
end


local function check_name(source, event)
    if type(source) ~= "string" or source == "" then
        return nil, "source is required"
    end
    if type(event) ~= "string" or event == "" then
        return nil, "event is required"
    end
    return true
end


-- post(source, event, data, unique): to every worker, or, when unique is
-- given, run by the one worker that claims it first. Returns true or
-- nil, err.
function _M.post(source, event, data, unique)
    local ok, err = check_name(source, event)
    if not ok then
        return nil, err
    end
    if not bus or not dict then
        err = "not configured"
    else
        if unique ~= nil then
            data = { [UNIQUE] = unique, data = data }
        end
        ok, err = bus:publish("all", source, event, data)
    end
    if not ok then
        err = 'failed posting event "' .. event .. '" by "' .. source
              .. '"; ' .. tostring(err)
        ngx_log(ERR, "worker-events: ", traceback(err))
        return nil, err
    end
    return true
end


function _M.post_local(source, event, data)
    local ok, err = check_name(source, event)
    if not ok then
        return nil, err
    end
    if not bus or not dict then
        return nil, "not configured"
    end
    ok, err = bus:publish("current", source, event, local_event(data))
    if not ok then
        return nil, err
    end
    return true
end


-- Events are pushed to this worker as they come; poll() runs the
-- handlers of those already received right away. Returns "done" or
-- "recursive".
function _M.poll()
    if not bus or not dict then
        return nil, "not configured"
    end
    return bus:poll()
end


local function on_exit(premature)
    if premature then
        _M.post(_M.events._source, _M.events.stopping)
    end
end


-- configure()'s numbers in the order worker-events checks them: name,
-- default, whether 0 is refused, and what a value must be
local NUMBERS = {
    { "timeout", 2, true, "greater than 0" },
    { "interval", 1, false, "greater than or equal to 0" },
    { "wait_interval", 0.010, false, "greater than or equal to 0" },
    { "wait_max", 0.5, false, "greater than or equal to 0" },
    { "shm_retries", 999, false, "0 or greater" },
}


local KNOWN = { shm = true, debug = true }
for i = 1, #NUMBERS do
    KNOWN[NUMBERS[i][1]] = true
end


-- the options of configure() over those of the last one and the
-- defaults; nil and worker-events' message for the first bad one. NaN and
-- infinities, which it takes, are refused too: a timeout of either claims
-- a unique event in the shm for ever (the shm's exptime turns negative).
local function numbers(opts)
    local new = {}
    for i = 1, #NUMBERS do
        local name, default, positive, must_be = unpack(NUMBERS[i])
        local v = opts[name] or settings[name] or default
        if type(v) ~= "number" then
            return nil, 'optional "' .. name .. '" option must be a number'
        end
        if v ~= v or v < 0 or (positive and v == 0) then
            return nil, '"' .. name .. '" must be ' .. must_be
        end
        if v == huge then
            return nil, '"' .. name .. '" must be a finite number'
        end
        new[name] = v
    end
    return new
end


-- configure(opts): shm (required the first time), timeout, interval,
-- wait_interval, wait_max, shm_retries, debug; validated as
-- worker-events does. Connects this worker to the bus.
function _M.configure(opts)
    if type(opts) ~= "table" then
        error("Expected a table, got " .. type(opts), 2)
    end
    local shm = opts.shm
    if shm and dict then
        return nil, "Already started, cannot change shm"
    end
    if not (shm or dict) then
        return nil, '"shm" option required to start'
    end
    local d = dict
    if shm then
        d = ngx.shared[shm]
        if not d then
            return nil, 'shm "' .. tostring(shm) .. '" not found'
        end
    end

    local new, err = numbers(opts)
    if not new then
        return nil, err
    end
    common.warn_unknown("resty.worker.events", opts, KNOWN)

    local b = events.get()
    if not b then
        return nil, "failed to configure: no resty.loom.events bus; create "
                    .. "one with resty.loom.events.new() in init_by_lua"
    end
    local ok
    ok, err = b:init_worker()
    if not ok then
        return nil, err
    end
    local started = dict ~= nil
    if bus ~= b then
        b:subscribe("*", "*", on_event)
        bus = b
    end
    dict = d
    settings = new
    if not started then
        -- a timer far in the future fires early (premature) at worker
        -- exit, before the bus's own, which then still sends what it has
        ok, err = ngx.timer.at(STOPPING_WATCH, on_exit)
        if not ok then
            return nil, "failed to create timer: " .. err
        end
        -- every worker learns that this one is up
        ok, err = _M.post(_M.events._source, _M.events.started)
        if not ok then
            return nil, err
        end
    end
    return true
end


function _M.configured()
    return dict ~= nil
end


local function check_callback(callback)
    if type(callback) ~= "function" then
        error("expected function, got: " .. type(callback), 3)
    end
end


local function add(l, kind, callback)
    local count = "n" .. kind
    local n = l[count] + 1
    l[count] = n
    l[kind][n] = callback
end


local function register(kind, callback, source, ...)
    check_callback(callback)
    local n = select("#", ...)
    if not source then
        add(root, kind, callback)
    elseif n == 0 then
        add(level(source), kind, callback)
    else
        for i = 1, n do
            add(level(source, (select(i, ...))), kind, callback)
        end
    end
end


-- register(callback [, source [, event, ...]]): callback(data, event,
-- source, pid) for every event, those of a source, or the events named
function _M.register(callback, source, ...)
    register("strong", callback, source, ...)
end


-- as register(), holding the callback weakly: once collected, it is no
-- longer called
function _M.register_weak(callback, source, ...)
    register("weak", callback, source, ...)
end


local function remove(l, callback)
    local removed = false
    for k = 1, 2 do
        local list = l[KINDS[k]]
        for i = 1, l[COUNTS[k]] do
            if list[i] == callback then
                list[i] = nil
                removed = true
            end
        end
    end
    return removed
end


-- unregister(callback [, source [, event, ...]]): removes the
-- registration made with the same level; true if anything was removed
function _M.unregister(callback, source, ...)
    check_callback(callback)
    local n = select("#", ...)
    local removed = false
    if not source then
        removed = remove(root, callback)
    elseif n == 0 then
        removed = remove(level(source), callback)
    else
        for i = 1, n do
            if remove(level(source, (select(i, ...))), callback) then
                removed = true
            end
        end
    end
    return removed
end


-- an event list raises on a name it does not hold (a misspelt event)
local UNKNOWN_EVENT = {
    __index = function(_, key)
        error("event '" .. tostring(key) .. "' is an unknown event", 2)
    end,
}


-- event_list(source, name, ...): { _source = source, [name] = name, ... }
function _M.event_list(source, ...)
    local list = { _source = source }
    for i = 1, select("#", ...) do
        local name = select(i, ...)
        list[name] = name
    end
    return setmetatable(list, UNKNOWN_EVENT)
end


-- the library's own events: "started" posted by the first configure(),
-- "stopping" when the worker exits
_M.events = _M.event_list("resty-worker-events", "started", "stopping")


return _M
