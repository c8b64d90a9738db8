-- Test helpers for resty.loom.offload (tests/test_offload_*.py).


local offload = require "resty.loom.offload"
local cjson = require "cjson.safe"


local _M = { rt = {} }


-- init_worker: loads runtime "name" (default "main")
function _M.load(path, config, opts, name)
    local rt, err = offload.load(path, config, opts)
    if not rt then
        ngx.log(ngx.ERR, "offload_t: ", err)
        return
    end
    _M.rt[name or "main"] = rt
end


local function get_rt()
    local name = ngx.var.arg_rt or "main"
    local rt = _M.rt[name]
    if not rt then
        ngx.status = 500
        ngx.say("no runtime ", name)
        return ngx.exit(500)
    end
    return rt
end


-- GET /call?p=<payload>&t=<timeout>  or  POST /call with the payload
-- answers 200 <result>, or 502 <err>
function _M.call()
    local rt = get_rt()
    local p = ngx.var.arg_p
    if not p then
        ngx.req.read_body()
        p = ngx.req.get_body_data() or ""
    else
        p = ngx.unescape_uri(p)
    end
    local t = tonumber(ngx.var.arg_t)
    local res, err = rt:call(p, t and { timeout = t } or nil)
    if not res then
        ngx.status = 502
        ngx.print(err)
        return
    end
    ngx.print(res)
end


function _M.stats()
    local rt = get_rt()
    ngx.say(cjson.encode(rt:stats()))
end


-- runs n calls of payload p from c light threads; reports counts as JSON
function _M.many()
    local rt = get_rt()
    local n = tonumber(ngx.var.arg_n) or 1000
    local c = tonumber(ngx.var.arg_c) or n
    local p = ngx.unescape_uri(ngx.var.arg_p or "echo x")
    local per = math.ceil(n / c)
    local out = { ok = 0, errors = {}, bad = 0 }
    local function run(id)
        for i = 1, per do
            local k = (id - 1) * per + i
            if k > n then return end
            local q = p == "echo" and ("echo " .. k) or p
            local res, err = rt:call(q)
            if res then
                out.ok = out.ok + 1
                if p == "echo" and res ~= tostring(k) then
                    out.bad = out.bad + 1
                end
            else
                out.errors[err] = (out.errors[err] or 0) + 1
            end
        end
    end
    local threads = {}
    for id = 1, c do
        threads[id] = ngx.thread.spawn(run, id)
    end
    for id = 1, c do
        ngx.thread.wait(threads[id])
    end
    ngx.say(cjson.encode(out))
end


return _M
