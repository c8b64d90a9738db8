-- Running timers: the next queued job's callback, with its statistics,
-- errors and overruns, then its next due time (or its end); and the
-- worker's exit, which runs every job left once with premature = true.


local bit = require "bit"
local job = require "resty.loom.timer.jobs"
local sched = require "resty.loom.timer.schedule"
local stats = require "resty.loom.timer.stats"
local on_error = require("resty.loom.error_handler").handler

local band = bit.band
local bor = bit.bor
local floor = math.floor
local xpcall = xpcall
local unpack = unpack
local tostring = tostring
local str_sub = string.sub
local record = stats.record
local release_name = job.release_name
local free_job = job.free_job
local enqueue = sched.enqueue
local schedule = sched.schedule

local PENDING = job.PENDING
local QUEUED = job.QUEUED
local RUNNING = job.RUNNING
local PAUSED = job.PAUSED
local F_CANCEL = job.F_CANCEL
local F_PAUSE = job.F_PAUSE
local F_PREMATURE = job.F_PREMATURE
local F_EXTRA = job.F_EXTRA
local ONCE = job.ONCE
local FIXED_RATE = job.FIXED_RATE
local FIXED_DELAY = job.FIXED_DELAY
local MANY_ARGS = job.MANY_ARGS

-- without statistics, runs averaging under this many microseconds share a
-- clock read, lap_group of them at most (core.new)
local SHORT_RUN_US = 2


local function report_error(self, id, rec, err)
    local where = rec and rec.key or "?"
    local name = self.name_of[id]
    local nrec = self.nrec[id]
    if not name and nrec then
        name = nrec.key
    end
    local msg = "[loom.timer] timer created at " .. where
    if name then
        msg = msg .. " (name \"" .. name .. "\")"
    end
    self.log("error", msg .. " failed: " .. tostring(err))
    local short = str_sub(tostring(err), 1, 300)
    if rec then
        rec.errors = rec.errors + 1
        rec.last_error = short
    end
    if nrec then
        nrec.errors = nrec.errors + 1
        nrec.last_error = short
    end
end


local _M = { _VERSION = "0.2.0" }


-- the end of a group of k runs (run_group): reads the clock and sets how
-- many runs the next group may hold: lap_group when they averaged under
-- SHORT_RUN_US since the last read, else 1
local function lap_now(self, k)
    local t = self.lap()
    self.lap_every = t - self.lap_t < k * SHORT_RUN_US and self.lap_group
                     or 1
    self.lap_t = t
    self.last_end = t
    return t
end


-- a run of callbacks starts at t, a fresh clock reading (run_group)
function _M.lap_start(self, t)
    self.lap_t = t
    self.lap_every = self.lap_group
end


