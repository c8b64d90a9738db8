-- The gateway's use of resty.loom.events: configuration replicated to every
-- worker, and the bus's statistics.
--
-- The configuration outlives reloads (HUP) and restarts: worker 0 writes
-- it to <prefix>/state/config.json after each change it receives (a new
-- file renamed over the old), and every worker starts from that file.

local cjson = require "cjson.safe"
local api = require "gateway.json"
local events = require "resty.loom.events"

local reply = api.reply

local _M = {}

-- this worker's copy of the configuration: key -> { value, version }
local config = {}


local function state_file()
    return ngx.config.prefix() .. "state/config.json"
end


local function load()
    local f = io.open(state_file(), "rb")
    if not f then
        return {}
    end
    local saved, err = cjson.decode(f:read("*a") or "")
    f:close()
    if type(saved) ~= "table" then
        ngx.log(ngx.ERR, "[gateway] ignoring ", state_file(), ": ",
                err or "not an object")
        return {}
    end
    return saved
end


local function save()
    local path = state_file()
    local tmp = path .. "." .. ngx.worker.pid()
    local f, err = io.open(tmp, "wb")
    if f then
        local ok
        ok, err = f:write(cjson.encode(config))
        f:close()
        if ok then
            ok, err = os.rename(tmp, path)
            if ok then
                return
            end
        end
        os.remove(tmp)
    end
    ngx.log(ngx.ERR, "[gateway] failed to save the configuration: ", err)
end


function _M.init()
    events.new({
        socket = ngx.config.prefix() .. "sock/bus.sock",
        overflow = "wait",
        max_payload = 8 * 1024 * 1024,  -- a 4 MiB value (client_max_body_size)
    })
    -- versions go on from the saved ones (the dict also outlives a HUP)
    local versions = ngx.shared.gateway_config
    for key, cur in pairs(load()) do
        if (versions:get(key) or 0) < cur.version then
            versions:set(key, cur.version)
        end
    end
end


function _M.init_worker()
    config = load()
    local bus = events.get()
    local ok, err = bus:init_worker()
    if not ok then
        ngx.log(ngx.ERR, "[gateway] events: ", err)
        return
    end
    local saver = ngx.worker.id() == 0
    bus:subscribe("config", "set", function(data)
        local cur = config[data.key]
        -- versions only go up, whatever order two writers' events take
        if not cur or cur.version < data.version then
            config[data.key] = { value = data.value,
                                 version = data.version }
            if saver then
                save()
            end
        end
    end)
end


function _M.config()
    local key = ngx.var.config_key
    if ngx.req.get_method() == "PUT" then
        local value, err = api.body()
        if not value then
            return reply(500, { error = err })
        end
        local version
        version, err = ngx.shared.gateway_config:incr(key, 1, 0)
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
    end
    local cur = config[key]
    if not cur then
        return reply(404, { error = "no such key", key = key,
                            worker = ngx.worker.id() })
    end
    return reply(200, { key = key, value = cur.value,
                        version = cur.version,
                        worker = ngx.worker.id() })
end


return _M
