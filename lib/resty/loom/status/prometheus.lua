-- resty.loom.status.prometheus: the status document in the Prometheus text
-- format 0.0.4. Prefix loom_, base units, label worker (plus runtime or
-- publisher where a worker has several); every family has HELP and TYPE
-- and its lines together.


local hist = require "resty.loom.status.hist"

local pairs = pairs
local ipairs = ipairs
local type = type
local tostring = tostring
local str_format = string.format
local str_gsub = string.gsub
local str_match = string.match
local str_find = string.find
local str_byte = string.byte
local str_sub = string.sub
local floor = math.floor
local huge = math.huge
local tbl_concat = table.concat
local tbl_sort = table.sort

-- { module, field path, metric, type, help[, per] }: per is the path of
-- the module's table whose entries each get a label (PER_LABEL, by the
-- table's name)
local PER_LABEL = { runtimes = "runtime", publishers = "publisher",
                    names = "name", dropped_by_reason = "reason" }

local FAMILIES = {
    { nil, "up", "loom_worker_up", "gauge",
      "1 if the worker answered the status collect in time, else 0" },
    { nil, "uptime_s", "loom_worker_uptime_seconds", "gauge",
      "Seconds since the worker started" },
    { nil, "lua_memory_bytes", "loom_worker_lua_memory_bytes", "gauge",
      "Memory held by the worker's Lua VM" },

    { "events", "connected", "loom_events_connected", "gauge",
      "1 if the worker is connected to the event bus" },
    { "events", "published_total", "loom_events_published_total", "counter",
      "Events published by the worker (the status collects included)" },
    { "events", "delivered_total", "loom_events_delivered_total", "counter",
      "Events delivered to the worker's handlers" },
    { "events", "handler_calls_total", "loom_events_handler_calls_total",
      "counter", "Event handler calls" },
    { "events", "handler_errors_total", "loom_events_handler_errors_total",
      "counter", "Event handlers that raised an error" },
    { "events", "", "loom_events_dropped_total", "counter",
      "Events the worker dropped, by reason", "dropped_by_reason" },
    { "events", "gaps_total", "loom_events_gaps_total", "counter",
      "Events the worker never received (sequence gaps)" },
    { "events", "duplicates_total", "loom_events_duplicates_total",
      "counter", "Duplicate events the worker discarded" },
    { "events", "reconnects_total", "loom_events_reconnects_total",
      "counter", "Reconnections to the broker" },
    { "events", "rejected_total", "loom_events_rejected_total", "counter",
      "Connections the broker refused to this worker" },
    { "events", "queue_events", "loom_events_queue_events", "gauge",
      "Events published by the worker and not yet confirmed" },
    { "events", "queue_bytes", "loom_events_queue_bytes", "gauge",
      "Bytes of the worker's unconfirmed events" },
    { "events", "inbox_events", "loom_events_inbox_events", "gauge",
      "Events received and waiting for their handlers" },
    { "events", "ring_events_total", "loom_events_ring_events_total",
      "counter", "Events the worker published through its ring" },
    { "events", "ring_full_total", "loom_events_ring_full_total", "counter",
      "Runs of events sent on the socket because the ring was full" },
    { "events", "ring_overwritten_total",
      "loom_events_ring_overwritten_total", "counter",
      "Events lost to the worker: written over in a ring before it read them" },
    { "events", "ring_held_bytes", "loom_events_ring_held_bytes", "gauge",
      "Bytes of the worker's ring the broker still needs" },
    { "events", "delivery_seconds", "loom_events_delivery_seconds",
      "histogram", "Publish to handler latency (sampled events)" },
    { "events", "", "loom_events_broker_dropped_total", "counter",
      "Events the broker dropped, by reason", "broker.dropped_by_reason" },
    { "events", "broker.rejected_total", "loom_events_broker_rejected_total",
      "counter", "Connections the broker refused" },
    { "events", "broker.urgent_missed_total",
      "loom_events_broker_urgent_missed_total", "counter",
      "Urgent events (status collects) for a worker not connected" },
    { "events", "broker.forwarded_total",
      "loom_events_broker_forwarded_total", "counter",
      "Events the broker forwarded" },
    { "events", "broker.queue_events", "loom_events_broker_queue_events",
      "gauge", "Events queued in the broker for workers" },
    { "events", "broker.queue_bytes", "loom_events_broker_queue_bytes",
      "gauge", "Bytes queued in the broker for workers" },

    { "timers", "timers", "loom_timers", "gauge", "Live timers" },
    { "timers", "pending", "loom_timers_pending", "gauge",
      "Timers waiting for their time" },
    { "timers", "running", "loom_timers_running", "gauge",
      "Timer callbacks running" },
    { "timers", "created_total", "loom_timers_created_total", "counter",
      "Timers created" },
    { "timers", "runs_total", "loom_timers_runs_total", "counter",
      "Timer callback runs" },
    { "timers", "errors_total", "loom_timers_errors_total", "counter",
      "Timer callbacks that raised an error" },
    { "timers", "overruns_total", "loom_timers_overruns_total", "counter",
      "Periodic timers still running when next due" },
    { "timers", "skipped_total", "loom_timers_skipped_total", "counter",
      "Periodic runs skipped" },
    { "timers", "dropped_total", "loom_timers_dropped_total", "counter",
      "Premature callbacks not started within exit_timeout (dropped)" },
    { "timers", "run_seconds", "loom_timers_run_seconds", "histogram",
      "Timer callback run time" },
    { "timers", "lateness_seconds", "loom_timers_lateness_seconds",
      "histogram", "How late timers ran (sum estimated from buckets)" },
    { "timers", "names_omitted", "loom_timers_names_omitted", "gauge",
      "Timer names left out of the per-name figures (over 100)" },
    { "timers", "runs_total", "loom_timers_named_runs_total", "counter",
      "Runs of the timers with this name", "names" },
    { "timers", "errors_total", "loom_timers_named_errors_total", "counter",
      "Errors of the timers with this name", "names" },
    { "timers", "lateness_seconds", "loom_timers_named_lateness_seconds",
      "histogram", "How late the timers with this name ran", "names" },

    { "offload", "queued", "loom_offload_queued", "gauge",
      "Calls waiting for a runtime thread", "runtimes" },
    { "offload", "running", "loom_offload_running", "gauge",
      "Calls running on runtime threads", "runtimes" },
    { "offload", "submitted_total", "loom_offload_submitted_total",
      "counter", "Calls submitted", "runtimes" },
    { "offload", "completed_total", "loom_offload_completed_total",
      "counter", "Calls completed", "runtimes" },
    { "offload", "errors_total", "loom_offload_errors_total", "counter",
      "Calls that failed", "runtimes" },
    { "offload", "timeouts_total", "loom_offload_timeouts_total", "counter",
      "Calls that timed out", "runtimes" },
    { "offload", "rejected_total", "loom_offload_rejected_total", "counter",
      "Calls refused (queue full)", "runtimes" },
    { "offload", "closed_total", "loom_offload_closed_total", "counter",
      "Calls refused (runtime closed)", "runtimes" },
    { "offload", "aborted_total", "loom_offload_aborted_total", "counter",
      "Calls whose request ended before the answer", "runtimes" },
    { "offload", "late_total", "loom_offload_late_total", "counter",
      "Answers dropped: they came after their call gave up", "runtimes" },
    { "offload", "reclaimed_total", "loom_offload_reclaimed_total",
      "counter", "Tasks a runtime never answered, reclaimed", "runtimes" },
    { "offload", "misused_total", "loom_offload_misused_total", "counter",
      "Answers refused: the runtime broke the offload ABI", "runtimes" },
    { "offload", "call_seconds", "loom_offload_call_seconds", "histogram",
      "Offload call round trip, submit to answer", "runtimes" },
    { "offload", "queue_wait_seconds", "loom_offload_queue_wait_seconds",
      "histogram", "Offload call wait for a runtime thread", "runtimes" },

    { "watchdog", "stalls_total", "loom_watchdog_stalls_total", "counter",
      "Event-loop iterations longer than the threshold" },
    { "watchdog", "reports_dropped_total",
      "loom_watchdog_reports_dropped_total", "counter",
      "Stall reports lost" },
    { "watchdog", "samples_dropped_total",
      "loom_watchdog_samples_dropped_total", "counter",
      "Backtrace samples lost" },
    { "watchdog", "busy_seconds_total", "loom_watchdog_busy_seconds_total",
      "counter", "Time the event loop spent busy" },
    { "watchdog", "iteration_seconds", "loom_watchdog_iteration_seconds",
      "histogram", "Event-loop iteration time (stalls are the slowest)" },

    { "publish", "buffered_messages", "loom_publish_buffered_messages",
      "gauge", "Messages not yet acknowledged", "publishers" },
    { "publish", "buffered_bytes", "loom_publish_buffered_bytes", "gauge",
      "Bytes not yet acknowledged", "publishers" },
    { "publish", "sent_total", "loom_publish_sent_total", "counter",
      "Messages acknowledged by Pub/Sub", "publishers" },
    { "publish", "failed_total", "loom_publish_failed_total", "counter",
      "Messages given up on", "publishers" },
    { "publish", "dropped_total", "loom_publish_dropped_total", "counter",
      "Messages dropped (buffer full)", "publishers" },
    { "publish", "rejected_total", "loom_publish_rejected_total", "counter",
      "Messages refused by send()", "publishers" },
    { "publish", "retried_total", "loom_publish_retried_total", "counter",
      "Batch retries", "publishers" },
    { "publish", "batches_total", "loom_publish_batches_total", "counter",
      "Batches sent", "publishers" },
    { "publish", "spooled_total", "loom_publish_spooled_total", "counter",
      "Messages written to the spool", "publishers" },
    { "publish", "replayed_total", "loom_publish_replayed_total", "counter",
      "Messages read back from the spool to be sent", "publishers" },
    { "publish", "spool_bytes", "loom_publish_spool_bytes", "gauge",
      "Bytes of messages in the spool", "publishers" },
    { "publish", "spool_errors_total", "loom_publish_spool_errors_total",
      "counter", "Spool failures (disk full, I/O, corrupt files)",
      "publishers" },
    { "publish", "latency_seconds", "loom_publish_latency_seconds",
      "histogram", "send() to acknowledged batch, per message",
      "publishers" },
}

