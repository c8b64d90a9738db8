-- resty.loom.timer: scalable timers for OpenResty.
--
-- A hierarchical timing wheel (resty.loom.timer.core) driven by a small
-- pool of reused native timers ("runners"). The active runner advances the
-- wheel, sleeps on a semaphore until the next deadline (woken early when a
-- sooner timer is added) and runs due callbacks in light threads: a lane
-- runs queued callbacks back to back, and when one of them yields the
-- runner spawns another lane for the rest, so yielding callbacks never hold
-- up the others and non-yielding ones cost no thread at all. After
-- `runner_spawns` lanes a runner hands over to a fresh native timer (its
-- fake request keeps per-thread bookkeeping until it ends) and finishes
-- once its lanes are done. A long pending native "sentinel" timer is fired
-- by nginx with premature = true as soon as the worker exits; it wakes the
-- runner, which runs every pending callback with premature = true.


local core = require "resty.loom.timer.core"
local options = require "resty.loom.opts"
local tstats = require "resty.loom.timer.stats"
local semaphore = require "ngx.semaphore"
local yield = require("resty.loom.yield").yield
local ffi = require "ffi"

local ngx = ngx
local ngx_log = ngx.log
local ERR = ngx.ERR
local WARN = ngx.WARN
local NOTICE = ngx.NOTICE
local spawn = ngx.thread.spawn
local worker_exiting = ngx.worker.exiting
local native_at = ngx.timer.at
local native_every = ngx.timer.every
local native_running_count = ngx.timer.running_count
local native_pending_count = ngx.timer.pending_count
local ceil = math.ceil
local floor = math.floor
local huge = math.huge
local tonumber = tonumber
local type = type
local pairs = pairs
local ipairs = ipairs
local next = next
local error = error
local tostring = tostring
local tbl_concat = table.concat
local tbl_sort = table.sort


pcall(ffi.cdef, [[
typedef struct { long tv_sec; long tv_nsec; } loom_timer_timespec_t;
int loom_timer_clock_gettime(int clk, loom_timer_timespec_t *tp)
    __asm__("clock_gettime");
]])

local C = ffi.C
local CLOCK_MONOTONIC = 1
local ts = ffi.new("loom_timer_timespec_t")


-- monotonic clock in microseconds
local function clock()
    C.loom_timer_clock_gettime(CLOCK_MONOTONIC, ts)
    return tonumber(ts.tv_sec) * 1e6 + floor(tonumber(ts.tv_nsec) / 1000)
end


-- Lanes time each callback with the time-stamp counter of our nginx
-- module (src/ngx_loom_clock.c): a third of the cost of clock_gettime()
-- here, which was a quarter of a recurring timer's cost. run_start()
-- anchors the counter on the monotonic clock at the start of every run of
-- callbacks, so a run's times never drift from that clock; the rate is
-- measured for 2 ms when this module loads, then refined between anchors at
-- least 1 s apart. lap() has no branch on whether the rate is known (a
-- guard that flips once the traces are compiled sends the rest of every
-- run through a side trace). Without the module, lanes use clock().
local has_tsc = pcall(ffi.cdef, "double ngx_loom_ffi_tsc(void);")
                and pcall(function() return C.ngx_loom_ffi_tsc end)
                and C.ngx_loom_ffi_tsc() > 0
local anchor_us, anchor_tsc = 0, 0
local cal_us, cal_tsc = 0, 0
local us_per_tick = 0

if has_tsc then
    cal_us, cal_tsc = clock(), C.ngx_loom_ffi_tsc()
    local us, t
    repeat
        us, t = clock(), C.ngx_loom_ffi_tsc()
    until us - cal_us >= 2000
    if t > cal_tsc then
        us_per_tick = (us - cal_us) / (t - cal_tsc)
        anchor_us, anchor_tsc = us, t
    else
        has_tsc = false
    end
end


-- the event loop's millisecond clock (src/ngx_loom_clock.c), read by a
-- lane without statistics to tell whether a callback yielded
local loop_msec
if pcall(ffi.cdef, "const uint32_t *ngx_loom_ffi_loop_msec(void);") then
    local ok, fn = pcall(function() return C.ngx_loom_ffi_loop_msec end)
    loop_msec = ok and fn() or nil
