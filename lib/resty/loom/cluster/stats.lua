-- The cluster's counters, in the node's shared dict (every worker adds to
-- them, stats() reads them), and its log lines about repeated failures: at
-- most one of a kind per LOG_EVERY seconds.


local ngx_now = ngx.now
local ngx_log = ngx.log

local LOG_TAG = "[loom.cluster] "
local LOG_EVERY = 10              -- seconds between two alike log lines
local COUNTERS = {
    "published", "rejected", "sent", "send_errors", "redis_down",
    "dropped_at_exit", "read", "read_errors", "delivered", "duplicates",
    "undecodable", "acked", "ack_timeouts", "dead_letters", "trimmed",
    "claimed", "resyncs", "groups_removed", "reader_elections",
    "marks_loaded",
}


local _M = { _VERSION = "0.2.0" }

_M.COUNTERS = COUNTERS


local function count(self, name, n)
    self.dict:incr("s:" .. name, n or 1, 0)
end


-- at most one line per kind and LOG_EVERY seconds, with how many were
-- held back
local function log_throttled(self, level, kind, msg)
    local t = self.logged[kind]
    local now = ngx_now()
    if t and now - t[1] < LOG_EVERY then
        t[2] = t[2] + 1
        return
    end
    local held = t and t[2] or 0
    self.logged[kind] = { now, 0 }
    ngx_log(level, LOG_TAG, msg, held > 0
            and (" (" .. held .. " more since the last line)") or "")
end


_M.count = count
_M.log_throttled = log_throttled


return _M