local _M = { _VERSION = "0.2.0" }


local function num(v)
    if v == true then
        return "1"
    elseif v == false then
        return "0"
    elseif v ~= v then
        return "NaN"
    elseif v == huge then
        return "+Inf"
    elseif v == -huge then
        return "-Inf"
    elseif v == floor(v) and v < 1e15 and v > -1e15 then
        return str_format("%d", v)
    end
    -- 15 significant digits, what a double holds exactly: le="0.0025",
    -- which PromQL selectors can match, and 0.3 for 0.1 + 0.2, not
    -- 0.30000000000000004 (the last two digits are float noise)
    return str_format("%.15g", v)
end


local REPLACEMENT = "\239\191\189"        -- U+FFFD


-- the length of the sequence lead byte c starts when its second byte c2
-- is in range (RFC 3629: no overlong form, no surrogate, nothing above
-- U+10FFFF), else false
local function utf8_len(c, c2)
    if c >= 0xC2 and c <= 0xDF then
        return c2 >= 0x80 and c2 <= 0xBF and 2
    elseif c == 0xE0 then
        return c2 >= 0xA0 and c2 <= 0xBF and 3
    elseif c == 0xED then
        return c2 >= 0x80 and c2 <= 0x9F and 3
    elseif c >= 0xE1 and c <= 0xEF then
        return c2 >= 0x80 and c2 <= 0xBF and 3
    elseif c == 0xF0 then
        return c2 >= 0x90 and c2 <= 0xBF and 4
    elseif c >= 0xF1 and c <= 0xF3 then
        return c2 >= 0x80 and c2 <= 0xBF and 4
    elseif c == 0xF4 then
        return c2 >= 0x80 and c2 <= 0x8F and 4
    end
    return false
