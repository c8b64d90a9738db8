-- Records what compat-API handlers receive, per worker.
local cjson = require "cjson.safe"

local _M = { got = {}, calls = 0 }

function _M.record(tag)
    return function(data, event, source, who)
        _M.calls = _M.calls + 1
        local k = tag .. "|" .. source .. "|" .. event
        local e = _M.got[k] or { n = 0 }
        e.n = e.n + 1
        e.last = data
        e.who = who
        _M.got[k] = e
    end
end

function _M.state()
    return { worker = ngx.worker.id(), pid = ngx.worker.pid(),
             got = _M.got, calls = _M.calls }
end

function _M.say()
    ngx.say(cjson.encode(_M.state()))
end

return _M
