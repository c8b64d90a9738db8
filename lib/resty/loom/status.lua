-- resty.loom.status: one view of every worker. Each worker answers a
-- "loom.status" collect on the events bus with a snapshot of the loaded
-- modules' figures, already in one vocabulary (seconds, bytes, `_total`
-- counters, one histogram shape); the worker serving the request merges
-- the answers into one document and marks the workers that did not answer
-- in time. This file is the one place that maps each module's own stats
-- fields to that vocabulary. See docs/observability.md.


local hist = require "resty.loom.status.hist"
local lhist = require "resty.loom.histogram"
local tstats = require "resty.loom.timer.stats"

local ngx = ngx
local ngx_now = ngx.now
local ngx_update_time = ngx.update_time
local pairs = pairs
local next = next
local ipairs = ipairs
local type = type
local tonumber = tonumber
local tostring = tostring
local pcall = pcall
local error = error
local huge = math.huge
local floor = math.floor
local str_format = string.format
local str_find = string.find
local str_sub = string.sub
local str_match = string.match
local tbl_sort = table.sort
local loaded = package.loaded

local COLLECTOR = "loom.status"
local PUBLISH_COLLECTOR = "loom.publish"
local MODULES = { "events", "timers", "offload", "watchdog", "publish" }
local REPORTS_KEPT = 8             -- stall reports per worker in a snapshot
-- timer names with figures in a snapshot (the first ones in sort order,
-- so the set stays the same from one scrape to the next): a name's
-- figures are about 1.3 KB on the bus, and the timer module keeps up to
-- 1000 names by default, which made a worker's answer larger than the
-- bus takes (and the snapshot slow)
local NAMES_KEPT = 100
-- the reasons resty.loom.events counts its drops under (docs/events.md),
-- shown at 0 before their first drop: a series that appears with its
-- first drop hides that drop from increase(), and from the alerts on it
local EVENTS_DROPPED = { "queue full", "oldest", "payload too large",
                         "handler share", "closed", "exit" }
local BROKER_DROPPED = { "subscriber too slow", "worker down, queue full",
                         "worker gone", "bad target" }
local MAX_TIMEOUT = 10

-- the log-bucket histograms of resty.loom.histogram (events, publish):
-- bucket i holds [MIN * GROWTH^i, MIN * GROWTH^(i+1)) s, bucket 0 also
-- what is below
local LH_MIN, LH_GROWTH = lhist.MIN, lhist.GROWTH
local LH_LAST = lhist.NBUCKETS - 1
-- resty.loom.timer.stats: bucket 0 is under 1 us, bucket i >= 1 holds
-- [GROWTH^(i-1), GROWTH^i) us
local TH_GROWTH, TH_LAST = tstats.GROWTH, tstats.BUCKETS - 1


local _M = { _VERSION = "0.2.0" }

local started = ngx_now()


-- bucket bounds of both layouts, computed once
local LH_LO, LH_HI, TH_LO, TH_HI = {}, {}, {}, {}
for i = 0, LH_LAST do
    LH_LO[i] = i == 0 and 0 or LH_MIN * LH_GROWTH ^ i
    LH_HI[i] = i == LH_LAST and huge or LH_MIN * LH_GROWTH ^ (i + 1)
end
for i = 0, TH_LAST do
    TH_LO[i] = i == 0 and 0 or TH_GROWTH ^ (i - 1) / 1e6
    TH_HI[i] = i == TH_LAST and huge or (i == 0 and 1e-6
                                         or TH_GROWTH ^ i / 1e6)
end


local function lh_lower(i)
    return LH_LO[i]
end


local function lh_upper(i)
    return LH_HI[i]
end


local function th_lower(i)
    return TH_LO[i]
end


local function th_upper(i)
    return TH_HI[i]
end


-- a resty.loom.histogram object
local function from_lh(h)
    local b = h.buckets
    return hist.rebin(function(i) return tonumber(b[i]) end, 0, LH_LAST,
                      lh_lower, lh_upper, h.sum)
end


-- { [reason] = count }, the known reasons at 0 unless counted
local function by_reason(t, known)
    local out = {}
    for _, r in ipairs(known) do
        out[r] = 0
    end
    for r, n in pairs(type(t) == "table" and t or {}) do
        out[r] = tonumber(n) or 0
    end
    return out
end


