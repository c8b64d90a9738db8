-- The bus client's log lines: prefixed "[loom.events] "; warnings of
-- what may repeat at full rate (gaps, drops, an unreachable broker) at
-- most once every LOG_INTERVAL s each.


local ngx = ngx
local ngx_log = ngx.log
local ngx_now = ngx.now

local WARN = ngx.WARN

local LOG_INTERVAL = 10


local _M = { _VERSION = "0.2.0" }


local function log(level, ...)
    ngx_log(level, "[loom.events] ", ...)
end
_M.log = log


function _M.warn_once(self, what, ...)
    local now = ngx_now()
    if now - (self.last_warn[what] or 0) >= LOG_INTERVAL then
        self.last_warn[what] = now
        log(WARN, ...)
    end
end


return _M
