-- Lua side of bench/timer/run.py: the same workloads on native ngx.timer,
-- resty.loom.timer and (when PEER_TIMER_NG names a checkout) Kong's
-- lua-resty-timer-ng; "floor" runs the recurring callbacks in a plain loop
-- from one native timer (the least any timer library can cost),
-- "floor_xpcall" the same loop with each callback under xpcall (the error
-- isolation every timer library gives), "base" is resty.loom.timer from
-- another checkout (BASE_LOOM_LIB: an A/B baseline), "loom_nostats" and
-- "base_nostats" those two configured with stats = false.

local ffi = require "ffi"

pcall(ffi.cdef, [[
typedef struct { long tv_sec; long tv_nsec; } loom_timer_timespec_t;
int loom_timer_clock_gettime(int clk, loom_timer_timespec_t *tp)
    __asm__("clock_gettime");
]])

local ts = ffi.new("loom_timer_timespec_t")
local C = ffi.C
local floor = math.floor

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
    elseif variant == "loom" or variant == "base"
           or variant == "loom_nostats" or variant == "base_nostats"
    then
        local timer = require "resty.loom.timer"
        at, every, cancel = timer.at, timer.every, timer.cancel
    elseif variant == "floor" or variant == "floor_xpcall" then
        at, every = ngx.timer.at, nil
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
    elseif variant == "loom_nostats" or variant == "base_nostats" then
        require("resty.loom.timer").configure({ stats = false })
    end
    bind(variant)
end


local count = 0
local early = 0


-- callbacks run and early fires so far, and the clock (bench/timer/cost.py)
function _M.count_now()
    return count .. " " .. early .. " " .. mono()
end

-- Runs are counted by the grid point they are for, in bins of one interval
-- of due time: bins[b] counts the runs due in [base + b * iv,
-- base + (b + 1) * iv). Every timer has exactly one grid point in each
-- such bin after its first run, so a bin is complete at n runs; counting
-- by run time instead would let a window hold one burst more or less than
-- its length (all timers are created together, so they fire in bursts).
local bins = {}
local maxbin = 0
local base = 0            -- mono() before the first timer was created
local tick_iv = 0


-- a recurring callback. st = { created (mono), runs, interval, first bin }.
-- A fire before the creation-anchored grid point of its run number is
-- early.
local function tick(premature, st)
    if premature then
        return
    end
    local t = mono()
    count = count + 1
    local k = st[2] + 1
    st[2] = k
    local c, iv = st[1], st[3]
    if t < c + k * iv - 1e-4 then
        early = early + 1
    end
    -- the grid point this run is for: the last one at or before t
    local b = floor((t - c) / iv) + st[4]
    bins[b] = (bins[b] or 0) + 1
    if b > maxbin then
        maxbin = b
    end
end
_M.tick = tick              -- for bench/timer/loop.lua


local function publish(premature)
    if premature then
        return
    end
    local id = ngx.worker.id()
    local d = ngx.shared.bench
    d:set("pub:" .. id, count .. " " .. early .. " " .. mono())
    if maxbin > 0 then
        local out = { base, tick_iv }
        for b = 1, maxbin do
            out[b + 2] = bins[b] or 0
        end
        d:set("bins:" .. id, table.concat(out, " "))
    end
end


local floor_sts         -- the floor's timers' states; nil: none running


-- n timers' states, created as every() is called for the others
local function states(n, iv)
    local sts = table.new(n, 0)
    for i = 1, n do
        local now = mono()
        sts[i] = { now, 0, iv, floor((now - base) / iv) }
    end
    return sts
end


-- the floor: the same callbacks called in a plain loop every interval
-- (yielding to nothing: the floor of the CPU cost); floor_xpcall runs each
-- under xpcall with a traceback handler, with the error isolation a timer
-- library must give
local function start_floor(iv)
    local run_all
    if _M.variant == "floor" then
        run_all = function(premature)
            local sts = floor_sts
            if not sts then
                return
            end
            for i = 1, #sts do
                tick(premature, sts[i])
            end
        end
    else
        local traceback = debug.traceback
        run_all = function(premature)
            local sts = floor_sts
            if not sts then
                return
            end
            for i = 1, #sts do
                local ok, err = xpcall(tick, traceback, premature, sts[i])
                if not ok then
                    ngx.log(ngx.ERR, "bench: ", err)
                end
            end
        end
    end
    assert(ngx.timer.every(iv, run_all))
end


local function is_floor()
    return _M.variant == "floor" or _M.variant == "floor_xpcall"
end


-- n recurring timers of interval iv; returns their handles (none for the
-- floor)
local function create(n, iv)
    if is_floor() then
        floor_sts = states(n, iv)
        return {}
    end
    local hs = table.new(n, 0)
    for i = 1, n do
        local now = mono()
        local h, err = every(iv, tick, { now, 0, iv,
                                         floor((now - base) / iv) })
        if not h then
            ngx.log(ngx.ERR, "bench: failed to create timer: ", err)
            break
        end
        hs[i] = h
    end
    return hs
end


-- init_worker_by_lua: n recurring timers of interval iv
function _M.init_worker(n, iv)
    if _M.variant == "ng" then
        assert(tng:start())
    end
    base = mono()
    tick_iv = iv
    if is_floor() then
        start_floor(iv)
    end
    if n > 0 then
        create(n, iv)
    end
    -- the publisher is a native timer in every variant
    assert(ngx.timer.every(0.5, publish))
    ngx.shared.bench:incr("ready", 1, 0)
end


-- init_worker_by_lua, after init_worker (bench/timer/tax.py): n recurring
-- timers of interval iv switched on and off by "switch" in the shared dict
-- (odd: on), read every 50 ms; "switched:<worker id>" says which switch
-- the worker has applied
function _M.init_switch(n, iv)
    local d = ngx.shared.bench
    local wid = ngx.worker.id()
    local applied = 0
    local handles
    assert(ngx.timer.every(0.05, function(premature)
        local s = d:get("switch") or 0
        if premature or s == applied then
            return
        end
        if s % 2 == 1 and not handles then
            handles = create(n, iv)
        elseif s % 2 == 0 and handles then
            floor_sts = nil
            for i = 1, #handles do
                cancel(handles[i])
            end
            handles = nil
        end
        applied = s
        d:set("switched:" .. wid, s)
    end))
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
