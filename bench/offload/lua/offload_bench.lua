-- Handlers of the resty.loom.offload benchmark (bench/offload/run.py).


local ffi = require "ffi"
local offload = require "resty.loom.offload"

local C = ffi.C
local ngx_var = ngx.var
local run_worker_thread = ngx.run_worker_thread  -- luacheck: ignore

ffi.cdef[[
typedef struct { long tv_sec; long tv_nsec; } offload_bench_ts_t;
int clock_gettime(int clk, offload_bench_ts_t *ts);
]]

local ts = ffi.new("offload_bench_ts_t")

local function now_us()
    C.clock_gettime(1, ts)      -- CLOCK_MONOTONIC
    return tonumber(ts.tv_sec) * 1e6 + tonumber(ts.tv_nsec) / 1e3
end


-- CPU time of the event loop's thread
local function loop_cpu_us()
    C.clock_gettime(3, ts)      -- CLOCK_THREAD_CPUTIME_ID
    return tonumber(ts.tv_sec) * 1e6 + tonumber(ts.tv_nsec) / 1e3
end

local _M = {}

local payloads = {}
local runtimes = {}
local handlers = {}
local socks
local redis_port


-- libs: { name = { path, opts[, config, handler] } }; socks: { uds =
-- "unix:<path>", java_uds = "unix:<path>" }; port: redis-server's
function _M.init(libs, sockets, port)
    payloads["64"] = string.rep("a", 60) .. "1234"
    payloads["16384"] = string.rep("b", 16380) .. "5678"
    _M.libs = libs
    socks = sockets
    redis_port = tostring(port)
end


function _M.init_worker()
    for name, lib in pairs(_M.libs) do
        -- the variant's name in the configuration: one instance each
        runtimes[name] = assert(offload.load(lib[1], lib[3] or
                                             ("mode=echo variant=" .. name),
                                             lib[2]))
        handlers[name] = lib[4]
    end
end


local function uds_call(m, p)
    local sock = ngx.socket.tcp()
    local ok, err = sock:connect(socks[m], { pool = m, pool_size = 128 })
    if not ok then
        return nil, err
    end
    local n = #p
    local hdr = string.char(bit.band(bit.rshift(n, 24), 255),
                            bit.band(bit.rshift(n, 16), 255),
                            bit.band(bit.rshift(n, 8), 255),
                            bit.band(n, 255))
    ok, err = sock:send({ hdr, p })
    if not ok then
        return nil, err
    end
    local h
    h, err = sock:receive(4)
    if not h then
        return nil, err
    end
    local b1, b2, b3, b4 = string.byte(h, 1, 4)
    local len = ((b1 * 256 + b2) * 256 + b3) * 256 + b4
    local body
    body, err = sock:receive(len)
    if not body then
        return nil, err
    end
    sock:setkeepalive(60000, 128)
    return body
end


local function thread_call(p)
    local ok, res = run_worker_thread("default", "offload_bench_echo",
                                          "echo", p)
    if not ok then
        return nil, res
    end
    return res
end


local function echo_none(p)
    return p
end


-- the jobs: the same function in the Lua runtime and in run_worker_thread
local JOBS = {
    lua_io = { "lua_job", "io_cpu" }, thread_io = { false, "io_cpu" },
    lua_cpu = { "lua_job", "cpu" }, thread_cpu = { false, "cpu" },
}


local function job(m)
    local rt_name, fn = JOBS[m][1], JOBS[m][2]
    local rt = runtimes[rt_name]
    if rt_name and not rt then
        return nil
    end
    return function(p)
        local ok, res
        if rt then
            res, ok = rt:call("offload_bench_job." .. fn, redis_port)
        else
            ok, res = run_worker_thread("default", "offload_bench_job", fn,
                                        redis_port)
            if not ok then
                return nil, res
            end
        end
        if not res then
            return nil, ok
        end
        return p
    end
end


local function mechanism(m)
    if m == "none" then
        return echo_none
    end
    if m == "thread" then
        return thread_call
    end
    if socks[m] then
        return function(p)
            return uds_call(m, p)
        end
    end
    if JOBS[m] then
        return job(m)
    end
    local rt = runtimes[m]
    if not rt then
        return nil
    end
    local handler = handlers[m]
    if handler then
        return function(p)
            return rt:call(handler, p)
        end
    end
    return function(p)
        return rt:call(p)
    end
end


-- GET /seq?m=<mechanism>&s=<size>&n=<calls>: µs per call over n
-- sequential calls (after 1,000 warm-up calls), and p50/p99 of 20,000
-- individually timed calls
function _M.seq()
    local f = mechanism(ngx_var.arg_m)
    local p = payloads[ngx_var.arg_s]
    local n = tonumber(ngx_var.arg_n) or 100000
    if not f or not p then
        return ngx.exit(404)
    end
    for _ = 1, 1000 do
        local r, err = f(p)
        if r ~= p then
            error("bad answer: " .. tostring(err))
        end
    end
    local t0 = now_us()
    local c0 = loop_cpu_us()
    for _ = 1, n do
        local r, err = f(p)
        if r ~= p then
            error("bad answer: " .. tostring(err))
        end
    end
    local total = now_us() - t0
    local cpu = loop_cpu_us() - c0
    local samples = {}
    for i = 1, 20000 do
        local t = now_us()
        f(p)
        samples[i] = now_us() - t
    end
    table.sort(samples)
    ngx.say(string.format('{"us_per_call": %.3f, "loop_cpu_us": %.3f, '
                          .. '"p50": %.2f, "p99": %.2f}', total / n, cpu / n,
                          samples[10000], samples[19800]))
end


-- GET /c?m=<mechanism>&s=<size>: one call per request
function _M.conc()
    local f = mechanism(ngx_var.arg_m)
    local p = payloads[ngx_var.arg_s]
    if not f or not p then
        return ngx.exit(404)
    end
    local r, err = f(p)
    if r ~= p then
        ngx.status = 502
        ngx.say(err)
        return
    end
    ngx.say(#r)
end


function _M.stats()
    local out = {}
    for name, rt in pairs(runtimes) do
        local s = rt:stats()
        out[#out + 1] = string.format('"%s": {"completed": %d, '
            .. '"polled_hits": %d, "p50": %.1f, "p99": %.1f}', name,
            s.completed, s.polled_hits, s.latency.p50, s.latency.p99)
    end
    ngx.say("{", table.concat(out, ", "), "}")
end


return _M
