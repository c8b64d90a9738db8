-- lua-resty-events' resty.events.disable_listening: disable("unix:/path")
-- stops this worker from accepting on that `listen unix:` socket (the
-- other workers still accept). Returns true, or nil and
-- "failed to disable listening: <name>" when no such listener exists.


local ffi = require "ffi"
require "resty.loom.events"     -- declares the C functions

local C = ffi.C
local type = type
local tostring = tostring
local str_sub = string.sub

-- a worker id no worker has: every worker calling it lets go
local NOBODY = -2

local matched = ffi.new("int[1]")
local errmsg = ffi.new("char *[1]")


return function(name)
    local failed = "failed to disable listening: " .. tostring(name)
    if type(name) ~= "string" or str_sub(name, 1, 5) ~= "unix:" then
        return nil, failed
    end
    local path = str_sub(name, 6)
    if C.ngx_loom_ffi_pin_listener(path, #path, NOBODY, matched, errmsg) ~= 0
       or matched[0] == 0
    then
        return nil, failed
    end
    return true
end
