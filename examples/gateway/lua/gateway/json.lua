-- The gateway API's conventions: answers are JSON, errors are
-- {"error": "..."} with their status (nginx's own errors included, through
-- error_page), each endpoint names the methods it takes (405 with Allow
-- otherwise), and request bodies are read whole, from memory or from the
-- temporary file nginx wrote them to.

local cjson = require "cjson.safe"

local io_open = io.open
local ngx_req = ngx.req

local _M = {}

-- nginx's error statuses that error_page sends to _M.error_page()
local REASONS = {
    [400] = "bad request",
    [403] = "forbidden",
    [404] = "not found",
    [405] = "method not allowed",
    [408] = "request timeout",
    [413] = "request body too large",
    [414] = "request URI too long",
    [500] = "internal server error",
    [502] = "bad gateway",
    [503] = "service unavailable",
    [504] = "gateway timeout",
}


function _M.reply(status, body)
    ngx.status = status
    ngx.header["Content-Type"] = "application/json"
    ngx.say(cjson.encode(body))
end


-- the content of the `error_page ... @json_error` location
function _M.error_page()
    local status = ngx.status
    _M.reply(status, { error = REASONS[status] or "error " .. status })
end


-- access phase: `allow("GET")`, `allow("GET, PUT")`; GET takes HEAD too
function _M.allow(methods)
    local method = ngx_req.get_method()
    if methods:find(method, 1, true)
       or (method == "HEAD" and methods:find("GET", 1, true)) then
        return
    end
    ngx.header["Allow"] = methods
    _M.reply(405, { error = "method not allowed: use " .. methods })
    return ngx.exit(405)
end


-- the whole request body ("" for none); nginx keeps a body larger than
-- client_body_buffer_size in a temporary file
function _M.body()
    ngx_req.read_body()
    local data = ngx_req.get_body_data()
    if data then
        return data
    end
    local path = ngx_req.get_body_file()
    if not path then
        return ""
    end
    local f, err = io_open(path, "rb")
    if not f then
        return nil, "failed to open the request body: " .. err
    end
    data = f:read("*a")
    f:close()
    return data
end


return _M
