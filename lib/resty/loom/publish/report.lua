-- What a publisher tells: the application through on_success and on_error
-- (run under xpcall), and the log while publishing fails (the first
-- failure at once, then one summary with counts per warn_interval).


local cjson = require "cjson.safe"
local error_handler = require("resty.loom.error_handler").handler

local ngx_now = ngx.now
local ngx_log = ngx.log
local ngx_ERR = ngx.ERR
local ngx_WARN = ngx.WARN
local decode_base64 = ngx.decode_base64
local json_decode = cjson.decode
local match = string.match
local floor = math.floor
local type = type
local pairs = pairs
local xpcall = xpcall
local concat = table.concat

local LOG_TAG = "[loom.publish] "


local _M = { _VERSION = "0.2.0" }


local function call(self, fn, ...)
    local ok, err = xpcall(fn, error_handler, ...)
    if not ok then
        ngx_log(ngx_ERR, LOG_TAG, self.name, ": callback failed: ", err)
    end
end


-- the messages of a request body, for the error callback
local function decode_messages(body)
    local t = json_decode(body)
    local msgs = type(t) == "table" and t.messages or {}
    for i = 1, #msgs do
        local m = msgs[i]
        m.data = m.data and decode_base64(m.data) or ""
        m.ordering_key = m.orderingKey
        m.orderingKey = nil
    end
    return msgs
end


local function report_failure(self, q, body, n, reason, attempts, status)
    self.failed = self.failed + n
    if type(body) == "table" then
        body = concat(body)
    end
    if self.on_error then
        call(self, self.on_error, decode_messages(body), reason, {
            topic = self.topic, ordering_key = q.key ~= "" and q.key or nil,
            attempts = attempts, status = status,
        })
    else
        ngx_log(ngx_ERR, LOG_TAG, self.name, ": ", n,
                " messages not delivered: ", reason)
    end
end


-- the kind of a failure, as counted in warnings: "status 503",
-- "failed to connect", ...
local function failure_kind(reason)
    return match(reason, "^status %d+") or match(reason, "^[^:(]+")
end


local function trouble_summary(t)
    local kinds = {}
    for k, c in pairs(t.kinds) do
        kinds[#kinds + 1] = k .. ": " .. c
    end
    return concat({ t.attempts, " failed attempts (", concat(kinds, ", "),
                    "), ", t.lost, " messages given up; last: ", t.last })
end


-- Logs trouble without flooding: the first failure after a quiet time at
-- once, then one summary with counts per warn_interval while failures go
-- on. lost: messages given up by this failure (0: it will be retried).
local function note_trouble(self, reason, lost)
    local now = ngx_now()
    local t = self.trouble
    if not t then
        self.trouble = {
            since = now, next_at = now + self.warn_interval,
            attempts = 0, lost = 0, kinds = {}, last = reason,
        }
        ngx_log(ngx_WARN, LOG_TAG, self.name, ": publish failed: ", reason,
                lost > 0 and (" (" .. lost .. " messages given up)")
                or " (retrying)")
        return
    end
    local kind = failure_kind(reason)
    t.attempts = t.attempts + 1
    t.lost = t.lost + lost
    t.kinds[kind] = (t.kinds[kind] or 0) + 1
    t.last = reason
    if now >= t.next_at then
        ngx_log(ngx_WARN, LOG_TAG, self.name, ": publish failing for ",
                floor(now - t.since), " s; in the last ",
                self.warn_interval, " s: ", trouble_summary(t))
        t.next_at = now + self.warn_interval
        t.attempts, t.lost, t.kinds = 0, 0, {}
    end
end


local function note_recovery(self)
    local t = self.trouble
    self.trouble = nil
    ngx_log(ngx_WARN, LOG_TAG, self.name, ": publish recovered after ",
            floor(ngx_now() - t.since), " s",
            t.attempts > 0 and ("; since the last warning: "
                                .. trouble_summary(t)) or "")
end


_M.call = call
_M.failure = report_failure
_M.note_trouble = note_trouble
_M.note_recovery = note_recovery


return _M
