-- The example gateway's one view of every worker (resty.loom.status):
-- GET /loom/status (JSON), /loom/metrics (Prometheus), /loom/ (the
-- dashboard) and the per-module /loom/events, /loom/timers,
-- /loom/offload, /loom/blocking, /loom/publish.


local reply = require("gateway.json").reply
local status = require "resty.loom.status"
local prometheus = require "resty.loom.status.prometheus"

local MAX_TIMEOUT = 5

local _M = {}


function _M.init()
    status.register_collector()
end


function _M.init_worker()
    status.init_worker()
end


local function collect()
    local t = tonumber(ngx.var.arg_timeout)
    if not t or t ~= t or t <= 0 then
        t = nil
    end
    return status.collect(t and math.min(t, MAX_TIMEOUT))
end


-- GET /loom/status, or one module's part of it (module absent: all)
function _M.serve(module)
    local doc = collect()
    if module then
        doc = status.only(doc, module)
    end
    reply(200, doc)
end


function _M.metrics()
    local text = prometheus.render(collect())
    ngx.header["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8"
    ngx.print(text)
end


function _M.page()
    local html, err = status.page()
    if not html then
        return reply(500, { error = err })
    end
    ngx.header["Content-Type"] = "text/html; charset=utf-8"
    ngx.print(html)
end


return _M
