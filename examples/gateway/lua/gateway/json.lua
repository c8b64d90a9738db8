-- The gateway's one way to answer with JSON.

local cjson = require "cjson.safe"

local _M = {}


function _M.reply(status, body)
    ngx.status = status
    ngx.header["Content-Type"] = "application/json"
    ngx.say(cjson.encode(body))
end


return _M
