-- What LuaJIT's profiler in line mode costs compiled code, with its timer
-- so slow that it never fires (the watchdog disarms it): the traces carry
-- a profile-hook check at every line change. Run with luajit; prints the
-- median time of a Lua workload without and with the profiler, alternated.
--   luajit bench/watchdog/profile_mode.lua [rounds]

local profile = require "jit.profile"
local clock = os.clock
local concat = table.concat

local function work(n)
    local acc, t = 0, {}
    for i = 1, n do
        local s = "k" .. (i % 97)
        t[s] = (t[s] or 0) + i
        if i % 3 == 0 then
            acc = acc + #s
        else
            acc = acc + (i % 7)
        end
    end
    local parts = {}
    for k, v in pairs(t) do
        parts[#parts + 1] = k .. "=" .. v
    end
    return acc + #concat(parts, ",")
end

local function run()
    local t0 = clock()
    for _ = 1, 40 do
        work(100000)
    end
    return clock() - t0
end

local rounds = tonumber(arg and arg[1]) or 5
local off, on = {}, {}
run()   -- warm up
local function measure_off()
    jit.flush()
    off[#off + 1] = run()
end

local function measure_on()
    profile.start("li3600000", function() end)
    on[#on + 1] = run()
    profile.stop()
end

for i = 1, rounds do
    -- alternate the order too
    if i % 2 == 1 then
        measure_off()
        measure_on()
    else
        measure_on()
        measure_off()
    end
end
table.sort(off)
table.sort(on)
local mo, mn = off[math.ceil(rounds / 2)], on[math.ceil(rounds / 2)]
print(string.format('{"off_s": %.4f, "on_s": %.4f, "ratio": %.4f}',
                    mo, mn, mn / mo))