end


-- label values must be UTF-8, or Prometheus refuses the whole scrape: a
-- byte that does not belong to a valid sequence becomes U+FFFD
local function utf8(s)
    if not str_find(s, "[\128-\255]") then
        return s
    end
    local out, n, i, len = {}, 0, 1, #s
    while i <= len do
        local c = str_byte(s, i)
        local k = c < 0x80 and 1 or utf8_len(c, str_byte(s, i + 1) or 0)
        for j = i + 2, k and i + k - 1 or 0 do
            local cj = str_byte(s, j)
            if not cj or cj < 0x80 or cj > 0xBF then
                k = false
                break
            end
        end
        n = n + 1
        out[n] = k and str_sub(s, i, i + k - 1) or REPLACEMENT
        i = i + (k or 1)
    end
    return tbl_concat(out)
end


local function esc(v)
    return (str_gsub(utf8(tostring(v)), '[\\\n"]',
                     { ["\\"] = "\\\\", ["\n"] = "\\n", ['"'] = '\\"' }))
end


local function get(t, path)
    for key in path:gmatch("[^.]+") do
        if type(t) ~= "table" then
            return nil
        end
        t = t[key]
    end
    return t
end


local function sample(out, name, labels, v)
    out[#out + 1] = name .. "{" .. labels .. "} " .. num(v)
end


local function emit(out, name, typ, labels, v)
    if typ == "histogram" then
        if not hist.is(v) then
            return
        end
        for i, le in ipairs(v.le) do
            sample(out, name .. "_bucket", labels .. ',le="' .. num(le)
                   .. '"', v.buckets[i])
        end
        sample(out, name .. "_bucket", labels .. ',le="+Inf"', v.count)
        sample(out, name .. "_sum", labels, v.sum)
        sample(out, name .. "_count", labels, v.count)
    elseif type(v) == "number" or type(v) == "boolean" then
        sample(out, name, labels, v)
    end
end


local function sorted_keys(t)
    local keys = {}
    for k in pairs(t) do
        keys[#keys + 1] = k
    end
    tbl_sort(keys)
    return keys
end


-- the exposition text of a resty.loom.status document
function _M.render(doc)
    local out = {}
    for _, f in ipairs(FAMILIES) do
        local module, path, name, typ, help, per = f[1], f[2], f[3], f[4],
                                                  f[5], f[6]
        local start = #out
        out[#out + 1] = "# HELP " .. name .. " " .. help
        out[#out + 1] = "# TYPE " .. name .. " " .. typ
        for _, w in ipairs(doc.workers) do
            local wl = 'worker="' .. w.id .. '"'
            if module == nil then
                local v = w[path]
                if path == "up" then
                    v = w.error == nil
                end
                emit(out, name, typ, wl, v)
            elseif type(w[module]) == "table" then
                local m = w[module]
                if per then
                    local label = PER_LABEL[str_match(per, "[^.]+$")]
                    local set = get(m, per) or {}
                    for _, k in ipairs(sorted_keys(set)) do
                        emit(out, name, typ, wl .. "," .. label .. '="'
                             .. esc(k) .. '"', get(set[k], path))
                    end
                else
                    emit(out, name, typ, wl, get(m, path))
                end
            end
        end
        if #out == start + 2 then
            -- no series: no family
            out[#out] = nil
            out[#out] = nil
        end
    end
    out[#out + 1] = ""
    return tbl_concat(out, "\n")
end


return _M