local function sum_kinds(t)
    if type(t) ~= "table" then
        return tonumber(t) or 0
    end
    local n = 0
    for _, v in pairs(t) do
        n = n + (tonumber(v) or 0)
    end
    return n
end


-- mappings, one per module -----------------------------------------------


local function map_events(bus)
    local s = bus:stats()
    local q = s.queue or {}
    local out = {
        connected = s.connected and true or false,
        published_total = sum_kinds(s.published),
        delivered_total = s.delivered,
        handler_calls_total = s.handler_calls,
        handler_errors_total = s.handler_errors,
        dropped_total = sum_kinds(s.dropped),
        dropped_by_reason = by_reason(s.dropped, EVENTS_DROPPED),
        gaps_total = s.gaps,
        duplicates_total = s.duplicates,
        reconnects_total = s.reconnects,
        rejected_total = s.rejected,
        queue_events = (q.unsent or 0) + (q.unacked or 0),
        queue_bytes = q.pending_bytes,
        inbox_events = q.inbox,
    }
    local ring = s.ring
    if ring then
        out.ring_events_total = ring.events
        out.ring_full_total = ring.full
        out.ring_overwritten_total = ring.overwritten
        out.ring_held_bytes = ring.held
    end
    if bus.latency then
        out.delivery_seconds = from_lh(bus.latency)
    end
    local b = s.broker
    if type(b) == "table" then
        local qe, qb = 0, 0
        for _, bq in pairs(b.queues or {}) do
            qe = qe + (bq.events or 0)
            qb = qb + (bq.bytes or 0)
        end
        out.broker = {
            connections = b.connections,
            accepted_total = b.accepted,
            rejected_total = sum_kinds(b.rejected),
            forwarded_total = b.forwarded,
            unique_suppressed_total = b.unique_suppressed,
            dropped_total = sum_kinds(b.dropped),
            dropped_by_reason = by_reason(b.dropped, BROKER_DROPPED),
            slow_waits_total = b.slow_waits,
            urgent_missed_total = b.urgent_missed,
            queue_events = qe,
            queue_bytes = qb,
        }
    end
    return out
end


-- the histograms of raw timer records (from stats({ raw = true })),
-- added up
local function timer_hist(recs, field, sum)
    local dense = {}
    for _, rec in pairs(recs) do
        for k, c in pairs(rec[field] or {}) do
            local i = tonumber(k)
            dense[i] = (dense[i] or 0) + c
        end
    end
    return hist.rebin(function(i) return dense[i] end, 0, TH_LAST,
                      th_lower, th_upper, sum)
end


-- a raw timer record's (or a set of them) figures: run time sums are
-- kept, lateness and queue wait sums are estimated from the buckets
local function timer_figures(recs, out)
    local rt_sum = 0
    for _, rec in pairs(recs) do
        rt_sum = rt_sum + (rec.rt_sum or 0)
    end
    out.run_seconds = timer_hist(recs, "rt", rt_sum / 1e6)
    out.lateness_seconds = timer_hist(recs, "late")
    out.queue_wait_seconds = timer_hist(recs, "qw")
    return out
end