end


local function run_start()
    local us = clock()
    if has_tsc then
        local t = C.ngx_loom_ffi_tsc()
        if us - cal_us >= 1e6 and t > cal_tsc then
            us_per_tick = (us - cal_us) / (t - cal_tsc)
            cal_us, cal_tsc = us, t
        end
        anchor_us, anchor_tsc = us, t
    end
    return us
end


local function tsc_lap()
    local d = C.ngx_loom_ffi_tsc() - anchor_tsc
    if d < 0 then
        d = 0                   -- counters out of step between CPUs
    end
    return anchor_us + floor(d * us_per_tick)
end


local SENTINEL_DELAY = 86400
local IDLE_SLEEP = 3600
local COLLECTOR = "loom.timer"

local DEFAULTS = {
    resolution = 0.01,
    max_running = 10000,
    max_runners = 16,
    runner_spawns = 1000,
    exit_timeout = 5,
    max_run_time = false,
    stats = true,
    max_names = 1000,
    fresh_ctx = false,
    precise_sites = false,
    slice = 0.002,
}


local cfg = {}
for k, v in pairs(DEFAULTS) do
    cfg[k] = v
end

local eng                 -- the engine (resty.loom.timer.core), per worker
local sema                -- wakes the active runner
local active              -- the runner that drives the wheel, or nil
local starting = false    -- a runner start is in flight
local sentinel_armed = false
local exiting = false
local next_rid = 0
local runners = {}        -- rid -> { threads, spawns, done }
local nrunners = 0
local threads = 0         -- live lanes over all runners
local parked = 0          -- lanes yielding to the event loop between jobs
local counters = {
    runners_started = 0,
    handovers = 0,
    runner_bound_hits = 0,
    thread_bound_hits = 0,
    start_failures = 0,
    lanes_spawned = 0,
}


local _M = {
    _VERSION = "0.2.0",
    native = {
        at = native_at,
        every = native_every,
        running_count = native_running_count,
        pending_count = native_pending_count,
    },
}


local function log_hook(level, msg)
    ngx_log(level == "error" and ERR or WARN, msg)
end


local function wake()
    if sema then
        sema:post(1)
    end
end


local function fresh_ctx()
    ngx.ctx = {}
end


local function engine()
    if not eng then
        eng = core.new({
            resolution = cfg.resolution,
            clock = clock,
            lap = has_tsc and tsc_lap or clock,
            loop_msec = loop_msec,
            wake = wake,
            log = log_hook,
            stats = cfg.stats,
            max_names = cfg.max_names,
            max_run_time = cfg.max_run_time or nil,
            precise_sites = cfg.precise_sites,
            site_level = 4,         -- core.at() is called by _M.at()
            err_level = 3,          -- errors name the caller of _M.at()
        })
        if cfg.fresh_ctx then
            eng.pre_run = fresh_ctx
        end
        sema = semaphore.new()
    end
    return eng
end


local runner_main
local start_runner


-- at the end of the exit: premature callbacks that had not started
-- within exit_timeout were dropped; say how many (the worker's statistics
-- go with it)
local dropped_reported = 0

local function report_dropped(e)
    local n = e.totals.dropped - dropped_reported
    if n > 0 then
        dropped_reported = e.totals.dropped
        ngx_log(WARN, "[loom.timer] worker exiting: ", n, " premature ",
                "callbacks dropped, not started within exit_timeout (",
                cfg.exit_timeout, " s)")
    end
end