-- runs the next queued job; returns false when the queue is empty.
-- now: the clock, when the caller has just read it (a lane passes the end
-- of its previous run: runs back to back cost one clock read each, or,
-- without statistics, one per group of short runs: run_group)
local function run_next(self, now)
    local id, qtime = self.wheel:pop()
    if id == 0 then
        return false
    end
    local j = self.jobs[id]
    local prem = band(j.flags, F_PREMATURE) ~= 0
    local mode = j.mode
    local totals = self.totals
    j.state = RUNNING
    local extra = band(j.flags, F_EXTRA) ~= 0
    -- read by the watchdog (src/ngx_loom_watchdog_sample.c looks for locals of
    -- these names) when the callback stalls the event loop
    local loom_timer_name = extra and self.name_of[id] or nil
    if mode == ONCE and extra then
        release_name(self, id)      -- so the callback may reuse the name
    end

    local clock = self.clock
    local t0 = now or clock()
    if prem and self.exit_deadline and t0 > self.exit_deadline then
        self.last_end = t0
        totals.dropped = totals.dropped + 1
        free_job(self, id)
        return true
    end

    local si = j.site
    local rec = si ~= 0 and self.site_list[si] or nil
    -- without statistics the site is unknown: "|" still marks this frame
    -- as the one that runs the callback
    local loom_timer_site = rec and rec.watchdog_site or "|"
    -- the site's per-run figures (stats.record); rec itself is read again
    -- only on the rare paths below, which keeps it out of the registers
    -- the compiled loop holds across the call
    local sc = rec and rec.c or nil
    local nrec = extra and self.nrec[id] or nil
    if sc then
        sc.running = sc.running + 1
    end
    if nrec then
        nrec.c.running = nrec.c.running + 1
    end
    self.running = self.running + 1

    local pre = self.pre_run
    if pre then
        pre()
    end
    local mrt = extra and self.maxrt[id] or self.max_rt
    -- without statistics the clock is read after a run only when it needs
    -- its end (a fixed delay, a maximum run time, the exit's deadline) or
    -- when the callback yielded (the event loop's millisecond counter
    -- moved); run_group reads it after each group of short runs. The read
    -- was a fifth of what a recurring timer cost without statistics
    -- (issue 27)
    local untimed = self.group_laps and not (prem or mode == FIXED_DELAY
                                             or mrt)
    local m0 = untimed and self.loop_msec[0] or 0
    local fn = self.cb[id]
    local n = j.nargs
    local ok, err
    if n == 0 then
        ok, err = xpcall(fn, on_error, prem)
    elseif n == 1 then
        ok, err = xpcall(fn, on_error, prem, self.a1[id])
    elseif n == 2 then
        ok, err = xpcall(fn, on_error, prem, self.a1[id], self.a2[id])
    else
        local argv = self.argv[id]
        if n == MANY_ARGS then
            n = argv.n
        end
        ok, err = xpcall(fn, on_error, prem, unpack(argv, 1, n))
    end
    -- used after the call, so that the JIT keeps both slots live during
    -- it (a dead slot may hold a stale value when a trace exits)
    self.last_site = loom_timer_site
    self.last_name = loom_timer_name

    local t1 = t0
    if not untimed or self.loop_msec[0] ~= m0 then
        t1 = self.lap()         -- the driver's cheap clock (core.new)
    end
    self.last_end = t1
    self.running = self.running - 1
    j = self.jobs[id]               -- the array may have grown meanwhile
    local rt = t1 - t0
    local late = prem and -1 or t0 - j.due
    local qw = t0 - qtime
    totals.runs = totals.runs + 1
    if prem then
        totals.premature = totals.premature + 1
    end
    if sc then
        sc.running = sc.running - 1
        record(sc, rt, late, qw)
    end
    if nrec then
        local nc = nrec.c
        nc.running = nc.running - 1
        record(nc, rt, late, qw)
        if prem then
            nrec.premature = nrec.premature + 1
        end
    end
    if prem and sc then
        rec = self.site_list[si]
        rec.premature = rec.premature + 1
    end
    if not ok then
        totals.errors = totals.errors + 1
        report_error(self, id, sc and self.site_list[si], err)
    end
    if mrt and rt > mrt then
        totals.overruns = totals.overruns + 1
        rec = sc and self.site_list[si]
        if rec then
            rec.overruns = rec.overruns + 1
        end
        if nrec then
            nrec.overruns = nrec.overruns + 1
        end
        self.log("warn", "[loom.timer] timer created at "
                 .. (rec and rec.key or "?") .. " ran "
                 .. floor(rt / 1000) .. " ms, over its maximum run time of "
                 .. floor(mrt / 1000) .. " ms")
    end

    local flags = j.flags
    if mode == ONCE or prem or self.exiting
       or band(flags, F_CANCEL) ~= 0
    then
        free_job(self, id)

    elseif band(flags, F_PAUSE) ~= 0 then
        j.flags = band(flags, F_EXTRA)
        j.state = PAUSED
        j.due = j.interval
        self.paused = self.paused + 1

    else
        local iv = j.interval
        local due
        if mode == FIXED_RATE then
            due = j.due + iv
            if due <= t1 then
                -- missed ticks are skipped (counted), never run in a burst
                local k = floor((t1 - j.due) / iv)
                due = j.due + (k + 1) * iv
                if due <= t1 then
                    k = k + 1
                    due = due + iv
                end
                local skipped = k
                totals.skipped = totals.skipped + skipped
                rec = sc and self.site_list[si]
                if rec then
                    rec.skipped = rec.skipped + skipped
                end
                if nrec then
                    nrec.skipped = nrec.skipped + skipped
                end
            end
        else
            due = t1 + iv
        end
        schedule(self, id, due)
    end
    return true
end
_M.run_next = run_next


-- runs queued jobs back to back, the end of one the start of the next
-- (now: a clock reading), until the queue is empty or stop (us) has
-- passed; without statistics, short runs go untimed and the clock is read
-- once per group of them. Returns whether jobs are left, and the time.
-- The loop is one of its own: its compiled trace is this path whichever
-- turn the JIT records (a trace recorded on a turn that left the caller's
-- loop took a side exit on every run, issue 27)
function _M.run_group(self, now, stop)
    local more
    while true do
        local every = self.lap_every
        local k = 0
        repeat
            more = run_next(self, now)
            now = self.last_end
            k = k + 1
        until not more or k >= every or now >= stop
        if not more or k < every then
            return more, now
        end
        now = lap_now(self, k)
        if now >= stop then
            return true, now
        end
    end
end


-- worker exit: every pending, queued or paused job is queued to run once
-- with premature = true; recurring jobs that are running now stop after
-- their current run. Returns how many were queued.
function _M.exit(self, deadline_us)
    if self.exiting then
        return 0
    end
    self.exiting = true
    self.exit_deadline = deadline_us
    local now = self.clock()
    self.now_us = now
    local jobs = self.jobs
    local n = 0
    for id = 1, self.top do
        local j = jobs[id]
        local st = j.state
        if st == PENDING or st == PAUSED or st == QUEUED then
            if st == PENDING then
                self.wheel:remove(id)
            elseif st == PAUSED then
                self.paused = self.paused - 1
            end
            j.flags = bor(j.flags, F_PREMATURE)
            if st ~= QUEUED then
                enqueue(self, id, now)
            end
            n = n + 1

        elseif st == RUNNING then
            j.flags = bor(j.flags, F_CANCEL)
        end
    end
    return n
end


return _M
