-- Test helper shared by the Rust, Go and Python runtime tests
-- (tests/test_offload_{rust,go,python}.py): loads runtimes per worker and
-- serves a few locations that drive them.

local offload = require "resty.loom.offload"

local ngx_say = ngx.say
local ngx_print = ngx.print
local ngx_var = ngx.var
local spawn = ngx.thread.spawn
local wait = ngx.thread.wait
local tonumber = tonumber
local concat = table.concat

local runtimes = {}
local load_errors = {}

local _M = {}


-- init_worker: rt = offload.load(path, config, opts), kept under name
function _M.load(name, path, config, opts)
    local rt, err = offload.load(path, config, opts)
    if not rt then
        load_errors[name] = err
        return
    end
    runtimes[name] = rt
end


local function get(name)
    local rt = runtimes[name]
    if not rt then
        ngx.status = 500
        ngx_say("no runtime ", name, ": ", load_errors[name] or "not loaded")
        return ngx.exit(500)
    end
    return rt
end


-- GET /call?rt=<name>&p=<payload>&timeout=<s>, or POST with the payload
-- as body. 200 and the result bytes, or 500 and "ERR <err>".
function _M.call()
    local args = ngx.req.get_uri_args()
    local rt = get(args.rt)
    local payload = args.p
    if not payload then
        ngx.req.read_body()
        payload = ngx.req.get_body_data() or ""
    end
    local timeout = tonumber(args.timeout)
    local res, err = rt:call(payload, timeout and { timeout = timeout })
    if res == nil then
        ngx.status = 500
        return ngx_print("ERR ", err)
    end
    return ngx_print(res)
end


