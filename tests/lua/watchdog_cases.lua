-- Code that blocks the event loop on purpose, for the watchdog tests.
-- The line numbers of the blocking calls are asserted by the tests:
-- tests/test_watchdog.py reads them from the "-- LINE:<name>" markers.


local ffi = require "ffi"

ffi.cdef[[
int usleep(unsigned int usec);
]]

local C = ffi.C
local ngx_now = ngx.now
local ngx_update_time = ngx.update_time
local ngx_md5 = ngx.md5
local tostring = tostring
local random = math.random


local _M = {}


local function burn_cpu(ms)
    ngx_update_time()
    local deadline = ngx_now() + ms / 1000
    local acc = 0
    while true do
        for i = 1, 2000 do
            acc = acc + #ngx_md5(tostring(random()) .. i)  -- LINE:burn
        end
        ngx_update_time()
        if ngx_now() >= deadline then
            break
        end
    end
    return acc
end


function _M.cpu(ms)
    return burn_cpu(ms)
end


function _M.sleep_exec(seconds)
    os.execute("sleep " .. seconds)  -- LINE:exec
end


function _M.sleep_ffi(ms)
    C.usleep(ms * 1000)  -- LINE:usleep
end


local function timer_sleeper(premature, ms)
    if premature then
        return
    end
    C.usleep(ms * 1000)  -- LINE:timer
end


function _M.start_timer(ms)
    local ok, err = ngx.timer.at(0, timer_sleeper, ms)  -- LINE:timer_created
    return ok, err
end


-- resty.loom.timer callbacks: one sleeps, one burns CPU (a compiled loop)
local function loom_sleeper(premature, ms)
    if premature then
        return
    end
    C.usleep(ms * 1000)  -- LINE:loom_sleep
end


local function loom_burner(premature, ms)
    if premature then
        return
    end
    burn_cpu(ms)
end


function _M.start_loom_timers(ms)
    local timer = require "resty.loom.timer"
    local h1 = timer.at(0, loom_sleeper, ms)  -- LINE:loom_created
    local named = { delay = 0.5, name = "burner" }
    local h2 = timer.at(named, loom_burner, ms)  -- LINE:loom_named
    return h1 and h2
end


return _M
