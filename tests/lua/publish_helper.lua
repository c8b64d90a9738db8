-- Test helper for resty.loom.publish: builds one publisher per worker from a
-- JSON config and records its callbacks in lua_shared_dict pubtest.


local cjson = require "cjson.safe"
local publish = require "resty.loom.publish"

local _M = {}

local p


local function record(kind, value)
    local shm = ngx.shared.pubtest
    local n = shm:incr(kind .. ":n", 1, 0)
    shm:set(kind .. ":" .. n, cjson.encode(value))
end


function _M.init_worker(conf_json)
    local conf = assert(cjson.decode(conf_json))
    local shm = ngx.shared.pubtest
    local record_ids = conf.record_ids
    -- err_file: on_error also appends a JSON line per call to
    -- <err_file>.<pid>, which outlives nginx (the shared dict does not)
    local err_file = conf.err_file
    conf.on_success = function(ids, info)
        shm:incr("ok_ids", #ids, 0)
        shm:incr("ok_batches", 1, 0)
        if record_ids then
            record("ids", { ids = ids, key = info.ordering_key })
        end
    end
    conf.on_error = function(msgs, reason, info)
        shm:incr("err_msgs", #msgs, 0)
        local datas = {}
        for i = 1, #msgs do
            datas[i] = msgs[i].data
        end
        local entry = { reason = reason, status = info.status,
                        attempts = info.attempts, key = info.ordering_key,
                        datas = datas,
                        attrs = msgs[1] and msgs[1].attributes }
        record("err", entry)
        if err_file then
            local f = assert(io.open(err_file .. "." .. ngx.worker.pid(),
                                     "a"))
            f:write(cjson.encode(entry), "\n")
            f:close()
        end
    end
    conf.record_ids = nil
    conf.err_file = nil
    local err
    p, err = publish.new(conf)
    if not p then
        ngx.log(ngx.ERR, "publish_helper: ", err)
    end
end


function _M.publisher()
    return p
end


-- POST /send {"count":N,"prefix":"x","size":S,"attrs":{},"keys":[..]}
-- or {"messages":[{"data":..,"attributes":..,"key":..}]}
function _M.send()
    ngx.req.read_body()
    local req = assert(cjson.decode(ngx.req.get_body_data()))
    local ok, errs = 0, {}
    local function one(data, attrs, key)
        local r, err = p:send(data, attrs, key)
        if r then
            ok = ok + 1
        else
            errs[err] = (errs[err] or 0) + 1
        end
    end
    if req.messages then
        for _, m in ipairs(req.messages) do
            one(m.data, m.attributes, m.key)
        end
    else
        local keys = req.keys
        local size = req.size or 0
        for i = 1, req.count do
            local data = string.format("%s-%08d-", req.prefix, i)
            if #data < size then
                data = data .. string.rep("x", size - #data)
            end
            local key = keys and keys[(i - 1) % #keys + 1] or nil
            if key == "" then
                key = nil
            end
            one(data, req.attrs, key)
        end
    end
    ngx.say(cjson.encode({ ok = ok, errors = errs,
                           worker = ngx.worker.id() }))
end


function _M.results()
    local shm = ngx.shared.pubtest
    local out = {
        ok_ids = shm:get("ok_ids") or 0,
        ok_batches = shm:get("ok_batches") or 0,
        err_msgs = shm:get("err_msgs") or 0,
        errors = {},
        ids = {},
    }
    for i = 1, shm:get("err:n") or 0 do
        out.errors[i] = cjson.decode(shm:get("err:" .. i))
    end
    for i = 1, shm:get("ids:n") or 0 do
        out.ids[i] = cjson.decode(shm:get("ids:" .. i))
    end
    ngx.say(cjson.encode(out))
end


function _M.stats()
    ngx.say(cjson.encode(p:stats()))
end


return _M
