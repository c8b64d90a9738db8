-- The recurring-timer run loop without nginx, for instruction counts
-- (valgrind --tool=callgrind) and profiles of the engine alone: n recurring
-- timers at 0.1 s on resty.loom.timer.core, driven by a fake clock through
-- `rounds` ticks of 10 ms, each tick's callbacks run as a lane runs them;
-- the callback is the bench's (timer_bench.lua). Run from the checkout:
--
--   luajit bench/timer/loop.lua VARIANT [n] [rounds]
--
-- VARIANT: loom, loom_nostats, floor (the callbacks in a plain loop),
-- floor_xpcall (the same, each under xpcall). Prints the callbacks run.
-- Two runs with different `rounds` give the cost per callback without the
-- start-up: (instructions(r2) - instructions(r1)) / (callbacks difference).

package.path = "lib/?.lua;bench/timer/?.lua;" .. package.path

local core = require "resty.loom.timer.core"
local tb = require "timer_bench"

local floor = math.floor
local xpcall = xpcall
local traceback = debug.traceback

local variant = arg[1] or "loom"
local n = tonumber(arg[2]) or 50000
local rounds = tonumber(arg[3]) or 100

local tick = tb.tick
local now = 1e9             -- us; 10 ms a round
local function clock()
    return now
end
local lap_n = 0
local function lap()        -- a callback takes 0.1 us of fake time
    lap_n = lap_n + 0.1
    return now + floor(lap_n) % 10000
end

local base = tb.mono()
local function state()
    return { tb.mono(), 0, 0.1, floor((tb.mono() - base) / 0.1) }
end

if variant == "floor" or variant == "floor_xpcall" then
    local sts = {}
    for i = 1, n do
        sts[i] = state()
    end
    local per = floor(n / 10)       -- a tenth of them every 10 ms
    local k = 0
    local x = variant == "floor_xpcall"
    for _ = 1, rounds do
        for _ = 1, per do
            k = k % n + 1
            if x then
                local ok, err = xpcall(tick, traceback, false, sts[k])
                if not ok then
                    error(err)
                end
            else
                tick(false, sts[k])
            end
        end
    end
else
    local e = core.new({ clock = clock, lap = lap, resolution = 0.01,
                         stats = variant ~= "loom_nostats" })
    -- created over 0.1 s, as in nginx, so that every tick has a share
    for i = 1, n do
        now = 1e9 + floor(i * 1e5 / n)
        assert(e:every(0.1, tick, state()))
    end
    for _ = 1, rounds do
        now = now + 10000
        e:advance(now)
        local start = now
        local t = now
        while e:run_next(t) do
            t = e.last_end
            if t - start >= 2000 and e:queued() > 0 then
                start = t           -- the lane's slice check
            end
        end
    end
end
print(variant, (tb.count_now():match("^%d+")))
