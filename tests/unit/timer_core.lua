-- Fake-clock unit tests of resty.loom.timer.core (pure LuaJIT, no nginx).

local core = require "resty.loom.timer.core"
local unit = require "unit"
local case = unit.case
local check = unit.check
local eq = unit.eq


-- a fake clock in microseconds, plus a helper that drives the engine the
-- way the nginx driver does (advance to now, run the queue)
local function env(opts)
    local e = { now = 1e9, logs = {} }
    opts = opts or {}
    opts.clock = function() return e.now end
    opts.log = function(level, msg)
        e.logs[#e.logs + 1] = level .. ": " .. msg
    end
    e.t = core.new(opts)
    function e.step(us)
        e.now = e.now + us
        e.t:advance(e.now)
        while e.t:run_next() do end
    end
    -- run to an absolute time, waking exactly where the engine asks to
    function e.run_until(t_us)
        while true do
            local w = e.t:next_wake()
            if not w or w > t_us then
                break
            end
            if w > e.now then
                e.now = w
            end
            e.t:advance(e.now)
            while e.t:run_next() do end
        end
        e.now = t_us
        e.t:advance(e.now)
        while e.t:run_next() do end
    end
    return e
end


case("never early, late by less than one tick", function()
    math.randomseed(3)
    for _, res in ipairs({ 0.01, 0.001, 0.1 }) do
        local e = env({ resolution = res })
        local fired = {}
        local due = {}
        for i = 1, 3000 do
            local d = math.random() * (i % 3 == 0 and 100 or 2)
            due[i] = e.now + d * 1e6
            e.t:at(d, function(premature, idx)
                check(not premature)
                fired[idx] = e.now
            end, i)
        end
        e.run_until(e.now + 101e6)
        for i = 1, 3000 do
            check(fired[i], "never fired " .. i)
            check(fired[i] >= due[i], "early " .. i)
            check(fired[i] - due[i] < res * 1e6 + 1, "late " .. i .. " by "
                  .. (fired[i] - due[i]))
        end
        eq(e.t:counts().timers, 0, "all freed")
    end
end)


case("many timers in one slot, arguments and nils", function()
    local e = env()
    local got = 0
    local seen = {}
    for i = 1, 10000 do
        e.t:at(0.5, function(_, a, b, c, d)
            got = got + 1
            seen[a] = true
            check(b == nil and c == "c" and d == i)
        end, i, nil, "c", i)
    end
    e.step(499999)
    eq(got, 0, "before the deadline")
    e.step(10000)
    eq(got, 10000, "all in one go")
    for i = 1, 10000 do
        check(seen[i])
    end
end)


case("zero delay runs on the next dispatch", function()
    local e = env()
    local ran = false
    e.t:at(0, function(p) ran = not p end)
    eq(e.t:next_wake(), 0)
    e.step(0)
    check(ran)
end)


case("cancel frees at once; stale handles refused", function()
    local e = env()
    local hs = {}
    for i = 1, 1000 do
        hs[i] = e.t:at(3600, function() error("cancelled timer ran") end)
    end
    eq(e.t:counts().timers, 1000)
    eq(e.t.wheel.count, 1000)
    for i = 1, 1000 do
        check(e.t:cancel(hs[i]))
    end
    eq(e.t:counts().timers, 0, "freed")
    eq(e.t.wheel.count, 0, "unlinked")
    local ok, err = e.t:cancel(hs[1])
    check(ok == nil and err == "not found")
    -- the id is reused with a new generation; the old handle stays dead
    local h2 = e.t:at(1, function() end)
    check(h2 ~= hs[1000])
    check(not e.t:cancel(hs[1000]))
    check(e.t:is_active(h2))
    e.run_until(e.now + 7200e6)
end)


case("cancel from inside a callback", function()
    local e = env()
    local h2
    local ran2 = false
    e.t:at(1, function()
        check(e.t:cancel(h2))
    end)
    h2 = e.t:at(1, function() ran2 = true end)   -- same tick, same slot
    local h3
    local runs3 = 0
    h3 = e.t:every(0.1, function()
        runs3 = runs3 + 1
        if runs3 == 3 then
            check(e.t:cancel(h3))       -- cancel itself while running
            check(not e.t:is_active(h3))
        end
    end)
    e.run_until(e.now + 5e6)
    check(not ran2, "cancelled sibling ran")
    eq(runs3, 3, "self-cancelled every")
    eq(e.t:counts().timers, 0)
end)


case("cancel of a running timer from elsewhere", function()
    local e = env()
    local runs = 0
    local h
    h = e.t:every(0.1, function()
        runs = runs + 1
        eq(e.t:state(h), "running")
        -- a nested engine call while running: cancel through the name
        -- table is tested below; here through the handle
        if runs == 2 then
            e.t:cancel(h)
            eq(e.t:state(h), nil)
            local ok, err = e.t:cancel(h)
            check(not ok and err == "not found", "double cancel")
        end
    end)
    e.run_until(e.now + 1e6)
    eq(runs, 2)
end)


case("fixed_rate with a slow callback skips and counts", function()
    local e = env()
    local starts = {}
    e.t:every(0.1, function()
        starts[#starts + 1] = e.now
        e.now = e.now + 250000      -- the callback takes 0.25 s
    end)
    local t0 = e.now
    e.run_until(t0 + 2.05e6)
    -- runs at 0.1, then the next free slot of the 0.1 grid: 0.4, 0.7 ...
    check(#starts >= 6, "runs " .. #starts)
    for i = 1, #starts do
        local off = starts[i] - t0
        check(math.abs(off - (0.1 + 0.3 * (i - 1)) * 1e6) < 1e4 + 1,
              "run " .. i .. " at " .. off)
    end
    local st = e.t:stats()
    check(st.totals.skipped >= 2 * (#starts - 1), "skipped "
          .. st.totals.skipped)
    for _, s in pairs(st.sites) do
        eq(s.skipped, st.totals.skipped, "per-site skipped")
    end
end)


case("fixed_rate keeps the grid (no drift) when fast", function()
    local e = env()
    local starts = {}
    e.t:every(0.25, function()
        starts[#starts + 1] = e.now
        e.now = e.now + 3000
    end)
    local t0 = e.now
    e.run_until(t0 + 10e6 + 1)
    eq(#starts, 40, "runs in 10 s")
    for i = 1, 40 do
        local off = starts[i] - t0 - i * 250000
        check(off >= 0 and off < 1e4 + 1, "drift at run " .. i)
    end
end)


case("fixed_delay counts from the end of the last run", function()
    local e = env()
    local starts = {}
    e.t:every({ interval = 0.1, mode = "fixed_delay" }, function()
        starts[#starts + 1] = e.now
        e.now = e.now + 250000
    end)
    e.run_until(e.now + 3e6)
    check(#starts >= 5)
    for i = 2, #starts do
        local gap = starts[i] - starts[i - 1]
        check(gap >= 350000 and gap < 350000 + 1e4 + 1, "gap " .. gap)
    end
    eq(e.t:stats().totals.skipped, 0)
end)


case("jitter stays within bounds", function()
    local e = env()
    local fired = {}
    local t0 = e.now
    for i = 1, 2000 do
        e.t:at({ delay = 1, jitter = 0.5 }, function() fired[i] = e.now end)
    end
    e.run_until(t0 + 2e6)
    local lo, hi = math.huge, 0
    for i = 1, 2000 do
        local off = fired[i] - t0
        check(off >= 1e6 and off <= 1.5e6 + 1e4, "jittered " .. off)
        lo = math.min(lo, off)
        hi = math.max(hi, off)
    end
    check(hi - lo > 0.4e6, "jitter actually spreads")
    -- every: jitter shifts the first run only
    local runs = {}
    e.t:every({ interval = 1, jitter = 0.3 }, function()
        runs[#runs + 1] = e.now
    end)
    e.run_until(e.now + 5e6)
    for i = 2, #runs do
        check(math.abs(runs[i] - runs[i - 1] - 1e6) < 1e4 + 1)
    end
end)


case("names: duplicate error, replace, reuse from the callback", function()
    local e = env()
    local h1 = assert(e.t:at({ delay = 10, name = "job" }, function() end))
    local h, err = e.t:at({ delay = 10, name = "job" }, function() end)
    check(h == nil and err == "exists")
    eq(e.t:handle("job"), h1)
    local ran = 0
    local h2 = assert(e.t:at({ delay = 1, name = "job", replace = true },
                             function()
        ran = ran + 1
        -- a one-shot may re-arm itself under its own name
        if ran < 3 then
            assert(e.t:at({ delay = 1, name = "job" }, debug.getinfo(1,
                   "f").func))
        end
    end))
    check(not e.t:is_active(h1), "replaced timer cancelled")
    check(e.t:is_active("job"))
    check(h2 ~= h1)
    e.run_until(e.now + 10e6)
    eq(ran, 3)
    check(not e.t:is_active("job"))
    -- names work as handles
    e.t:every({ interval = 1, name = "tick" }, function() end)
    check(e.t:pause("tick"))
    eq(e.t:state("tick"), "paused")
    check(e.t:cancel("tick"))
    eq(e.t:state("tick"), nil)
end)


case("pause and resume in every state", function()
    local e = env()
    -- pending
    local runs = 0
    local h = e.t:every(1, function() runs = runs + 1 end)
    e.run_until(e.now + 0.4e6)
    check(e.t:pause(h))
    check(e.t:pause(h), "pause twice")
    eq(e.t:state(h), "paused")
    check(not e.t:is_active(h))
    e.run_until(e.now + 5e6)
    eq(runs, 0, "paused timer ran")
    check(e.t:resume(h))
    eq(e.t:state(h), "pending")
    check(e.t:resume(h), "resume of an active timer")   -- no orphan
    eq(e.t:state(h), "pending")
    -- it had 0.6 s left when paused
    e.run_until(e.now + 0.59e6)
    eq(runs, 0)
    e.run_until(e.now + 0.02e6)
    eq(runs, 1)
    -- running: pause from inside takes effect after the run
    local r2 = 0
    local h2
    h2 = e.t:every(0.5, function()
        r2 = r2 + 1
        check(e.t:pause(h2))
        eq(e.t:state(h2), "paused")
        if r2 == 1 then
            check(e.t:resume(h2))      -- resumed before the run ended
            eq(e.t:state(h2), "running")
        end
    end)
    e.run_until(e.now + 3.1e6)
    eq(r2, 2, "second run paused it")
    eq(e.t:state(h2), "paused")
    check(e.t:resume(h2))
    e.run_until(e.now + 0.51e6)
    eq(r2, 3)
    -- queued (due but not yet run)
    local r3 = 0
    local h3 = e.t:at(0.1, function() r3 = r3 + 1 end)
    e.now = e.now + 0.2e6
    e.t:advance(e.now)
    eq(e.t:state(h3), "queued")
    check(e.t:pause(h3))
    while e.t:run_next() do end
    eq(r3, 0, "paused while queued")
    check(e.t:resume(h3))
    e.step(0)
    eq(r3, 1)
    -- unknown
    local ok, err = e.t:pause(12345)
    check(not ok and err == "not found")
    check(not e.t:resume("nope"))
end)


case("errors: traceback, creation site, counted", function()
    local e = env()
    local function boom() error("kaboom") end
    local line = debug.getinfo(1, "l").currentline
    e.t:at(0.1, boom)
    e.t:at({ delay = 0.1, name = "named" }, function() boom() end)
    e.run_until(e.now + 1e6)
    eq(#e.logs, 2)
    for i, l in ipairs(e.logs) do
        check(l:find("^error: %[loom.timer%] timer created at %S*"
                     .. "tests/unit/timer_core.lua:" .. (line + 3 - i)
                     .. " "), l)
        check(l:find("kaboom", 1, true))
        check(l:find("stack traceback", 1, true), "traceback")
    end
    check(e.logs[1]:find('(name "named")', 1, true)
          or e.logs[2]:find('(name "named")', 1, true))
    local st = e.t:stats()
    eq(st.totals.errors, 2)
    eq(st.names.named.errors, 1)
    local n = 0
    for key, s in pairs(st.sites) do
        check(key:find("timer_core.lua:", 1, true))
        n = n + s.errors
        check(s.last_error:find("kaboom", 1, true))
    end
    eq(n, 2)
end)


case("max_run_time is reported", function()
    local e = env()
    e.t:at({ delay = 0.1, max_run_time = 0.05 }, function()
        e.now = e.now + 80000
    end)
    e.t:at({ delay = 0.1, max_run_time = 0.05 }, function()
        e.now = e.now + 10000
    end)
    e.run_until(e.now + 1e6)
    eq(e.t:stats().totals.overruns, 1)
    check(e.logs[1]:find("^warn: .*ran 80 ms, over its maximum run time "
                         .. "of 50 ms"), e.logs[1])
end)


case("statistics: runs, lateness, queue wait, pending", function()
    local e = env()
    local function cb()
        e.now = e.now + 1000
    end
    for i = 1, 10 do
        local h, err = e.t:every({ interval = 0.1, name = "n" .. i }, cb)
        check(h, err)
    end
    e.run_until(e.now + 1.001e6)
    local st = e.t:stats()
    local s = st.names.n3
    eq(s.runs, 10)
    eq(s.pending, 1)
    local site
    for _, v in pairs(st.sites) do
        site = v
    end
    eq(site.runs, 100)
    eq(site.pending, 10)
    eq(site.run_time.count, 100)
    check(site.run_time.min >= 0.001 and site.run_time.max <= 0.0011)
    check(site.lateness.max < 0.02, "lateness " .. site.lateness.max)
    check(site.lateness.p99 <= site.lateness.max)
    check(site.lateness.p50 <= site.lateness.p99)
    -- ten jobs per tick each taking 1 ms: the last waits about 9 ms
    check(site.queue_wait.max >= 0.009 and site.queue_wait.max <= 0.0101,
          "queue wait " .. site.queue_wait.max)
    eq(st.timers, 10)
    eq(st.pending, 10)
end)


case("exit: premature delivery to pending, paused, queued", function()
    local e = env()
    local prem = {}
    local function cb(p, tag)
        prem[tag] = p
    end
    e.t:at(100, cb, "pending")
    local hp = e.t:every(1, cb, "paused")
    e.t:pause(hp)
    local runs = 0
    local hr
    hr = e.t:every(0.5, function(p)
        runs = runs + 1
        if runs == 1 then
            e.t:at(0, cb, "queued")
            eq(e.t:state(e.t:at(0.01, cb, "wheel")), "pending")
            eq(e.t:exit(e.now + 5e6), 4, "queued for premature")
            check(not p)
            local h, err = e.t:at(1, cb, "x")
            check(h == nil and err == "process exiting")
            check(e.t:at(0, cb, "zero"), "zero delay allowed while exiting")
        end
    end)
    e.run_until(e.now + 2e6)
    eq(runs, 1, "running recurring timer stops")
    check(not e.t:is_active(hr))
    check(prem.pending == true and prem.paused == true
          and prem.queued == true and prem.wheel == true, "premature flags")
    eq(prem.zero, false)
    eq(prem.x, nil)
    eq(e.t:counts().timers, 0)
    eq(e.t:stats().totals.premature, 4)
end)


case("exit: premature runs past the deadline are dropped", function()
    local e = env()
    local n = 0
    for _ = 1, 10 do
        e.t:at(100, function()
            n = n + 1
            e.now = e.now + 1e6
        end)
    end
    e.t:exit(e.now + 2.5e6)
    e.step(0)
    eq(n, 3)
    eq(e.t:stats().totals.dropped, 7)
    eq(e.t:counts().timers, 0)
end)


case("argument errors name the caller; the options form is strict",
     function()
    local e = env()
    local function raises(f, pat)
        local ok, err = pcall(f)
        check(not ok and err:find(pat, 1, true), tostring(err))
        -- level 2: the line of the call, not core.lua
        check(err:find("^[^:]*timer_core%.lua:%d+: bad argument"),
              "not at the caller's level: " .. err)
    end
    raises(function() e.t:at("abc", print) end,
           "number or options table expected, got string")
    raises(function() e.t:at(nil, print) end, "got nil")
    raises(function() e.t:at(1, "x") end, "callback must be a function")
    raises(function() e.t:every(0, print) end, "delay cannot be zero")
    raises(function() e.t:every(0.0001, print) end, "delay cannot be zero")
    raises(function() e.t:every(1 / 0, print) end, "delay cannot be zero")
    raises(function() e.t:every(1e308, print) end, "delay cannot be zero")
    raises(function() e.t:at({}, print) end, "opts.delay is required")
    raises(function() e.t:at({ delay = 1, nmae = "x" }, print) end,
           "opts.nmae is not an option")
    for _, bad in ipairs({ 0 / 0, -1, 1 / 0, 1e308, "1" }) do
        raises(function() e.t:at({ delay = bad }, print) end,
               "opts.delay must be")
        raises(function() e.t:every({ interval = bad }, print) end,
               "opts.interval must be")
        raises(function() e.t:at({ delay = 1, jitter = bad }, print) end,
               "opts.jitter must be")
    end
    for _, bad in ipairs({ 0, 0 / 0, -1, 1 / 0 }) do
        raises(function() e.t:at({ delay = 1, max_run_time = bad }, print) end,
               "opts.max_run_time must be")
    end
    raises(function() e.t:every({ interval = 0.0005 }, print) end,
           "opts.interval must be")
    raises(function() e.t:every({ interval = 1, mode = "x" }, print) end,
           "opts.mode must be")
    raises(function() e.t:at({ delay = 1, name = 3 }, print) end,
           "opts.name must be a string")
    raises(function() e.t:at({ delay = -1 }, print) end,
           "opts.delay must be a number from 0 to 1000000000")
    raises(function() e.t:every({ interval = 1, mode = "x" }, print) end,
           'opts.mode must be "fixed_rate" or "fixed_delay"')
    local ok, err = pcall(core.new, { clock = os.time, resolution = 0 / 0 })
    check(not ok and err:find("opts.resolution must be", 1, true), err)
    -- new(): every option known and checked, the clock required
    for opts, msg in pairs({
        [{ clock = os.time, resolution = 2 }] =
            "opts.resolution must be a number from 0.001 to 1",
        [{ clock = os.time, nope = 1 }] = "opts.nope is not an option",
        [{ clock = os.time, max_run_time = 1 / 0 }] =
            "opts.max_run_time must be a number above 0 and at most",
        [{ clock = os.time, max_names = 0.5 }] =
            "opts.max_names must be a whole number from 0 to 1000000",
        [{ clock = os.time, stats = "no" }] = "opts.stats must be a boolean",
        [{ clock = 1 }] = "opts.clock must be a function",
        [{}] = "opts.clock is required",
        [0] = "opts must be a table",
    }) do
        ok, err = pcall(core.new, opts)
        check(not ok and err:find(msg, 1, true), tostring(err))
    end
    eq(e.t:counts().timers, 0, "nothing was created")
end)


case("positional delays behave like ngx.timer's", function()
    local e = env()
    local ran = {}
    local function mark(_, k)
        ran[k] = (ran[k] or 0) + 1
    end
    -- NaN, negative and past-the-wrap delays run at once; "0.5" is 0.5 s
    for k, d in pairs({ nan = 0 / 0, neg = -1, ninf = -1 / 0, inf = 1 / 0,
                        huge = 1e308, str = "0.5" }) do
        check(e.t:at(d, mark, k), k)
    end
    e.step(10000)
    eq(ran.nan, 1, "nan")
    eq(ran.neg, 1, "neg")
    eq(ran.ninf, 1, "-inf")
    eq(ran.inf, 1, "inf")
    eq(ran.huge, 1, "1e308")
    eq(ran.str, nil, "\"0.5\" is not due yet")
    e.step(500000)
    eq(ran.str, 1, "\"0.5\"")
    -- every() with a negative or NaN interval runs on every tick
    local h = assert(e.t:every(-1, mark, "every"))
    e.run_until(e.now + 100000)
    eq(ran.every, 10, "every(-1) at the 10 ms tick")
    e.t:cancel(h)
end)


case("any number of arguments, nils included", function()
    local e = env()
    for _, n in ipairs({ 0, 1, 2, 3, 254, 255, 256, 1000 }) do
        local args = {}
        for i = 1, n do
            args[i] = (i % 7 ~= 0) and i or nil
        end
        local got
        e.t:at(0, function(_, ...)
            got = { n = select("#", ...), ... }
        end, unpack(args, 1, n))
        e.step(1)
        eq(got.n, n, "count")
        for i = 1, n do
            eq(got[i], args[i], "argument " .. i)
        end
    end
end)


case("an error value that is a table is logged as JSON with a traceback",
     function()
    local e = env()
    e.t:at(0, function() error({ code = 42 }) end)
    e.step(1)
    local line = e.logs[1] or ""
    check(line:find('failed: {"code":42}', 1, true), line)
    check(line:find("stack traceback", 1, true), line)
end)


case("raw statistics merge exactly across workers", function()
    local stats = require "resty.loom.timer.stats"
    local raws = {}
    for w = 1, 2 do
        local e = env()
        local function cb()
            e.now = e.now + 1000 * w        -- 1 ms on one, 2 ms on the other
        end
        e.t:every({ interval = 0.1, name = "shared" }, cb)
        e.run_until(e.now + 1.001e6)
        raws[w] = e.t:stats(true).names.shared
        check(type(raws[w].rt) == "table", "raw histogram")
    end
    local m = stats.merge(stats.merge(nil, raws[1]), raws[2])
    local s = stats.summary(m)
    eq(s.runs, 20)
    eq(s.pending, 2)
    check(math.abs(s.run_time.min - 0.001) < 1e-9)
    check(math.abs(s.run_time.max - 0.002) < 1e-9)
    check(math.abs(s.run_time.avg - 0.0015) < 1e-9)
    -- half the runs took 2 ms: the p99 is in the 2 ms bucket (capped)
    check(s.run_time.p99 > 0.0017 and s.run_time.p99 <= 0.002,
          s.run_time.p99)
    eq(s.lateness.count, 20)
end)


case("arrays that move while a callback runs", function()
    -- a running recurring timer whose callback creates enough timers to
    -- grow (and move) the job and wheel arrays several times, then cancels
    -- them: the running job is re-read afterwards and keeps its state
    local e = env()
    local runs = 0
    local made = {}
    local h
    h = e.t:every(0.1, function(premature)
        if premature then
            return
        end
        runs = runs + 1
        for i = 1, 5000 do
            made[#made + 1] = e.t:at(1 + i / 1000, function() end)
        end
        eq(e.t:state(h), "running", "state while running")
    end)
    for _ = 1, 4 do
        e.step(100000)
    end
    eq(runs, 4, "runs")
    eq(e.t:state(h), "pending", "state after")
    check(e.t:counts().capacity >= 20001, "arrays grew")
    for i = 1, #made do
        check(e.t:cancel(made[i]), "cancel " .. i)
    end
    eq(e.t:counts().timers, 1, "only the recurring timer left")
    eq(e.t:counts().pending, 1, "in the wheel")
    e.step(100000)
    eq(runs, 5, "runs on after the moves")
    local st = e.t:stats()
    local site
    for _, s in pairs(st.sites) do
        if s.runs > 0 then
            site = s
        end
    end
    eq(site.runs, 5, "site runs")
    eq(site.pending, 1, "site pending")
end)


case("a run's end time comes from the lap clock when one is given", function()
    -- the driver's lap clock (the time-stamp counter in nginx) times each
    -- run; the plain clock still schedules
    local e = { now = 1e9, lap_now = 0 }
    local t = core.new({
        clock = function() return e.now end,
        lap = function() return e.lap_now end,
    })
    local runs = 0
    t:every(0.1, function()
        runs = runs + 1
        e.lap_now = e.now + 250         -- this run took 250 us
    end)
    for _ = 1, 3 do
        e.now = e.now + 100000
        t:advance(e.now)
        while t:run_next(e.now) do end
    end
    eq(runs, 3, "runs")
    eq(t.last_end, e.now + 250, "end of the last run")
    local site
    for _, s in pairs(t:stats().sites) do
        site = s
    end
    eq(site.run_time.max, 0.00025, "run time from the lap clock")
    eq(site.skipped, 0, "no tick skipped")
    eq(t:counts().pending, 1, "re-armed")
    local ok, err = pcall(core.new, { clock = os.clock, lap = 1 })
    check(not ok and tostring(err):find("opts.lap must be", 1, true),
          "lap is checked: " .. tostring(err))
end)


-- the way a lane drives the engine: groups of runs until the queue is empty
local function run_lane(t, now, slice)
    t:lap_start(now)
    local more, start = true, now
    while more do
        more, now = t:run_group(now, start + slice)
        if more and now - start >= slice then
            start = now
            t:lap_start(now)
        end
    end
end


-- an engine without statistics, its lap clock's reads counted; e.work(us)
-- is a callback taking that long; msec stands for the event loop's
-- millisecond counter
local function untimed_env(opts)
    local e = { now = 1e9, laps = 0, lap_t = 1e9 }
    e.msec = require("ffi").new("uint32_t[1]")
    function e.work(us)
        e.lap_t = math.max(e.lap_t, e.now) + us
    end
    opts = opts or {}
    opts.clock = function() return e.now end
    opts.lap = function()
        e.laps = e.laps + 1
        e.lap_t = math.max(e.lap_t, e.now)
        return e.lap_t
    end
    if opts.stats == nil then
        opts.stats = false
    end
    if opts.loop_msec == nil then
        opts.loop_msec = e.msec
    elseif opts.loop_msec == false then
        opts.loop_msec = nil                -- no loop clock
    end
    e.t = core.new(opts)
    return e
end


case("without statistics, short runs share one clock read per group",
     function()
    local G = core.LAP_GROUP
    for _, v in ipairs({
        { name = "no statistics", group = true },
        { name = "statistics", opts = { stats = true } },
        { name = "no loop clock", opts = { loop_msec = false } },
    }) do
        local e = untimed_env(v.opts)
        local runs = 0
        for _ = 1, 1600 do
            e.t:every(0.1, function()
                runs = runs + 1
                e.work(0.5)
            end)
        end
        for _ = 1, 3 do
            e.now = e.now + 100000
            e.t:advance(e.now)
            run_lane(e.t, e.now, 2000)
        end
        eq(runs, 4800, v.name .. ": runs")
        if v.group then
            check(e.laps >= runs / G and e.laps <= runs / G + 6,
                  v.name .. ": " .. e.laps .. " reads for " .. runs)
        else
            eq(e.laps, runs, v.name .. ": a read per run")
        end
        eq(e.t:counts().pending, 1600, v.name .. ": all re-armed")
    end
end)


case("without statistics, slow runs are timed one by one", function()
    local e = untimed_env()
    local runs = 0
    for _ = 1, 400 do
        e.t:every(0.1, function()
            runs = runs + 1
            e.work(5)
        end)
    end
    e.now = e.now + 100000
    e.t:advance(e.now)
    run_lane(e.t, e.now, 1e6)
    eq(runs, 400, "runs")
    -- the first group is read at its end, then every run
    check(e.laps >= 400 - core.LAP_GROUP and e.laps <= 400,
          e.laps .. " reads")
end)


case("without statistics, a run that needs its end is timed", function()
    -- a callback that yields (the loop's millisecond counter moves): its
    -- missed ticks are skipped as with statistics
    local e = untimed_env()
    local runs, at = 0, {}
    e.t:every(0.1, function()
        runs = runs + 1
        at[runs] = e.now
        if runs == 1 then
            e.msec[0] = e.msec[0] + 350     -- it slept 350 ms
            e.lap_t = e.now + 350000
        end
    end)
    e.now = e.now + 100000
    e.t:advance(e.now)
    run_lane(e.t, e.now, 2000)
    eq(e.t.totals.skipped, 3, "0.2, 0.3 and 0.4 s skipped")
    local w = e.t:next_wake()
    eq(w, at[1] + 400000, "next run on the grid after the sleep")

    -- fixed delay: the next run counts from the end of this one
    e = untimed_env()
    e.t:every({ interval = 0.1, mode = "fixed_delay" }, function()
        e.lap_t = e.now + 30000            -- this run took 30 ms
    end)
    e.now = e.now + 100000
    e.t:advance(e.now)
    local laps = e.laps
    run_lane(e.t, e.now, 2000)
    check(e.laps > laps, "fixed delay read the clock")
    eq(e.t:next_wake(), e.now + 130000, "due 0.1 s after the end")

    -- a maximum run time: the run is timed, the overrun reported
    e = untimed_env({ max_run_time = 0.01 })
    e.logs = {}
    e.t.log = function(level, msg) e.logs[#e.logs + 1] = level .. msg end
    e.t:every(0.1, function() e.lap_t = e.now + 20000 end)
    e.now = e.now + 100000
    e.t:advance(e.now)
    run_lane(e.t, e.now, 2000)
    eq(e.t.totals.overruns, 1, "overrun counted")
    check(e.logs[1] and e.logs[1]:find("over its maximum run time", 1,
                                        true), "overrun logged")
end)


case("a timer cancelled or paused while queued leaves the queue at once",
     function()
    local e = env()
    local ran = {}
    local hs = {}
    for i = 1, 4 do
        hs[i] = e.t:at(0, function() ran[i] = true end)
    end
    eq(e.t:queued(), 4, "queued")
    check(e.t:cancel(hs[2]), "cancel")
    check(e.t:pause(hs[3]), "pause")
    eq(e.t:queued(), 2, "two left in the queue")
    eq(e.t:counts().timers, 3, "the cancelled one is freed")
    while e.t:run_next() do end
    check(ran[1] and ran[4] and not ran[2] and not ran[3], "ran 1 and 4")
    check(e.t:resume(hs[3]), "resume")
    eq(e.t:queued(), 1, "queued again")
    while e.t:run_next() do end
    check(ran[3], "ran 3 after resume")
end)
