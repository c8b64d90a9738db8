-- The gateway's use of resty.loom.events: configuration replicated to every
-- worker, and the bus's statistics.

local reply = require("gateway.json").reply
local events = require "resty.loom.events"

local _M = {}

-- this worker's copy of the configuration: key -> { value, version }
local config = {}


function _M.init()
    events.new({
        socket = ngx.config.prefix() .. "sock/bus.sock",
        overflow = "wait",
    })
end


function _M.init_worker()
    local bus = events.get()
    local ok, err = bus:init_worker()
    if not ok then
        ngx.log(ngx.ERR, "[gateway] events: ", err)
        return
    end
    bus:subscribe("config", "set", function(data)
        local cur = config[data.key]
        -- versions only go up, whatever order two writers' events take
        if not cur or cur.version < data.version then
            config[data.key] = { value = data.value,
                                 version = data.version }
        end
    end)
end


function _M.config()
    local key = ngx.var.config_key
    local method = ngx.req.get_method()
    if method == "PUT" then
        ngx.req.read_body()
        local value = ngx.req.get_body_data() or ""
        local version, err = ngx.shared.gateway_config:incr(key, 1, 0)
        if not version then
            return reply(500, { error = err })
        end
        local ok
        ok, err = events.get():publish("all", "config", "set",
            { key = key, value = value, version = version })
        if not ok then
            return reply(503, { error = err })
        end
        return reply(200, { key = key, version = version })
    elseif method == "GET" then
        local cur = config[key]
        if not cur then
            return reply(404, { key = key, worker = ngx.worker.id() })
        end
        return reply(200, { key = key, value = cur.value,
                            version = cur.version,
                            worker = ngx.worker.id() })
    end
    return reply(405, { error = "use GET or PUT" })
end


return _M