-- a lane runs queued callbacks back to back; after `slice` seconds of
-- them it yields to the event loop (resty.loom.yield) so that a large batch
-- does not hold up request processing
local function lane(r)
    local e = eng
    local slice = cfg.slice * 1e6
    local start = run_start()
    local now = start
    local more = true
    e:lap_start(start)
    while more do
        -- (it returns with jobs left only once the slice is over)
        more, now = e:run_group(now, start + slice)
        if more and e:queued() > 0 then
            parked = parked + 1
            yield()
            parked = parked - 1
            -- let the runner look again: if a callback of this lane yields
            -- next, it spawns another lane for the rest of the queue
            sema:post(1)
            start = run_start()
            now = start
            e:lap_start(start)
        end
    end
    r.threads = r.threads - 1
    threads = threads - 1
    if r.done and r.threads == 0 then
        runners[r.id] = nil
        nrunners = nrunners - 1
    end
    if exiting and threads == 0 and e:queued() == 0 then
        report_dropped(e)
    end
end


-- one pass of the dispatcher: spawn lanes while work is queued; returns
-- "handover" when the runner should hand over to a fresh one, "bound" when
-- the lane bound stops it (live lanes keep draining the queue), else nil
local function dispatch(r, e)
    local slice = cfg.slice * 1e6
    local start = clock()
    while e:queued() > 0 do
        if parked > 0 then
            return "bound"          -- a lane pauses and then goes on
        end
        if threads >= cfg.max_running then
            counters.thread_bound_hits = counters.thread_bound_hits + 1
            return "bound"
        end
        if r.spawns >= cfg.runner_spawns and not exiting then
            if nrunners < cfg.max_runners then
                return "handover"
            end
            counters.runner_bound_hits = counters.runner_bound_hits + 1
        end
        r.spawns = r.spawns + 1
        r.threads = r.threads + 1
        threads = threads + 1
        counters.lanes_spawned = counters.lanes_spawned + 1
        local co, err = spawn(lane, r)
        if not co then
            r.threads = r.threads - 1
            threads = threads - 1
            ngx_log(ERR, "[loom.timer] failed to spawn a runner thread: ",
                    err)
            return "bound"
        end
        -- many yielding callbacks in a row: give the event loop a turn
        local now = clock()
        if now - start >= slice then
            yield()
            start = clock()
        end
    end
    return nil
end


local function kick()
    sema:post(1)
end


local function on_exit()
    if exiting then
        return
    end
    exiting = true
    local e = engine()
    local n = e:exit(clock() + cfg.exit_timeout * 1e6)
    if n > 0 then
        ngx_log(NOTICE, "[loom.timer] worker exiting: running ", n,
                " pending timers with premature = true")
    end
    if active then
        e.sleep_until = -huge
        sema:post(1)
        -- nginx runs the sentinel from its shutdown code, outside the event
        -- loop: the posted semaphore event would only be handled once
        -- epoll_wait returns, i.e. at the next timer (possibly the
        -- shutdown timeout). A 0 ms timer makes the loop turn at once.
        local ok, err = native_at(0, kick)
        if not ok then
            ngx_log(ERR, "[loom.timer] failed to wake the runner: ", err)
        end

    elseif not starting and e:queued() > 0 then
        start_runner()
    end
end


local function sentinel(premature)
    if premature then
        on_exit()
        return
    end
    local ok, err = native_at(SENTINEL_DELAY, sentinel)
    if not ok then
        sentinel_armed = false
        ngx_log(ERR, "[loom.timer] failed to re-arm the exit sentinel: ", err)
    end
end


start_runner = function()
    next_rid = next_rid + 1
    starting = true
    local ok, err = native_at(0, runner_main, next_rid)
    if not ok then
        starting = false
        counters.start_failures = counters.start_failures + 1
        ngx_log(ERR, "[loom.timer] failed to start a runner: ", err)
        return nil, err
    end
    counters.runners_started = counters.runners_started + 1
    nrunners = nrunners + 1
    return true
end


-- the runner waits for the wheel's next timer, or when bounded (the live
-- lanes drain the queue) for its next deadline
local function runner_wait(e, res)
    local w
    if res == "bound" then
        w = e:next_deadline()
    else
        w = e:next_wake()
    end
    local timeout
    if w == nil then
        timeout = IDLE_SLEEP
        e.sleep_until = huge
    else
        timeout = ceil((w - clock()) / 1000) / 1000
        if timeout > IDLE_SLEEP then
            -- far cascades: the semaphore takes an int of milliseconds
            timeout = IDLE_SLEEP
        end
        e.sleep_until = w
    end
    if timeout > 0 then
        sema:wait(timeout)
    elseif res == "bound" then
        sema:wait(0.001)
    end
    e.sleep_until = -huge
