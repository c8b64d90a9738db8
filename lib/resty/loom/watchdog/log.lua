-- A report as one error-log line ("event loop blocked ... by ...; lua:
-- ...; report N"), at most opts.log_burst lines per opts.log_interval
-- seconds; the lines held back are counted on the next one.


local ffi = require "ffi"
local stack = require "resty.loom.watchdog.stack"
require "resty.loom.watchdog.cdef"

local C = ffi.C
local ngx = ngx
local ngx_WARN = ngx.WARN
local ngx_now = ngx.now
local str_format = string.format
local tbl_concat = table.concat
local frame_label = stack.frame_label


local LOG_TAG = "[loom.watchdog] "


local state = {
    log_window = 0,
    log_lines = 0,
    log_suppressed = 0,
}


local function summary_line(r)
    local what
    if r.request then
        what = (r.request.method or "") .. " " .. r.request.uri
        if r.phase then
            what = what .. " (" .. r.phase .. ")"
        end
    elseif r.timer then
        what = "timer " .. (r.timer.name and ("\"" .. r.timer.name .. "\" ")
                            or "") .. (r.timer.callback or "?")
        if r.timer.created_at then
            what = what .. " created at " .. r.timer.created_at
        end
    else
        what = "unknown code"
    end

    local parts = {
        str_format("event loop blocked %.1f ms (threshold %g ms) by %s",
                   r.duration_ms, r.threshold_ms, what),
    }

    if r.on_cpu_ms then
        local off = str_format("off-CPU %.1f ms", r.off_cpu_ms)
        if r.syscall then
            off = off .. " in " .. r.syscall
            if r.wchan then
                off = off .. " [" .. r.wchan .. "]"
            end
        end
        if r.runqueue_ms and r.runqueue_ms >= 1 then
            off = off .. str_format(" (%.1f ms of it runnable, waiting for "
                                    .. "a CPU)", r.runqueue_ms)
        end
        parts[#parts + 1] = str_format("on-CPU %.1f ms, %s", r.on_cpu_ms,
                                       off)
    end

    if r.backtrace then
        local bt = {}
        for i = 1, #r.backtrace do
            if i > 6 then
                bt[#bt + 1] = "..."
                break
            end
            bt[#bt + 1] = frame_label(r.backtrace[i])
        end
        parts[#parts + 1] = "lua: " .. tbl_concat(bt, " < ")
    elseif r.backtrace_missing then
        parts[#parts + 1] = "lua: unknown (" .. r.backtrace_missing .. ")"
    end

    if r.hot[1] and r.lua_samples > 1 then
        local hot = {}
        for i = 1, 3 do
            local h = r.hot[i]
            if not h then
                break
            end
            hot[#hot + 1] = str_format("%s %d%%", h.frame, h.share * 100)
        end
        parts[#parts + 1] = "hot: " .. tbl_concat(hot, ", ")
    end

    parts[#parts + 1] = "report " .. r.id
    return tbl_concat(parts, "; ")
end


local function log_report(r, opts)
    local now = ngx_now()
    if now - state.log_window >= opts.log_interval then
        state.log_window = now
        state.log_lines = 0
    end

    if state.log_lines >= opts.log_burst then
        state.log_suppressed = state.log_suppressed + 1
        return
    end

    state.log_lines = state.log_lines + 1
    local line = summary_line(r)
    if state.log_suppressed > 0 then
        line = line .. str_format(" (%d earlier reports not logged)",
                                  state.log_suppressed)
        state.log_suppressed = 0
    end
    line = LOG_TAG .. line
    C.ngx_loom_ffi_watchdog_log(ngx_WARN, line, #line)
end


local _M = { _VERSION = "0.2.0" }


_M.TAG = LOG_TAG
_M.summary_line = summary_line
_M.report = log_report


return _M
