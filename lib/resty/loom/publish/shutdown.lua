-- What becomes of the messages a publisher still holds when its worker
-- exits: given up when the flush budget is spent, handed to on_error by
-- publish.exit_worker(), and logged at VM close when nothing reported them.


local buffer = require "resty.loom.publish.buffer"
local report = require "resty.loom.publish.report"
local spool = require "resty.loom.publish.spool"
local at_close = require "resty.loom.at_close"

local ngx_log = ngx.log
local ngx_ERR = ngx.ERR
local fail_queued = buffer.fail_queued
local report_failure = report.failure
local pairs = pairs
local setmetatable = setmetatable
local concat = table.concat

local LOG_TAG = "[loom.publish] "

-- every publisher of this worker that may hold messages, for exit_worker()
local living = setmetatable({}, { __mode = "k" })


local _M = { _VERSION = "0.2.0" }


-- reports and forgets everything still buffered (exit budget spent)
local function abandon(self)
    local lost = 0
    for _, q in pairs(self.queues) do
        lost = lost + fail_queued(self, q,
                                  "worker exiting: flush budget spent")
    end
    return lost
end


-- Reports and forgets everything this publisher still holds, queued or in
-- flight. For exit_worker(): nothing can be sent any more.
local function report_at_exit(self)
    if self.spool then
        -- written to the spool (reported when it cannot)
        if not self.closed then
            spool.keep(self)
        end
        return
    end
    local queued, unconfirmed = 0, 0
    for _, q in pairs(self.queues) do
        queued = queued + fail_queued(self, q, "worker exiting: not sent")
    end
    for b in pairs(self.sending) do
        self.sending[b] = nil
        unconfirmed = unconfirmed + b.n
        self.inflight_messages = self.inflight_messages - b.n
        self.inflight_bytes = self.inflight_bytes - b.bytes
        report_failure(self, b.q, b.body, b.n,
                       "worker exiting: sent, delivery not confirmed", 0, nil)
        b.body = nil
    end
    self.closed = true
    if queued + unconfirmed > 0 then
        ngx_log(ngx_ERR, LOG_TAG, self.name, ": ", queued + unconfirmed,
                " messages not delivered at worker exit (", queued,
                " not sent, ", unconfirmed, " sent but not confirmed)")
    end
end


-- At VM close (see resty.loom.at_close): what every publisher still holds
-- then is exactly what no report covered (publish.exit_worker() not
-- called, or worker_shutdown_timeout cut the drain).
local function unreported_at_close()
    local n = 0
    local names = {}
    for p in pairs(living) do
        local held = p.queued_messages + p.inflight_messages
        if p.spool then
            -- those in its files are not lost
            held = held - spool.in_files(p)
        end
        if held > 0 then
            n = n + held
            names[#names + 1] = p.name
        end
    end
    if n > 0 then
        return "error", concat({
            LOG_TAG, n, " messages lost at worker exit without a report (",
            concat(names, ", "), "): call ",
            "require(\"resty.loom.publish\").exit_worker() in ",
            "exit_worker_by_lua_block" })
    end
end


-- watches publisher p: exit_worker() reports what it holds
function _M.add(p)
    living[p] = true
    at_close.register(unreported_at_close)
end


function _M.exit_worker()
    for p in pairs(living) do
        report_at_exit(p)
    end
end


_M.abandon = abandon


return _M
