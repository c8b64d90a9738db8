-- The hot paths of the timer engine (schedule, cancel, expire, run,
-- reschedule, statistics) compile: no trace aborts on a not-yet-implemented
-- (NYI) operation or on an inner loop inside the engine once the first
-- timer for a callback has been created (an inner loop in the run path
-- once kept the whole dispatch loop interpreted: 25x slower). Benign aborts
-- such as "leaving loop in root trace" or "return to lower frame" are part
-- of normal trace selection.

local core = require "resty.loom.timer.core"
local jutil = require "jit.util"
local traceerr = require("jit.vmdef").traceerr
local unit = require "unit"
local check = unit.check


local aborts = {}
local traces = 0
jit.attach(function(what, tr, func, pc, otr, oex)
    if what == "abort" then
        local info = jutil.funcinfo(func, pc)
        local msg = traceerr[otr] or tostring(otr)
        if type(oex) == "number" and msg:find("%d", 1, true) then
            msg = msg:format(oex)
        end
        if (info.source or ""):find("resty/loom/timer", 1, true)
           and not msg:find("return to lower frame", 1, true)
           and (msg:find("NYI", 1, true)
                -- wheel.advance() is a loop by nature; per-job code is not
                or (msg:find("inner loop", 1, true)
                    and not (info.source or ""):find("wheel.lua", 1, true)))
        then
            aborts[#aborts + 1] = (info.loc or "?") .. ": " .. msg
        end
    elseif what == "stop" then
        traces = traces + 1
    end
end, "trace")

local now = 1e9
local t = core.new({ clock = function() return now end })
local function noop() end
local runs = 0
local function count()
    runs = runs + 1
end

t:at(1, noop)          -- first use of each callback looks up its site
t:every(0.1, count)

local hs = {}
for round = 1, 3 do
    for i = 1, 20000 do
        hs[i] = t:at(60 + i / 1000, noop)
    end
    for i = 1, 20000 do
        t:cancel(hs[i])
    end
    for i = 1, 2000 do
        t:every(0.1, count)
    end
    for _ = 1, 30 do
        now = now + 10000
        t:advance(now)
        while t:run_next() do end
    end
end

jit.attach(function() end)
check(runs > 10000, "runs " .. runs)
check(traces > 0, "nothing compiled")
if #aborts > 0 then
    error("trace aborts in the engine:\n" .. table.concat(aborts, "\n"))
end
print("ok hot paths compile (" .. traces .. " traces, " .. runs .. " runs)")
