-- The example gateway's publisher: one topic on the Pub/Sub emulator named
-- by PUBSUB_EMULATOR_HOST (the topic is created at start). Without the
-- variable the gateway runs and GET /loom/publish says publishing is off.
-- What it accepts is in a spool, <prefix>/spool, before send() returns
-- (spool_mode "always"): a stop, a reload or a crashed worker loses none
-- of it, the next worker sends it.


local cjson = require "cjson.safe"
local api = require "gateway.json"
local http = require "resty.loom.http"
local publish = require "resty.loom.publish"

local str_sub = string.sub

local PROJECT = "loom-gateway"
local TOPIC = "gateway-requests"

local _M = {}

local emulator = os.getenv("PUBSUB_EMULATOR_HOST")
if emulator == "" then
    emulator = nil
end

local p
local off_reason = "PUBSUB_EMULATOR_HOST is not set: publishing is off"


local function create_topic(premature)
    if premature then
        return
    end
    local res, err = http.request_uri("http://" .. emulator .. "/v1/projects/"
        .. PROJECT .. "/topics/" .. TOPIC, {
            method = "PUT", body = "{}", timeout = 5,
            headers = { ["Content-Type"] = "application/json" },
        })
    if not res then
        ngx.log(ngx.WARN, "[gateway.publish] cannot create topic: ", err)
    elseif res.status ~= 200 and res.status ~= 409 then
        ngx.log(ngx.WARN, "[gateway.publish] cannot create topic: status ",
                res.status)
    end
end


function _M.init_worker()
    if not emulator then
        ngx.log(ngx.NOTICE, "[gateway.publish] ", off_reason)
        return
    end
    local opts = {
        project = PROJECT,
        topic = TOPIC,
        emulator_host = emulator,
        batch_max_delay = 0.05,
        spool = ngx.config.prefix() .. "spool",
        spool_mode = "always",
        on_error = function(msgs, reason)
            ngx.log(ngx.WARN, "[gateway.publish] ", #msgs,
                    " messages failed: ", reason)
        end,
    }
    local err
    p, err = publish.new(opts)
    if not p then
        -- (run.sh makes the directory the workers'): publish from memory
        ngx.log(ngx.WARN, "[gateway.publish] ", err, "; no spool")
        opts.spool, opts.spool_mode = nil, nil
        p = publish.new(opts)
    end
    if ngx.worker.id() == 0 then
        ngx.timer.at(0, create_topic)
    end
end


local function message()
    local attrs = {
        method = ngx.req.get_method(),
        path = ngx.var.uri,
        worker = tostring(ngx.worker.id()),
    }
    local ua = ngx.var.http_user_agent
    if ua and #ua <= 1024 then
        attrs.user_agent = ua
    end
    return attrs
end


-- for log_by_lua: one message per request, never blocking the request
-- (the publish endpoints publish their own message)
function _M.log()
    local uri = ngx.var.uri
    if p and str_sub(uri, 1, 13) ~= "/loom/publish" then
        p:send(ngx.var.request_uri or uri, message())
    end
end


function _M.send()
    if not p then
        return api.reply(503, { error = "publishing is off",
                                enabled = false, reason = off_reason })
    end
    local body, err = api.body()
    if not body then
        return api.reply(500, { error = err })
    end
    if body == "" then
        body = ngx.var.request_uri
    end
    local ok
    ok, err = p:send(body, message())
    ngx.status = ok and 202 or 400
    ngx.say(cjson.encode({ queued = ok or false, error = err }))
end


return _M
