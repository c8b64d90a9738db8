-- Handlers for the compat tests: each call is one error-log line, as the
-- peers' own tests log them, so a test reads the order of calls from the
-- log.
local _M = {}


local function show(data)
    if type(data) == "string" and #data > 64 then
        return "#" .. #data
    end
    return tostring(data)
end


-- handler(tag) logs "compat-handler: <tag> source=.., event=.., who=..,
-- by=<worker id>, data=..;"
function _M.handler(tag)
    return function(data, event, source, who)
        ngx.log(ngx.NOTICE, "compat-handler: ", tag, " source=", source,
                ", event=", event, ", who=", tostring(who), ", by=",
                tostring(ngx.worker.id()), ", data=", show(data), ";")
    end
end


-- the error of a call returning ok, err, as the peers' tests print it
function _M.err(_, err)
    return tostring(err)
end


return _M