end


runner_main = function(premature, rid)
    starting = false
    local r = { id = rid, threads = 0, spawns = 0, done = false }
    runners[rid] = r
    active = r
    local e = engine()
    if premature or worker_exiting() then
        on_exit()
    end

    local handover = false
    while true do
        if not exiting and worker_exiting() then
            on_exit()
        end
        if not exiting then
            e:advance(clock())
        end
        local res = dispatch(r, e)
        if res == "handover" then
            handover = true
            break
        end
        if exiting and e:queued() == 0 then
            break
        end
        if exiting and res == "bound" then
            -- the live lanes drain the queue; look again next turn (a new
            -- runner started now would run in this very pass of nginx's
            -- timers and find the same, over and over)
            yield()
        else
            runner_wait(e, res)
        end
    end

    r.done = true
    if active == r then
        active = nil
    end
    if r.threads == 0 then
        runners[rid] = nil
        nrunners = nrunners - 1
    end
    if handover then
        counters.handovers = counters.handovers + 1
        start_runner()
    elseif e:queued() > 0 and not starting then
        start_runner()
    end
end


local function ensure_started()
    if active or starting then
        return
    end
    if not sentinel_armed and not exiting then
        local ok, err = native_at(SENTINEL_DELAY, sentinel)
        if not ok then
            ngx_log(ERR, "[loom.timer] failed to arm the exit sentinel: ",
                    err)
        else
            sentinel_armed = true
        end
    end
    start_runner()
end


-- API ---------------------------------------------------------------------


-- the rules of DEFAULTS' keys
local RULES = {
    resolution = options.number(0.001, 1),
    max_running = options.whole(1, 1e6),
    max_runners = options.whole(1, 1024),
    runner_spawns = options.whole(1, 1e7),
    exit_timeout = options.number(0.001, 86400),
    max_run_time = options.or_value(options.number(0.001, 86400), false,
                                    "false"),
    stats = options.boolean,
    max_names = options.whole(0, 1e6),
    fresh_ctx = options.boolean,
    precise_sites = options.boolean,
    slice = options.number(0.0001, 1),
}


-- configure(opts): before the first timer (init_by_lua or
-- init_worker_by_lua). Every option is checked before any is taken.
function _M.configure(opts)
    if eng then
        error("configure() must be called before the first timer", 2)
    end
    options.check(opts, RULES, 2)
    for k, v in pairs(opts) do
        cfg[k] = v
    end
    return true
end


local e_at = core.at
local e_every = core.every


-- timers made in init_by_lua would be copied into every worker by fork
local function check_phase()
    if ngx.get_phase() == "init" then
        error("API disabled in the context of init_by_lua*", 3)
    end
end


function _M.at(delay, callback, ...)
    if not active and not starting then
        check_phase()
    end
    local e = eng or engine()
    local h, err = e_at(e, delay, callback, ...)
    if h and not active then
        ensure_started()
    end
    return h, err
end


function _M.every(interval, callback, ...)
    if type(interval) == "table" and interval.unique ~= nil then
        -- once per cluster: resty.loom.cluster.timer (see docs/cluster.md)
        local h, err = require("resty.loom.cluster.timer").every(
            _M, interval, callback, ...)
        return h, err
    end
    if not active and not starting then
        check_phase()
    end
    local e = eng or engine()
    local h, err = e_every(e, interval, callback, ...)
    if h and not active then
        ensure_started()
    end
    return h, err
end


local e_cancel = core.cancel


function _M.cancel(handle)
    return e_cancel(eng or engine(), handle)
end


function _M.pause(handle)
    return engine():pause(handle)
end


function _M.resume(handle)
    local ok, err = engine():resume(handle)
    if ok and not active then
        ensure_started()
    end
    return ok, err
end


function _M.is_active(handle)
    return engine():is_active(handle)
end


function _M.state(handle)
    return engine():state(handle)
