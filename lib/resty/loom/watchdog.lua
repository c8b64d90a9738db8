-- resty.loom.watchdog: finds what blocks the nginx event loop, in
-- production.
--
-- The C part (src/ngx_loom_watchdog*.c) times every event-loop iteration,
-- and a watchdog thread per worker looks at the main thread while an
-- iteration runs too long: on or off CPU, which system call, and a Lua
-- backtrace taken at a VM safe point during the stall. This module turns
-- the finished stalls into reports (a ring), log lines (rate limited),
-- loop-lag figures and folded stacks for a flame graph.


local ffi = require "ffi"
local semaphore = require "ngx.semaphore"
local options = require "resty.loom.opts"
local names = require "resty.loom.watchdog.names"
local report = require "resty.loom.watchdog.report"
local log = require "resty.loom.watchdog.log"
local timers = require "resty.loom.watchdog.timers"
require "resty.loom.watchdog.cdef"

local C = ffi.C
local ffi_new = ffi.new
local ffi_string = ffi.string
local ngx = ngx
local ngx_log = ngx.log
local ngx_WARN = ngx.WARN
local ngx_ERR = ngx.ERR
local ngx_timer_at = ngx.timer.at
local ngx_worker_exiting = ngx.worker.exiting
local ngx_get_phase = ngx.get_phase
local tonumber = tonumber
local type = type
local pairs = pairs
local ipairs = ipairs
local error = error
local pcall = pcall
local str_gmatch = string.gmatch
local str_match = string.match
local tbl_concat = table.concat
local tbl_sort = table.sort
local tbl_remove = table.remove
local BP_ERRORS = names.BP_ERRORS
local round = report.round
local drain_samples = report.drain_samples
local build_report = report.build
local log_report = log.report
local summary_line = log.summary_line
local wrap_timers = timers.wrap


local LOG_TAG = log.TAG
local NBUCKETS = 18

-- upper bounds of the C histogram buckets, milliseconds
local BOUNDS_MS = { 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250,
                    500, 1000, 2500, 5000, 10000 }

local DEFAULTS = {
    threshold = 100,        -- ms: an iteration this long is a stall
    interval = 0,           -- ms: watchdog tick, 0 = min(threshold/4, 10)
    long = 1000,            -- ms: log "still blocked" while it lasts, 0 off
    max_samples = 100,      -- Lua stack samples per stall
    backtraces = true,      -- Lua backtraces (LuaJIT profiler hook)
    breakpoints = true,     -- off-CPU backtraces via a return breakpoint
    ring = 32,              -- reports kept per worker
    log = true,             -- one error-log line per stall
    log_burst = 5,          -- at most this many lines ...
    log_interval = 10,      -- ... per this many seconds
    timers = true,          -- note where ngx.timer.at/every timers come from
}


local _M = { _VERSION = "0.2.0" }


local state = {
    started = false,
    opts = nil,
    sema = nil,
    ring = {},              -- newest last
    count = 0,              -- reports made by this worker
}

local report_buf = ffi_new("loom_wd_report_t")
local errmsg = ffi_new("char *[1]")