local function map_timers(timer)
    local s = timer.stats({ raw = true })
    local t = s.totals or {}
    -- per name (chosen by the code; sites can be many and are in the
    -- flame graph)
    local all = {}
    for name in pairs(s.names or {}) do
        all[#all + 1] = name
    end
    tbl_sort(all)
    local names = {}
    for i = 1, #all < NAMES_KEPT and #all or NAMES_KEPT do
        local name = all[i]
        local rec = s.names[name]
        names[name] = timer_figures({ rec }, {
            pending = rec.pending,
            running = rec.running,
            created_total = rec.created,
            runs_total = rec.runs,
            errors_total = rec.errors,
            overruns_total = rec.overruns,
            skipped_total = rec.skipped,
        })
    end
    return timer_figures(s.sites or {}, {
        timers = s.timers,
        pending = s.pending,
        queued = s.queued,
        running = s.running,
        paused = s.paused,
        created_total = t.created,
        runs_total = t.runs,
        errors_total = t.errors,
        cancelled_total = t.cancelled,
        overruns_total = t.overruns,
        skipped_total = t.skipped,
        premature_total = t.premature,
        dropped_total = t.dropped,
        names = names,
        names_omitted = #all > NAMES_KEPT and #all - NAMES_KEPT or 0,
    })
end


local function offload_hist(rt, which)
    local h = rt:histogram(which, hist.LE)
    h.le = hist.LE
    return h
end


local function map_offload(offload)
    local runtimes = {}
    for _, rt in ipairs(offload.runtimes()) do
        local r = rt:stats()
        -- the file name, not where it is installed
        local name = str_match(r.name or "?", "([^/]+)$")
        while runtimes[name] do
            name = name .. "+"
        end
        runtimes[name] = {
            state = r.state,
            threads = r.threads,
            queued = r.queued,
            running = r.running,
            peak_queued = r.peak_queued,
            submitted_total = r.submitted,
            completed_total = r.completed,
            errors_total = r.errors,
            timeouts_total = r.timeouts,
            rejected_total = r.rejected,
            closed_total = r.closed,
            aborted_total = r.aborted,
            late_total = r.late,
            reclaimed_total = r.reclaimed,
            misused_total = r.misused,
            call_seconds = offload_hist(rt, "call"),
            queue_wait_seconds = offload_hist(rt, "wait"),
        }
    end
    return { runtimes = runtimes }
end


-- a request line may carry credentials in its query string: path only
local function path_of(uri)
    if type(uri) ~= "string" then
        return nil
    end
    local q = str_find(uri, "?", 1, true)
    return q and str_sub(uri, 1, q - 1) or uri
end


local function seconds(ms)
    return ms and ms / 1000
end


local function map_report(r)
    local frames = {}
    for i, f in ipairs(r.backtrace or {}) do
        frames[i] = { func = f.func, source = f.source, line = f.line }
    end
    local hot = {}
    for i, h in ipairs(r.hot or {}) do
        hot[i] = { frame = h.frame, samples = h.samples, share = h.share }
    end
    return {
        id = r.id,
        time = r.time,
        duration_seconds = seconds(r.duration_ms) or 0,
        on_cpu_seconds = seconds(r.on_cpu_ms),
        off_cpu_seconds = seconds(r.off_cpu_ms),
        runqueue_seconds = seconds(r.runqueue_ms),
        kind = r.kind,
        phase = r.phase,
        syscall = r.syscall,
        hot = hot[1] and hot or nil,
        request = r.request and { method = r.request.method,
                                  path = path_of(r.request.uri) } or nil,
        timer = r.timer,
        -- (Debian's cjson writes an empty list as {}: none is left out)
        backtrace = frames[1] and frames or nil,
        backtrace_missing = r.backtrace_missing,
    }
end


local function map_watchdog(watchdog, s)
    local h = s.histogram or {}
    local function le(i)
        local v = h[i] and h[i].le_ms
        return type(v) == "number" and v / 1000 or huge
    end
    local reports = {}
    for i, r in ipairs(watchdog.reports({ limit = REPORTS_KEPT })) do
        reports[i] = map_report(r)
    end
    return {
        running = s.running,
        threshold_seconds = (s.threshold_ms or 0) / 1000,
        iterations_total = s.iterations,
        busy_seconds_total = (s.busy_ms or 0) / 1000,
        max_iteration_seconds = (s.max_ms or 0) / 1000,
        stalls_total = s.stalls,
        reports_total = s.reports,
        reports_dropped_total = s.reports_dropped,
        samples_total = s.samples,
        samples_dropped_total = s.samples_dropped,
        iteration_seconds = hist.rebin(
            function(i) return h[i] and h[i].count end, 1, #h,
            function(i) return i == 1 and 0 or le(i - 1) end, le,
            (s.busy_ms or 0) / 1000),
        reports = reports[1] and reports or nil,
    }
end


-- one worker's figures as the "loom.publish" collector exports them
local function map_publish(per_name)
    local pubs = {}
    for name, p in pairs(per_name) do
        local dense = {}
        for _, pr in ipairs(p.latency_buckets or {}) do
            dense[pr[1]] = pr[2]
        end
        pubs[name] = {
            topic = p.topic,
            buffered_messages = p.buffered_messages,
            buffered_bytes = p.buffered_bytes,
            in_flight_batches = p.in_flight,
            in_flight_messages = p.in_flight_messages,
            sent_total = p.sent,
            failed_total = p.failed,
            retried_total = p.retried,
            dropped_total = p.dropped,
            rejected_total = p.rejected,
            batches_total = p.batches,
            http_requests_total = p.http_requests,
            token_refreshes_total = p.token_refreshes,
            spooled_total = p.spooled,
            replayed_total = p.replayed,
            spool_bytes = p.spool_bytes,
            spool_errors_total = p.spool_errors,
        }
        -- (merged figures, without a bus, have no buckets)
        if p.latency_buckets then
            pubs[name].latency_seconds = hist.rebin(
                function(i) return dense[i] end, 0, LH_LAST, lh_lower,
                lh_upper, p.latency_sum)
        end
    end
    return { publishers = pubs }
end


-- a resty.loom.histogram in the status shape (for figures of your own)
_M.from_histogram = from_lh


-- this worker ----------------------------------------------------------


local function try(map, mod, arg)
    local ok, res = pcall(map, mod, arg)
    if ok then
        return res
    end
    return { error = "failed to read stats: " .. tostring(res) }
end


-- this worker's snapshot; modules not loaded are absent
function _M.snapshot()
    ngx_update_time()
    local w = {
        pid = ngx.worker.pid(),
        id = ngx.worker.id(),
        -- ngx.now() counts milliseconds: the difference of two such
        -- doubles carries float noise (17.886000156402588)
        uptime_s = floor((ngx_now() - started) * 1000 + 0.5) / 1000,
        lua_memory_bytes = collectgarbage("count") * 1024,
    }
    local events = loaded["resty.loom.events"]
    local bus = events and events.get()
    if bus then
        w.events = try(map_events, bus)
    end
    if loaded["resty.loom.timer"] then
        w.timers = try(map_timers, loaded["resty.loom.timer"])
    end
    if loaded["resty.loom.offload"] then
        w.offload = try(map_offload, loaded["resty.loom.offload"])
    end
    local wd = loaded["resty.loom.watchdog"]
    if wd and wd.stats then
        local ok, s = pcall(wd.stats)
        -- a watchdog never started in this worker shows nothing
        if ok and s.running ~= nil and (s.running or s.iterations > 0) then
            w.watchdog = try(map_watchdog, wd, s)
        end
    end
    return w
end


-- all workers -----------------------------------------------------------


local function is_counter_like(k)
    return str_find(k, "_total$") ~= nil
           or k == "queued" or k == "running" or k == "pending"
           or k == "timers" or k == "paused" or k == "threads"
           or k == "connections" or str_find(k, "^queue_") ~= nil
           or str_find(k, "^buffered_") ~= nil
           or str_find(k, "^in_flight") ~= nil
           or k == "inbox_events" or k == "peak_queued"
           or k == "ring_held_bytes"
end


-- adds src's additive figures into dst: counters, gauges of amounts,
-- histograms; named sub-tables recursively (a `*_by_reason` one holds
-- counters only), lists (reports) not at all
local function merge(dst, src, counters)
    for k, v in pairs(src) do
        if type(v) == "number" and (counters or is_counter_like(k)) then
            dst[k] = (dst[k] or 0) + v
        elseif type(v) == "number" and str_find(k, "^max_") then
            if not dst[k] or v > dst[k] then
                dst[k] = v
            end
        elseif hist.is(v) then
            dst[k] = hist.add(dst[k], v)
        elseif type(v) == "table" and v[1] == nil then
            dst[k] = dst[k] or {}
            merge(dst[k], v, str_find(k, "_by_reason$") ~= nil)
        end
    end
    return dst
end


local function nginx_info()
    local v = ngx.config.nginx_version
    local info = {
        version = str_format("%d.%d.%d", floor(v / 1e6),
                             floor(v / 1000) % 1000, v % 1000),
        lua_version = ngx.config.ngx_lua_version,
        worker_processes = ngx.worker.count(),
    }
    if ngx.get_phase() == "content" then
        for _, k in ipairs({ "active", "reading", "writing", "waiting" }) do
            local ok, v = pcall(function()
                return ngx.var["connections_" .. k]
            end)
            if ok and v then
                info["connections_" .. k] = tonumber(v)
            end
        end
    end
    return info
end


local function collect_one(bus, name, timeout)
    local ok, res, err = pcall(bus.collect, bus, name, timeout)
    if not ok then
        return nil, tostring(res)
    end
    return res, err
end


local function check_timeout(timeout)
    if timeout == nil then
        return 0.5
    end
    if type(timeout) ~= "number" or timeout ~= timeout or timeout <= 0
       or timeout > MAX_TIMEOUT
    then
        error("timeout must be a number in (0, " .. MAX_TIMEOUT .. "]", 3)
    end
    return timeout
end


-- doc = status.collect(timeout): every worker's snapshot, asked over the
-- events bus (this worker only when there is none); a worker that does
-- not answer within timeout seconds (default 0.5) has error = "timeout"
function _M.collect(timeout)
    timeout = check_timeout(timeout)
    local events = loaded["resty.loom.events"]
    local bus = events and events.get()
    local per, pubs, source
    local count = ngx.worker.count()

    if bus then
        local th
        if loaded["resty.loom.publish"] then
            th = ngx.thread.spawn(collect_one, bus, PUBLISH_COLLECTOR,
                                  timeout)
        end
        local err
        per, err = collect_one(bus, COLLECTOR, timeout)
        if th then
            local ok, res = ngx.thread.wait(th)
            pubs = ok and res or nil
        end
        if per then
            source = "events"
        else
            ngx.log(ngx.WARN, "[loom.status] ", err,
                    ": this worker's figures only")
        end
    end

    if not per then
        local w = _M.snapshot()
        local pub = loaded["resty.loom.publish"]
        if pub then
            -- without a bus this is this worker's own, merged per name
            local ok, all = pcall(pub.stats_all, timeout)
            if ok and type(all) == "table" and next(all.publishers or {})
            then
                w.publish = try(map_publish, all.publishers)
            end
        end
        per = { [tostring(w.id or 0)] = w }
        source = "local"
        if not bus then
            count = nil     -- the others are unknown, not missing
        end
    end
    -- not heard from: late, or the bus itself could not be used
    local missing = source == "local" and "unreachable" or "timeout"

    local workers = {}
    local seen = {}
    for key, w in pairs(per) do
        local id = tonumber(key)
        if w == ngx.null and id and id >= 0 then
            -- it answered, without a "loom.status" collector
            seen[id] = true
            workers[#workers + 1] = { id = id, error = "no collector" }
        elseif type(w) == "table" and id and id >= 0 then
            seen[id] = true
            local p = pubs and pubs[key]
            if type(p) == "table" and next(p) then
                w.publish = try(map_publish, p)
            elseif pubs and p == nil then
                w.publish = { error = "timeout" }
            end
            workers[#workers + 1] = w
        end
    end
    for id = 0, (count or 0) - 1 do
        if not seen[id] then
            workers[#workers + 1] = { id = id, error = missing }
        end
    end
    tbl_sort(workers, function(a, b) return a.id < b.id end)

    local totals = {}
    for _, w in ipairs(workers) do
        for _, m in ipairs(MODULES) do
            if type(w[m]) == "table" and not w[m].error then
                totals[m] = merge(totals[m] or {}, w[m])
            end
        end
    end

    ngx_update_time()
    return {
        version = _M._VERSION,
        time = ngx_now(),
        source = source,
        nginx = nginx_info(),
        workers = workers,
        totals = totals,
    }
end


local IS_MODULE = {}
for _, m in ipairs(MODULES) do
    IS_MODULE[m] = true
end


-- the document with one module's figures only (for /loom/<module>)
function _M.only(doc, module)
    if not IS_MODULE[module] then
        error("module must be events, timers, offload, watchdog or publish",
              2)
    end
    local workers = {}
    for i, w in ipairs(doc.workers) do
        workers[i] = { pid = w.pid, id = w.id, uptime_s = w.uptime_s,
                       error = w.error, [module] = w[module] }
    end
    return {
        version = doc.version,
        time = doc.time,
        source = doc.source,
        nginx = doc.nginx,
        workers = workers,
        totals = { [module] = doc.totals[module] },
    }
end


-- the dashboard (resty.loom.status.dashboard): it polls /loom/status and
-- loads Chart.js from /loom/chart.js
function _M.page()
    return require("resty.loom.status.dashboard").html
end


function _M.register_collector()
    local ok, events = pcall(require, "resty.loom.events")
    if not ok or type(events) ~= "table" or not events.register_collector
    then
        return nil, "resty.loom.events is not available"
    end
    events.register_collector(COLLECTOR, _M.snapshot)
    return true
end


-- in init_worker_by_lua: this worker's uptime starts now; registers the
-- collector
function _M.init_worker()
    started = ngx_now()
    return _M.register_collector()
end


return _M
