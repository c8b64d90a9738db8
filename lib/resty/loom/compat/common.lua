-- What both compatibility modules need beyond the bus: marking events a
-- worker posts to itself (the peers give their handlers no origin for
-- those), and running a callback the way the peers do, logging a failure
-- with their message.


local cjson = require "cjson.safe"
local on_error = require("resty.loom.error_handler").handler

local type = type
local pairs = pairs
local xpcall = xpcall
local tostring = tostring
local setmetatable = setmetatable
local getmetatable = getmetatable
local ngx_log = ngx.log
local ERR = ngx.ERR
local WARN = ngx.WARN


local _M = { _VERSION = "0.2.0" }

-- "current" events travel by reference inside the worker, so a metatable
-- marks them
local LOCAL = {}


function _M.local_event(data)
    return setmetatable({ data }, LOCAL)
end


-- the data of an event, and whether it was posted locally
function _M.unwrap(data)
    if type(data) == "table" and getmetatable(data) == LOCAL then
        return data[1], true
    end
    return data, false
end


-- warns of each field of opts that known does not hold: the peers ignore
-- them, so code written for them still starts, but a misspelt option
-- should not go unseen
function _M.warn_unknown(module, opts, known)
    for k in pairs(opts) do
        if not known[k] then
            ngx_log(WARN, "[loom.compat] ", module, ": opts.", tostring(k),
                    " is not an option (ignored)")
        end
    end
end


-- event data in a log line: a table as JSON (or why it cannot be)
local function shown(data)
    if type(data) ~= "table" then
        return tostring(data)
    end
    local json, err = cjson.encode(data)
    return json or tostring(err)
end


-- calls handler(data, event, source, who); on error logs the peers'
-- line, who_name being "wid" or "pid"
function _M.call(handler, who_name, data, event, source, who)
    local ok, err = xpcall(handler, on_error, data, event, source, who)
    if not ok then
        ngx_log(ERR, "worker-events: event callback failed; source=", source,
                ", event=", event, ", ", who_name, "=", tostring(who),
                " error='", tostring(err), "', data=", shown(data))
    end
end


return _M
