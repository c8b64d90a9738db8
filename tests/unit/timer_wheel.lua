-- Unit tests of resty.loom.timer.wheel (pure LuaJIT, no nginx).

local wheel = require "resty.loom.timer.wheel"
local unit = require "unit"
local case = unit.case
local check = unit.check


case("level boundaries fire exactly on their tick", function()
    local SL = wheel.SLOTS
    for _, start in ipairs({ 0, 1, 63, 64, 65, 4095, 4096, 123457 }) do
        local w = wheel.new(start, 16)
        local want = {}
        local id = 0
        for lvl = 0, wheel.LEVELS - 2 do
            local span = SL ^ (lvl + 1)
            for _, d in ipairs({ span - 1, span, span + 1 }) do
                if d >= 0 then
                    id = id + 1
                    w:grow(id)
                    w:insert(id, start + d)
                    want[id] = start + d
                end
            end
        end
        check(w.count == id)
        -- tick by tick near each deadline, in jumps elsewhere
        local fired = {}
        local t = start - 1
        local max = 0
        for _, v in pairs(want) do
            if v > max then
                max = v
            end
        end
        while t < max do
            local nt = w:next_tick()
            check(nt and nt >= t + 1, "next_tick went backwards")
            -- never skip past a deadline: jump to next_tick at most
            t = nt
            w:advance(t, function(ctx, i)
                fired[i] = ctx
            end, t)
        end
        for i, v in pairs(want) do
            check(fired[i] == v, ("start %d id %d due %d fired %s")
                  :format(start, i, v, tostring(fired[i])))
        end
        check(w.count == 0)
    end
end)


case("random timers, random steps: never early, never missed", function()
    math.randomseed(7)
    for _ = 1, 20 do
        local start = math.random(0, 1e6)
        local w = wheel.new(start, 8)
        local n = 2000
        w:grow(n)
        local due = {}
        for i = 1, n do
            local r = math.random()
            local d
            if r < 0.5 then
                d = math.random(0, 100)
            elseif r < 0.8 then
                d = math.random(0, 5000)
            elseif r < 0.95 then
                d = math.random(0, 300000)
            else
                d = math.random(0, 2e8)
            end
            due[i] = start + d
            w:insert(i, start + d)
        end
        local fired = {}
        local t = start - 1       -- the wheel has processed up to here
        local remaining = n
        while remaining > 0 do
            local nt = w:next_tick()
            check(nt, "wheel claims empty with timers left")
            local step = math.random(1, 3) == 1
                         and math.random(1, 50000) or math.random(1, 64)
            local prev = t
            t = t + step
            w:advance(t, function(now, i)
                check(due[i] <= now, "early: " .. i)
                check(due[i] > prev, "late: " .. i)
                fired[i] = now
                remaining = remaining - 1
            end, t)
        end
        for i = 1, n do
            -- fired at the first advance whose target reached the deadline
            check(fired[i] and fired[i] >= due[i])
        end
    end
end)


case("next_tick is never after the first deadline", function()
    math.randomseed(11)
    for _ = 1, 200 do
        local start = math.random(0, 1e7)
        local w = wheel.new(start, 4)
        local first
        for i = 1, 4 do
            local d = math.random(0, 10 ^ math.random(1, 8))
            w:insert(i, start + d)
            if not first or start + d < first then
                first = start + d
            end
        end
        -- advance to next_tick repeatedly; the first expiry happens at a
        -- call whose target is exactly the first deadline
        local got
        while not got do
            local nt = w:next_tick()
            check(nt <= first, "next_tick " .. nt .. " after " .. first)
            w:advance(nt, function(now)
                got = got or now
            end, nt)
        end
        check(got == first, got .. " ~= " .. first)
    end
end)


case("remove is O(1) and frees the slot at once", function()
    local w = wheel.new(0, 100000)
    for i = 1, 100000 do
        w:insert(i, 10 + (i % 7))     -- many timers in a few slots
    end
    check(w.count == 100000)
    for i = 1, 100000, 2 do
        check(w:remove(i))
        check(not w:contains(i))
        check(not w:remove(i), "double remove")
    end
    check(w.count == 50000)
    local n = 0
    w:advance(100, function(_, id)
        check(id % 2 == 0, "removed timer fired")
        n = n + 1
    end)
    check(n == 50000 and w.count == 0)
    check(w:next_tick() == nil)
end)


case("far future: 30 days at 1 ms and beyond the wheel span", function()
    local w = wheel.new(5, 4)
    local d30 = 30 * 86400 * 1000
    w:insert(1, 5 + d30)
    w:insert(2, 5 + 2 ^ 37)           -- beyond 2^36 ticks: parked
    local fired = {}
    local t = 5
    while not fired[2] do
        local nt = w:next_tick()
        check(nt and nt > t - 1)
        t = nt
        w:advance(t, function(now, id)
            fired[id] = now
        end, t)
    end
    check(fired[1] == 5 + d30, tostring(fired[1]))
    check(fired[2] == 5 + 2 ^ 37, tostring(fired[2]))
end)


case("overdue insert fires on the next advance", function()
    local w = wheel.new(1000, 4)
    w:insert(1, 10)
    local got
    w:advance(1000, function(now, id)
        got = id
    end, 1000)
    check(got == 1)
end)


case("re-insert from inside on_expire", function()
    local w = wheel.new(0, 4)
    w:insert(1, 3)
    local runs = {}
    local t = 0
    while #runs < 5 do
        t = t + 1
        w:advance(t, function(now, id)
            runs[#runs + 1] = now
            w:insert(id, now + 3)
        end, t)
    end
    for i = 1, 5 do
        check(runs[i] == 3 * i, tostring(runs[i]))
    end
end)


case("the ready list: in order, removable anywhere, counted", function()
    local w = wheel.new(0, 16)
    for id = 1, 5 do
        w:push(id, 100 + id)
    end
    check(w.ready == 5 and w.count == 0, "five ready, none in the slots")
    check(w:remove(3) and w:remove(1) and w:remove(5), "removed")
    check(not w:remove(3), "not twice")
    check(w.ready == 2)
    local id, t = w:pop()
    check(id == 2 and t == 102, "first in, first out: " .. id)
    w:push(7, 107)
    id = w:pop()
    check(id == 4, "then 4")
    id, t = w:pop()
    check(id == 7 and t == 107, "then 7")
    check(w:pop() == 0 and w.ready == 0, "empty")
    -- a timer in a slot is not in the ready list, and back
    w:insert(6, 3)
    check(w:contains(6) and w.ready == 0)
    w:advance(3, function(ctx, i) ctx:push(i, 3) end, w)
    check(not w:contains(6) and w.ready == 1 and w.count == 0)
    check(w:remove(6) and w.ready == 0, "removed from the ready list")
end)
