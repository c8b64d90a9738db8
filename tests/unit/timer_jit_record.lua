-- The compiled run loop stays on its recorded path through the statistics:
-- with run times, lateness and queue waits that vary from run to run, no
-- side trace starts in resty/loom/timer/stats.lua. (Branches on new maxima
-- once made the loop leave its trace on almost every run, each time
-- re-entering the loop's trace from its start: 0.3 instead of 0.19 us per
-- run.)

local core = require "resty.loom.timer.core"
local jutil = require "jit.util"
local unit = require "unit"
local check = unit.check


local side = {}
jit.attach(function(what, tr, func, pc, otr)
    if what == "start" and otr then          -- otr: parent of a side trace
        local info = jutil.funcinfo(func, pc)
        if (info.source or ""):find("resty/loom/timer/stats.lua", 1, true)
        then
            side[#side + 1] = ("trace %d (side of %d) at %s"):format(
                tr, otr, info.loc or "?")
        end
    end
end, "trace")

-- a clock that moves by a pseudo-random 1 to 5 microseconds per read
local now = 1e9
local seed = 12345
local function clock()
    seed = (seed * 1103515245 + 12345) % 2147483648
    now = now + 1 + seed % 5
    return now
end

local t = core.new({ clock = clock })
local runs = 0
local function tick(premature)
    if not premature then
        runs = runs + 1
    end
end
for _ = 1, 5000 do
    t:every(0.1, tick)
end
for _ = 1, 200 do
    now = now + 10000
    t:advance(clock())
    local n = clock()
    while t:run_next(n) do
        n = t.last_end
    end
end

jit.attach(function() end)
check(runs > 50000, "runs " .. runs)
if #side > 0 then
    error("side traces in the statistics:\n" .. table.concat(side, "\n"))
end
print("ok statistics keep the run loop on its trace (" .. runs .. " runs)")