local function drain()
    if not state.started then
        return 0
    end

    local opts = state.opts
    local by_seq
    local n = 0

    while C.ngx_loom_ffi_watchdog_pop(report_buf) == 1 do
        if not by_seq then
            by_seq = {}
            drain_samples(by_seq)
        end

        local samples = by_seq[tonumber(report_buf.seq)] or {}
        local ok, r = pcall(build_report, report_buf, samples,
                            opts.threshold)
        if not ok then
            ngx_log(ngx_ERR, LOG_TAG, "failed to build a report: ", r)

        else
            n = n + 1
            state.count = state.count + 1
            local ring = state.ring
            ring[#ring + 1] = r
            while #ring > opts.ring do
                tbl_remove(ring, 1)
            end

            if opts.log then
                log_report(r, opts)
            end
        end
    end

    if by_seq then
        C.ngx_loom_ffi_watchdog_samples_reset()
    end

    return n
end


local function drain_loop(premature)
    if premature then
        return
    end

    local sema = state.sema
    while not ngx_worker_exiting() do
        sema:wait(0.5)
        local ok, err = pcall(drain)
        if not ok then
            ngx_log(ngx_ERR, LOG_TAG, "drain failed: ", err)
        end
    end
end


local MAX_RING = 100000

-- the rules of DEFAULTS' keys
local RULES = {
    threshold = options.number(1, 3600000),     -- ms, up to an hour
    interval = options.or_value(options.number(1, 1000), 0, "0 (auto)"),
    long = options.or_value(options.number(1, 86400000), 0, "0 (off)"),
    max_samples = options.whole(0, 100000),
    backtraces = options.boolean,
    breakpoints = options.boolean,
    ring = options.whole(1, MAX_RING),
    log = options.boolean,
    log_burst = options.whole(1, 1000000),
    log_interval = options.number(0.001, 86400),  -- s
    timers = options.boolean,
}

local REPORTS_RULES = { limit = options.whole(0, MAX_RING) }

-- what configure() cannot change
local START_ONLY = { "backtraces", "breakpoints", "timers" }


-- the options of start() or configure() over base (valid); raises (at the
-- level of their caller) before anything changes
local function check_opts(opts, base)
    if opts == nil then
        opts = {}
    end
    options.check(opts, RULES, 3)

    local o = {}
    for k, v in pairs(base) do
        o[k] = v
    end
    for k, v in pairs(opts) do
        o[k] = v
    end
    if o.interval > o.threshold then
        error("opts.interval must be at most opts.threshold", 3)
    end

    return o
end


local function c_conf(o)
    local conf = ffi_new("loom_wd_conf_t")
    conf.threshold_ms = o.threshold
    conf.interval_ms = o.interval
    conf.long_ms = o.long
    conf.max_samples = o.max_samples
    conf.profile = o.backtraces and 1 or 0
    conf.breakpoints = o.breakpoints and 1 or 0
    return conf
end


-- watchdog.start(opts): init_worker_by_lua only
function _M.start(opts)
    local o = check_opts(opts, DEFAULTS)

    if ngx_get_phase() ~= "init_worker" then
        error("watchdog.start must be called in init_worker_by_lua", 2)
    end

    if state.started then
        return nil, "already started"
    end

    local sema, err = semaphore.new(0)
    if not sema then
        return nil, "failed to create a semaphore: " .. err
    end

    local rc = C.ngx_loom_ffi_watchdog_start(c_conf(o), sema.sem, errmsg)
    if rc ~= 0 then
        return nil, "failed to start: " .. ffi_string(errmsg[0])
    end

    state.started = true
    state.opts = o
    state.sema = sema

    local ok, terr = ngx_timer_at(0, drain_loop)
    if not ok then
        C.ngx_loom_ffi_watchdog_detach()
        return nil, "failed to start the report timer: " .. terr
    end

    if o.timers then
        wrap_timers()
    end

    local has_events, events = pcall(require, "resty.loom.events")
    if has_events and type(events) == "table"
       and events.register_collector
    then
        events.register_collector("loom.watchdog", function()
            return { stats = _M.stats(), reports = _M.reports() }
        end)
    end

    return true
end


-- watchdog.configure(opts): change options of this worker at run time
function _M.configure(opts)
    if not state.started then
        return nil, "not started"
    end
    local o = check_opts(opts, state.opts)
    for _, k in ipairs(START_ONLY) do
        if o[k] ~= state.opts[k] then
            error("opts." .. k .. " can only be set by start", 2)
        end
    end
    state.opts = o
    C.ngx_loom_ffi_watchdog_configure(c_conf(o))
    return true
end


-- watchdog.enable(on): pause or resume the loop timing of this worker
function _M.enable(on)
    if not state.started then
        return nil, "not started"
    end
    if C.ngx_loom_ffi_watchdog_enable(on and 1 or 0) ~= 0 then
        return nil, "not running"
    end
    return true
end


function _M.stats()
    drain()

    local s = C.ngx_loom_ffi_watchdog_stats()
    local total = tonumber(s.iterations)
    local hist = {}
    for i = 0, NBUCKETS - 1 do
        hist[i + 1] = {
            le_ms = BOUNDS_MS[i + 1] or "inf",
            count = tonumber(s.buckets[i]),
        }
    end

    local function quantile(q)
        if total == 0 then
            return 0
        end
        local want = q * total
        local seen = 0
        for i = 1, NBUCKETS do
            seen = seen + hist[i].count
            if seen >= want then
                local ub = BOUNDS_MS[i]
                if not ub then
                    return round(tonumber(s.max_ns) / 1e6, 3)
                end
                return ub
            end
        end
        return 0
    end

    local function over(ms)
        local n = 0
        for i = 1, NBUCKETS do
            local lb = BOUNDS_MS[i - 1] or 0
            if lb >= ms then
                n = n + hist[i].count
            end
        end
        return n
    end

    local bp = "untried"
    if s.bp_state == 1 then
        bp = "works"
    elseif s.bp_state == -1 then
        bp = "unavailable (" .. (BP_ERRORS[s.bp_errno]
                                 or ("errno " .. s.bp_errno)) .. ")"
    end

    local opts = state.opts or DEFAULTS
    return {
        running = s.running ~= 0,
        worker = ngx.worker.id(),
        pid = ngx.worker.pid(),
        threshold_ms = opts.threshold,
        iterations = total,
        busy_ms = round(tonumber(s.busy_ns) / 1e6, 1),
        max_ms = round(tonumber(s.max_ns) / 1e6, 3),
        p50_ms = quantile(0.5),
        p99_ms = quantile(0.99),
        p999_ms = quantile(0.999),
        over_10ms = over(10),
        over_100ms = over(100),
        over_1s = over(1000),
        stalls = tonumber(s.stalls),
        reports = state.count,
        reports_dropped = tonumber(s.reports_dropped),
        busy_now_ms = round(C.ngx_loom_ffi_watchdog_busy_ms(), 3),
        backtraces = s.profiler ~= 0,
        breakpoints = bp,
        samples = tonumber(s.samples),
        samples_dropped = tonumber(s.samples_dropped),
        sample_requests = tonumber(s.signals) + tonumber(s.breakpoints),
        histogram = hist,
    }
end


-- newest first; opts.limit (default all)
function _M.reports(opts)
    local limit
    if opts ~= nil then
        options.check(opts, REPORTS_RULES, 2)
        limit = opts.limit
    end
    drain()
    limit = limit or #state.ring
    local out = {}
    local ring = state.ring
    for i = #ring, 1, -1 do
        if #out >= limit then
            break
        end
        out[#out + 1] = ring[i]
    end
    return out
end


-- folded stacks of the reports kept (values in milliseconds)
function _M.folded(reports)
    reports = reports or _M.reports()
    local sums = {}
    for _, r in ipairs(reports) do
        for line in str_gmatch(r.folded or "", "[^\n]+") do
            local stack, v = str_match(line, "^(.*) (%d+)$")
            if stack then
                sums[stack] = (sums[stack] or 0) + tonumber(v)
            end
        end
    end
    local lines = {}
    for k, v in pairs(sums) do
        lines[#lines + 1] = k .. " " .. v
    end
    tbl_sort(lines)
    return tbl_concat(lines, "\n")
end


function _M.flamegraph(reports, opts)
    local flamegraph = require "resty.loom.flamegraph"
    if opts == nil then
        opts = {}
    end
    -- the renderer's options, refused before any report is drained
    options.check(opts, flamegraph.RULES, 2)
    local o = { title = "Event-loop stalls", unit = "ms" }
    for k, v in pairs(opts) do
        o[k] = v
    end
    -- the SVG alone: ngx.print(watchdog.flamegraph()) must serve a valid
    -- document (the renderer's second value, the frame count, would follow
    -- </svg>)
    local svg = flamegraph.svg(_M.folded(reports), o)
    return svg
end


-- every worker's stats and reports through the events bus when there is
-- one, else this worker's only: { [worker_id] = { stats =, reports = } }
function _M.collect(timeout)
    local ok, events = pcall(require, "resty.loom.events")
    local bus = ok and type(events) == "table" and events.get
                and events.get()
    if bus then
        local res, err = bus:collect("loom.watchdog", timeout or 2)
        if res then
            return res
        end
        ngx_log(ngx_WARN, LOG_TAG, "collect failed, this worker only: ",
                err)
    end
    return { [ngx.worker.id()] = { stats = _M.stats(),
                                   reports = _M.reports() } }
end


_M.summary_line = summary_line
_M._drain = drain


return _M