-- GET /many?rt=<name>&n=<calls>&op=<op>: n light threads each call
-- "<op>:<i>" (default echo) and check they got "<i>" back; prints
-- "ok=<n> bad=<n> errors=<err>,..." (first few errors only).
function _M.many()
    local args = ngx.req.get_uri_args()
    local rt = get(args.rt)
    local n = tonumber(args.n) or 1000
    local op = args.op or "echo"
    local timeout = tonumber(args.timeout)
    local opts = timeout and { timeout = timeout } or nil
    local threads = {}
    for i = 1, n do
        threads[i] = spawn(function()
            return rt:call(op .. ":" .. i, opts)
        end)
    end
    local ok, bad, errors = 0, 0, {}
    for i = 1, n do
        local _, res, err = wait(threads[i])
        if res == tostring(i) then
            ok = ok + 1
        else
            bad = bad + 1
            if #errors < 5 then
                errors[#errors + 1] = tostring(res) .. "/" .. tostring(err)
            end
        end
    end
    ngx_say("ok=", ok, " bad=", bad, " errors=", concat(errors, ","))
end


-- GET /burst?rt=<name>&n=<calls>&p=<payload>: n light threads each make
-- the same call; prints how often each result or error came back, as
-- "<count> <result or ERR err>" lines sorted by text.
function _M.burst()
    local args = ngx.req.get_uri_args()
    local rt = get(args.rt)
    local n = tonumber(args.n) or 10
    local payload = args.p
    local timeout = tonumber(args.timeout)
    local opts = timeout and { timeout = timeout } or nil
    local threads = {}
    for i = 1, n do
        threads[i] = spawn(function()
            return rt:call(payload, opts)
        end)
    end
    local counts = {}
    for i = 1, n do
        local _, res, err = wait(threads[i])
        local key = res or ("ERR " .. tostring(err))
        counts[key] = (counts[key] or 0) + 1
    end
    local keys = {}
    for k in pairs(counts) do
        keys[#keys + 1] = k
    end
    table.sort(keys)
    for _, k in ipairs(keys) do
        ngx_say(counts[k], " ", k)
    end
end


-- GET /soak?rt=<name>&n=<calls>&c=<threads>: n calls "echo:<i>", made
-- by c light threads (default 16) one after the other, each answer
-- checked; prints "ok=<n> bad=<n> first=<first error>".
local function soak_thread(rt, from, to, step)
    local buf = require("string.buffer").new()
    local ok, bad, first = 0, 0, nil
    for i = from, to, step do
        buf:reset():put("echo:", i)
        local res, err = rt:call(buf)
        if res and tonumber(res) == i then
            ok = ok + 1
        else
            bad = bad + 1
            first = first or tostring(res) .. "/" .. tostring(err)
        end
    end
    return ok, bad, first
end


function _M.soak()
    local args = ngx.req.get_uri_args()
    local rt = get(args.rt)
    local n = tonumber(args.n) or 1000
    local c = tonumber(args.c) or 16
    local threads = {}
    for t = 1, c do
        threads[t] = spawn(soak_thread, rt, t, n, c)
    end
    local ok, bad, first = 0, 0, nil
    for t = 1, c do
        local _, tok, tbad, tfirst = wait(threads[t])
        ok = ok + (tok or 0)
        bad = bad + (tbad or 0)
        first = first or tfirst
    end
    ngx_say("ok=", ok, " bad=", bad, " first=", first or "")
end


-- GET /bulk?rt=<name>&mib=<m>&n=<calls>: n calls sending an m MiB
-- payload (echoed back) and n calls answering m MiB ("big:"), from two
-- light threads at once; then a full Lua GC. Prints "ok=<n> bad=<n>".
local function bulk_thread(rt, n, size, payload)
    local ok, bad = 0, 0
    for _ = 1, n do
        local res = rt:call(payload)
        if res and #res == size then ok = ok + 1 else bad = bad + 1 end
        res = rt:call("big:" .. size)
        if res and #res == size then ok = ok + 1 else bad = bad + 1 end
    end
    return ok, bad
end


function _M.bulk()
    local args = ngx.req.get_uri_args()
    local rt = get(args.rt)
    local size = (tonumber(args.mib) or 64) * 1024 * 1024
    local n = tonumber(args.n) or 2
    local a, b
    do
        local payload = "echo:" .. string.rep("x", size)
        a = spawn(bulk_thread, rt, n, size, payload)
        b = spawn(bulk_thread, rt, n, size, payload)
    end
    local _, ok1, bad1 = wait(a)
    local _, ok2, bad2 = wait(b)
    -- each full cycle halves LuaJIT's own string-building buffer, which
    -- string.rep() above grew to the payload's size: 8 cycles take 64 MiB
    -- down to 256 KiB, so what stays is the runtime's
    for _ = 1, 8 do
        collectgarbage()
    end
    ngx_say("ok=", ok1 + ok2, " bad=", bad1 + bad2)
end


-- GET /stats?rt=<name>: rt:stats() as JSON
function _M.stats()
    local rt = get(ngx_var.arg_rt)
    ngx_say(require("cjson.safe").encode(rt:stats()))
end


-- GET /state?rt=<name>: rt:state()
function _M.state()
    local rt = get(ngx_var.arg_rt)
    ngx_say(rt:state())
end


-- GET /exec?n=<times>: os.execute("exit 3") n times while the runtime
-- is loaded; prints the distinct statuses ("768" when the shell's exit
-- status reached us, "-1" when something else reaped the child).
function _M.exec()
    local n = tonumber(ngx_var.arg_n) or 10
    local seen = {}
    for _ = 1, n do
        local st = os.execute("exit 3")
        seen[tostring(st)] = (seen[tostring(st)] or 0) + 1
    end
    for k, v in pairs(seen) do
        ngx_say(k, "=", v)
    end
end


-- log phase: a call where the coroutine cannot yield
function _M.log_phase_call(name)
    local rt = runtimes[name]
    local ok, res, err = pcall(rt.call, rt, "echo:log")
    ngx.log(ngx.NOTICE, "[offload_rt] log phase call: ", tostring(ok), " ",
            tostring(res), " ", tostring(err))
end


return _M
