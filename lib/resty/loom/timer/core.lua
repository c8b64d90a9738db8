-- The timer engine without nginx: job store, timing wheel, ready list,
-- run/reschedule logic and statistics, driven by an injected clock
-- (microseconds). resty.loom.timer drives it from native timers; the unit
-- tests drive it with a fake clock. This module makes an engine and gathers
-- its methods: jobs, schedule, sites, create, control and run hold the rest.


local options = require "resty.loom.opts"
local wheel = require "resty.loom.timer.wheel"
local stats = require "resty.loom.timer.stats"
local job = require "resty.loom.timer.jobs"
local sched = require "resty.loom.timer.schedule"
local create = require "resty.loom.timer.create"
local control = require "resty.loom.timer.control"
local run = require "resty.loom.timer.run"

local floor = math.floor
local huge = math.huge
local random = math.random
local error = error
local setmetatable = setmetatable
local pairs = pairs
local new_store = job.new_store

local ok_new, tbl_new = pcall(require, "table.new")
if not ok_new then
    tbl_new = function() return {} end
end


local ID_SPAN = job.ID_SPAN
-- without statistics, short runs share one clock read per this many
-- (resty.loom.timer.run's lap_now)
local LAP_GROUP = 16


-- any value (ctx is only handed back to wake)
local function any() end

local function is_cdata(v)
    return type(v) == "cdata"
end

local RULES = {
    resolution = options.number(0.001, 1),
    clock = options.func,
    lap = options.func,
    wake = options.func,
    ctx = any,
    log = options.func,
    random = options.func,
    stats = options.boolean,
    precise_sites = options.boolean,
    site_level = options.whole(1, 100),
    err_level = options.whole(1, 100),
    max_run_time = options.above(0, 1e9),
    max_names = options.whole(0, 1e6),
    loop_msec = options.test(is_cdata, "a pointer (cdata)"),
}


local _M = {
    _VERSION = "0.2.0",
    MAX_TIMERS = ID_SPAN - 1,
    LAP_GROUP = LAP_GROUP,
    at = create.at,
    every = create.every,
    cancel = control.cancel,
    pause = control.pause,
    resume = control.resume,
    state = control.state,
    is_active = control.is_active,
    handle = control.handle,
    advance = sched.advance,
    next_wake = sched.next_wake,
    next_deadline = sched.next_deadline,
    queued = sched.queued,
    run_next = run.run_next,
    run_group = run.run_group,
    lap_start = run.lap_start,
    exit = run.exit,
}
local mt = { __index = _M }


local function default_log(_, msg)
    io.stderr:write(msg, "\n")
end


function _M.new(opts)
    opts = opts or {}
    options.check(opts, RULES, 2)
    local clock = opts.clock
    if clock == nil then
        error("opts.clock is required", 2)
    end
    local res = opts.resolution or 0.01
    local max_rt = opts.max_run_time
    local max_names = opts.max_names or 1000
    local cap = 1024
    local res_us = floor(res * 1e6 + 0.5)
    local now = clock()
    local store = new_store(cap + 1)
    local group_laps = opts.stats == false and opts.loop_msec ~= nil
    local self = {
        res = res_us,
        clock = clock,
        lap = opts.lap or clock,    -- a cheaper clock within a run (us)
        wake = opts.wake,           -- wake(ctx): the earliest deadline moved
        -- the low 32 bits of the event loop's millisecond clock: a
        -- callback that yields lets it move. Without it (or with
        -- statistics) every run is timed
        loop_msec = opts.loop_msec,
        -- without statistics, short runs go untimed and a lane reads the
        -- clock after each group of at most lap_group of them (run.lap_now)
        group_laps = group_laps,
        lap_group = group_laps and LAP_GROUP or huge,
        lap_every = group_laps and LAP_GROUP or huge,
        lap_t = now,                -- the last read (run.lap_now)
        ctx = opts.ctx,
        log = opts.log or default_log,
        random = opts.random or random,
        with_stats = opts.stats ~= false,
        precise_sites = opts.precise_sites and true or false,
        site_level = opts.site_level or 3,  -- stack level of at()'s caller
        err_level = opts.err_level or 2,    -- error() level of at()'s caller
        max_rt = max_rt and max_rt * 1e6 or nil,
        max_names = max_names,
        sleep_until = -math.huge,   -- set by the driver while it sleeps
        last_site = nil,            -- watchdog site and name of the last run
        last_name = nil,
        wheel = wheel.new(floor(now / res_us), cap),
        store = store,
        jobs = store.ptr,
        cap = cap,
        top = 0,
        free = tbl_new(64, 0),
        nfree = 0,
        cb = tbl_new(cap, 0),
        a1 = tbl_new(cap, 0),
        a2 = tbl_new(cap, 0),
        argv = {},
        nrec = {},
        name_of = {},
        maxrt = {},
        names = {},
        alive = 0,
        running = 0,
        paused = 0,
        exiting = false,
        exit_deadline = nil,
        sites = {},
        site_list = {},             -- index (job.site) -> site record
        nsites = 0,
        site_by_cb = {},            -- callback -> site record (bounded)
        last_cb = nil,              -- the last callback seen and its site
        last_rec = nil,
        ncached = 0,
        name_stats = {},
        nnames = 0,
        totals = {
            created = 0, runs = 0, errors = 0, cancelled = 0,
            overruns = 0, skipped = 0, premature = 0, dropped = 0,
        },
    }
    return setmetatable(self, mt)
end


-- counts ----------------------------------------------------------------


function _M.pending_count(self)
    return self.alive - self.running
end


function _M.running_count(self)
    return self.running
end


function _M.counts(self)
    return {
        timers = self.alive,
        pending = self.wheel.count,
        queued = self.wheel.ready,
        running = self.running,
        paused = self.paused,
        capacity = self.cap,
    }
end


-- statistics as plain tables; raw = true keeps the histograms (for merging
-- across workers)
function _M.stats(self, raw)
    local sites, names = {}, {}
    local conv = raw and stats.raw or stats.summary
    for key, rec in pairs(self.sites) do
        sites[key] = conv(rec)
    end
    for key, rec in pairs(self.name_stats) do
        names[key] = conv(rec)
    end
    local totals = {}
    for k, v in pairs(self.totals) do
        totals[k] = v
    end
    local out = self:counts()
    out.totals = totals
    out.sites = sites
    out.names = names
    out.resolution = self.res / 1e6
    return out
end


return _M