end


function _M.handle(name)
    return engine():handle(name)
end


function _M.running_count()
    return eng and eng.running or 0
end


function _M.pending_count()
    return eng and eng:pending_count() or 0
end


-- luacheck: push ignore 122

-- replaces ngx.timer.at/every/running_count/pending_count in this Lua VM
function _M.patch()
    local t = ngx.timer
    t.at = _M.at
    t.every = _M.every
    t.running_count = _M.running_count
    t.pending_count = _M.pending_count
    return true
end


function _M.unpatch()
    local t = ngx.timer
    t.at = native_at
    t.every = native_every
    t.running_count = native_running_count
    t.pending_count = native_pending_count
    return true
end

-- luacheck: pop


-- statistics --------------------------------------------------------------


local function pool_stats()
    local busy = 0
    for _, r in pairs(runners) do
        if r.threads > 0 then
            busy = busy + 1
        end
    end
    local running = eng and eng.running or 0
    return {
        runners = {
            alive = nrunners,
            busy = busy,
            idle = nrunners - busy,
            max = cfg.max_runners,
            started = counters.runners_started,
            handovers = counters.handovers,
            bound_hits = counters.runner_bound_hits,
            start_failures = counters.start_failures,
        },
        threads = {
            alive = threads,
            busy = running,
            idle = threads - running,
            max = cfg.max_running,
            spawned = counters.lanes_spawned,
            bound_hits = counters.thread_bound_hits,
        },
    }
end


local STATS_RULES = { raw = options.boolean }


-- this worker's statistics; opts.raw keeps the histograms (for merging)
function _M.stats(opts)
    local raw = false
    if opts ~= nil then
        options.check(opts, STATS_RULES, 2)
        raw = opts.raw or false
    end
    local out = engine():stats(raw)
    local pool = pool_stats()
    out.runners = pool.runners
    out.threads = pool.threads
    out.worker = ngx.worker.id()
    out.pid = ngx.worker.pid()
    out.exiting = exiting
    return out
end


local function get_bus()
    local ok, events = pcall(require, "resty.loom.events")
    if not ok or type(events) ~= "table" or not events.get then
        return nil
    end
    local ok2, bus = pcall(events.get)
    if ok2 then
        return bus
    end
    return nil
end


-- registers the cross-worker collector with resty.loom.events (call in
-- init_by_lua or init_worker_by_lua); returns true, or nil and an error
function _M.register_collector()
    local ok, events = pcall(require, "resty.loom.events")
    if not ok or type(events) ~= "table"
       or not events.register_collector
    then
        return nil, "resty.loom.events is not available"
    end
    local ok2, err = pcall(events.register_collector, COLLECTOR, function()
        return _M.stats({ raw = true })
    end)
    if not ok2 then
        return nil, "failed to register the collector: " .. tostring(err)
    end
    return true
end


local NUM_FIELDS = { "timers", "pending", "queued", "running", "paused",
                     "capacity" }


local function merge_workers(per)
    local total = { totals = {}, sites = {}, names = {},
                    runners = {}, threads = {} }
    for _, f in ipairs(NUM_FIELDS) do
        total[f] = 0
    end
    local sites, names = {}, {}
    for _, w in pairs(per) do
        for _, f in ipairs(NUM_FIELDS) do
            total[f] = total[f] + (w[f] or 0)
        end
        for _, grp in ipairs({ "totals", "runners", "threads" }) do
            for k, v in pairs(w[grp] or {}) do
                if type(v) == "number" then
                    total[grp][k] = (total[grp][k] or 0) + v
                end
            end
        end
        total.resolution = w.resolution
        for k, rec in pairs(w.sites or {}) do
            sites[k] = tstats.merge(sites[k], rec)
        end
        for k, rec in pairs(w.names or {}) do
            names[k] = tstats.merge(names[k], rec)
        end
    end
    for k, rec in pairs(sites) do
        total.sites[k] = tstats.summary(rec)
    end
    for k, rec in pairs(names) do
        total.names[k] = tstats.summary(rec)
    end
    return total, sites
end


