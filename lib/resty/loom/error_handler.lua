-- The message handler user callbacks run under (xpcall(fn, handler, ...)):
-- the error as text, then the traceback from the frame that raised it. An
-- error value that is a table without __tostring is shown as JSON, since
-- "table: 0x..." says nothing.


local ok_cjson, cjson = pcall(require, "cjson.safe")

local type = type
local tostring = tostring
local getmetatable = getmetatable
local traceback = debug.traceback
local json_encode = ok_cjson and cjson.encode or nil


-- an error value as text
local function describe(err)
    if type(err) == "string" then
        return err
    end
    if type(err) == "table" and json_encode then
        local mt = getmetatable(err)
        if not (mt and mt.__tostring) then
            local s = json_encode(err)
            if s then
                return s
            end
        end
    end
    return tostring(err)
end


local _M = { _VERSION = "0.2.0" }


-- (level 2: the traceback starts below this handler)
function _M.handler(err)
    return traceback(describe(err), 2)
end


return _M
