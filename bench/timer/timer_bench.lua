-- Lua side of bench/timer/run.py: the same workloads on native ngx.timer,
-- resty.loom.timer and (when PEER_TIMER_NG names a checkout) Kong's
-- lua-resty-timer-ng.

local ffi = require "ffi"

pcall(ffi.cdef, [[
typedef struct { long tv_sec; long tv_nsec; } loom_timer_timespec_t;
int loom_timer_clock_gettime(int clk, loom_timer_timespec_t *tp)
    __asm__("clock_gettime");
]])

local ts = ffi.new("loom_timer_timespec_t")
local C = ffi.C

local _M = {}

local tng                 -- the timer-ng instance (variant "ng")


local function mono()
    C.loom_timer_clock_gettime(1, ts)
    return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) / 1e9
end
_M.mono = mono


-- CPU time of this process (CLOCK_PROCESS_CPUTIME_ID): unlike the
-- monotonic clock it does not count the time other jobs held the core
local function cpu()
    C.loom_timer_clock_gettime(2, ts)
    return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) / 1e9
end


local function rss_kb()
    local f = io.open("/proc/self/status")
    local s = f:read("*a")
    f:close()
    return tonumber(s:match("VmRSS:%s+(%d+)"))
end


-- the variant's at() and every(), resolved once (as an application would)
local at, every, cancel


local function bind(variant)
    if variant == "native" then
        at, every = ngx.timer.at, ngx.timer.every
    elseif variant == "loom" then
        local timer = require "resty.loom.timer"
        at, every, cancel = timer.at, timer.every, timer.cancel
    else
        at = function(delay, cb, ...)
            return tng:at(delay, cb, ...)
        end
        every = function(iv, cb, ...)
            return tng:every(iv, cb, ...)
        end
        cancel = function(h)
            return tng:cancel(h)
        end
    end
end


-- init_by_lua
function _M.init(variant)
    _M.variant = variant
    if variant == "ng" then
        table.unpack = table.unpack or unpack     -- luacheck: ignore 122
        local timerng = require "resty.timerng"
        tng = timerng.new({ min_threads = 16, max_threads = 32 })
    end
    bind(variant)
end


local count = 0
local early = 0

-- a recurring callback: counts, and counts a fire before the creation-
-- anchored grid point of its run number as early
local function tick(premature, st)
    if premature then
        return
    end
    count = count + 1
    local k = st[2] + 1
    st[2] = k
    if mono() < st[1] + k * st[3] - 1e-4 then
        early = early + 1
    end
end


local function publish(premature)
    if premature then
        return
    end
    ngx.shared.bench:set("pub:" .. ngx.worker.id(),
                         count .. " " .. early .. " " .. mono())
end


-- init_worker_by_lua: n recurring timers of interval iv
function _M.init_worker(n, iv)
    if _M.variant == "ng" then
        assert(tng:start())
    end
    local now = mono()
    for _ = 1, n do
        local ok, err = every(iv, tick, { now, 0, iv })
        if not ok then
            ngx.log(ngx.ERR, "bench: failed to create timer: ", err)
            break
        end
    end
    -- the publisher is a native timer in every variant
    assert(ngx.timer.every(0.5, publish))
    ngx.shared.bench:incr("ready", 1, 0)
end


local function noop()
end


-- creates n one-shot timers 60 s out (after a warm-up of n / 10 that stay
-- pending); returns the figures as a table
function _M.micro(n)
    local hs = table.new(n, 0)
    for _ = 1, n / 10 do
        at(60, noop)
    end
    collectgarbage()
    collectgarbage()
    local heap0, rss0 = collectgarbage("count"), rss_kb()
    local c0 = cpu()
    local t0 = mono()
    for i = 1, n do
        hs[i] = at(60, noop)
    end
    local t1 = mono()
    local c1 = cpu()
    collectgarbage()
    collectgarbage()
    local heap1, rss1 = collectgarbage("count"), rss_kb()
    local out = {
        schedule_us = (t1 - t0) / n * 1e6,
        schedule_cpu_us = (c1 - c0) / n * 1e6,
        heap_b = (heap1 - heap0) * 1024 / n,
        rss_b = (rss1 - rss0) * 1024 / n,
    }
    if cancel then
        c0 = cpu()
        t0 = mono()
        for i = 1, n do
            cancel(hs[i])
        end
        t1 = mono()
        c1 = cpu()
        for i = 1, n do
            hs[i] = nil
        end
        collectgarbage()
        collectgarbage()
        out.cancel_us = (t1 - t0) / n * 1e6
        out.cancel_cpu_us = (c1 - c0) / n * 1e6
        out.heap_after_cancel_b = (collectgarbage("count") - heap0) * 1024 / n
        out.rss_after_cancel_b = (rss_kb() - rss0) * 1024 / n
    end
    return out
end


-- n one-shot jobs that each sleep 0.2 s; the last one to finish records
-- how long the whole batch took
function _M.sleepers(n)
    local d = ngx.shared.bench
    d:set("sl_done", 0)
    local t0 = mono()
    local function job(premature)
        if premature then
            return
        end
        ngx.sleep(0.2)
        local c = d:incr("sl_done", 1, 0)
        if c == n then
            d:set("sl_time", mono() - t0)
        end
    end
    for _ = 1, n do
        local ok, err = at(0, job)
        if not ok then
            return nil, err
        end
    end
    return true
end


-- n one-shot timers an hour out (idle cost)
function _M.park(n)
    for _ = 1, n do
        local ok, err = at(3600, noop)
        if not ok then
            return nil, err
        end
    end
    return true
end


return _M