local function summarize_worker(w)
    local out = {}
    for k, v in pairs(w) do
        out[k] = v
    end
    out.sites, out.names = {}, {}
    for k, rec in pairs(w.sites or {}) do
        out.sites[k] = tstats.summary(rec)
    end
    for k, rec in pairs(w.names or {}) do
        out.names[k] = tstats.summary(rec)
    end
    return out
end


-- statistics of every worker (through resty.loom.events when a bus
-- exists, else this worker only): { workers = { [id] = stats }, total =
-- merged stats, source = "events" | "local" }, plus the merged raw site
-- records (for flame graphs) as a second value
function _M.stats_all(timeout)
    if timeout ~= nil and (type(timeout) ~= "number"
                           or not (timeout > 0 and timeout <= 60))
    then
        error("timeout must be a number of seconds over 0, at most 60", 2)
    end
    local per
    local source = "local"
    local bus = get_bus()
    if bus then
        local ok, res = pcall(bus.collect, bus, COLLECTOR, timeout or 2)
        if ok and type(res) == "table" and next(res) then
            per = res
            source = "events"
        end
    end
    if not per then
        per = { [ngx.worker.id() or 0] = _M.stats({ raw = true }) }
    end
    local total, raw_sites = merge_workers(per)
    local workers = {}
    for id, w in pairs(per) do
        workers[tostring(id)] = summarize_worker(w)
    end
    return { source = source, total = total, workers = workers }, raw_sites
end


-- folded stacks (flamegraph.pl / speedscope format) of where timer time
-- goes: creation stack, then the callback, weighted by metric
-- ("run_time" in microseconds, "runs", "pending" or "errors")
function _M.folded(metric, sites)
    metric = metric or "run_time"
    local field = ({ run_time = "rt_sum", runs = "runs",
                     pending = "pending", errors = "errors" })[metric]
    if not field then
        error("metric must be run_time, runs, pending or errors", 2)
    end
    if not sites then
        local _
        _, sites = _M.stats_all()
    end
    local lines = {}
    for key, rec in pairs(sites) do
        local v = floor((rec[field] or 0) + 0.5)
        if v > 0 then
            lines[#lines + 1] = (rec.stack or key) .. " " .. v
        end
    end
    tbl_sort(lines)
    return tbl_concat(lines, "\n") .. (#lines > 0 and "\n" or "")
end


-- content handlers for the gateway ---------------------------------------


function _M.serve_json()
    local cjson = require "cjson.safe"
    local arg = ngx.var.arg_timeout
    local timeout = tonumber(arg or 2)
    if not (timeout and timeout > 0 and timeout <= 60) then
        ngx.status = 400
        ngx.header["Content-Type"] = "text/plain"
        ngx.say("bad timeout: ", arg)
        return
    end
    local data = _M.stats_all(timeout)
    if ngx.var.arg_stacks ~= "1" then
        for _, s in pairs(data.total.sites) do
            s.stack = nil
        end
        for _, w in pairs(data.workers) do
            for _, s in pairs(w.sites) do
                s.stack = nil
            end
            for _, s in pairs(w.names) do
                s.stack = nil
            end
        end
        for _, s in pairs(data.total.names) do
            s.stack = nil
        end
    end
    ngx.header["Content-Type"] = "application/json"
    ngx.say(cjson.encode(data))
end


function _M.serve_flamegraph()
    local flamegraph = require "resty.loom.flamegraph"
    local metric = ngx.var.arg_metric or "run_time"
    local ok, folded = pcall(_M.folded, metric)
    if not ok then
        ngx.status = 400
        ngx.header["Content-Type"] = "text/plain"
        ngx.say("bad metric: ", metric)
        return
    end
    if ngx.var.arg_format == "folded" then
        ngx.header["Content-Type"] = "text/plain"
        ngx.print(folded)
        return
    end
    ngx.header["Content-Type"] = "image/svg+xml"
    local svg = flamegraph.svg(folded, {
        title = "resty.loom.timer: " .. metric,
        unit = metric == "run_time" and "us" or metric,
    })
    ngx.print(svg)
end


return _M
