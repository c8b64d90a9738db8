-- A finished stall from the C side (loom_wd_report_t and the Lua stack
-- samples of its iteration) made into a report: on or off CPU, system
-- calls, the request or timer, the backtrace, hot frames, folded stacks.


local ffi = require "ffi"
local names = require "resty.loom.watchdog.names"
local stack = require "resty.loom.watchdog.stack"
local timers = require "resty.loom.watchdog.timers"
require "resty.loom.watchdog.cdef"

local C = ffi.C
local ffi_new = ffi.new
local ffi_string = ffi.string
local ngx = ngx
local tonumber = tonumber
local pairs = pairs
local ipairs = ipairs
local floor = math.floor
local str_match = string.match
local tbl_concat = table.concat
local tbl_sort = table.sort
local PHASES = names.PHASES
local VMSTATES = names.VMSTATES
local syscall_name = names.syscall_name
local parse_stack = stack.parse_stack
local frame_label = stack.frame_label
local fix_call_line = stack.fix_call_line
local drop_runner_frames = timers.drop_runner_frames


local nsamples_buf = ffi_new("int[1]")
local text_buf = ffi_new("const char *[1]")


local function round(x, digits)
    local m = 10 ^ (digits or 1)
    return floor(x * m + 0.5) / m
end


local function drain_samples(by_seq)
    local samples = C.ngx_loom_ffi_watchdog_samples(nsamples_buf, text_buf)
    local n = nsamples_buf[0]
    local text = text_buf[0]
    for i = 0, n - 1 do
        local s = samples[i]
        local seq = tonumber(s.seq)
        local list = by_seq[seq]
        if not list then
            list = {}
            by_seq[seq] = list
        end
        list[#list + 1] = {
            stack = ffi_string(text + s.off, s.len),
            vmstate = VMSTATES[s.vmstate] or "?",
            offcpu = s.offcpu ~= 0,
        }
    end
end


local function build_report(c, samples, threshold)
    local dur = c.duration_ms
    local on_cpu
    if c.cpu_known ~= 0 then
        on_cpu = c.cpu_ms
    elseif c.ticks > 0 then
        on_cpu = dur * c.ticks_running / c.ticks
    end
    local off_cpu = on_cpu and (dur - on_cpu) or nil
    local runq = c.runq_known ~= 0 and c.runq_ms or nil

    local syscalls = {}
    for i = 0, 3 do
        if c.sys_n[i] > 0 then
            syscalls[#syscalls + 1] = {
                name = syscall_name(c.sys_nr[i]),
                nr = c.sys_nr[i],
                samples = c.sys_n[i],
            }
        end
    end
    tbl_sort(syscalls, function(a, b) return a.samples > b.samples end)

    local kind
    if on_cpu then
        if on_cpu >= off_cpu then
            kind = "cpu"
        elseif runq and on_cpu + runq >= off_cpu - runq then
            kind = "cpu"    -- on CPU, or ready to run and starved of one
        elseif #syscalls == 0 then
            -- never seen in a system call: the time the thread did not
            -- get was taken by the hypervisor (steal), not a wait
            kind = "cpu"
        else
            kind = "blocked"
        end
    elseif c.ticks_disk > 0 then
        kind = "blocked"
    else
        kind = "unknown"
    end

    local report = {
        id = tonumber(c.seq),
        worker = ngx.worker.id(),
        pid = ngx.worker.pid(),
        time = round(c.start, 3),
        duration_ms = round(dur, 1),
        threshold_ms = threshold,
        kind = kind,
        on_cpu_ms = on_cpu and round(on_cpu, 1) or nil,
        off_cpu_ms = off_cpu and round(off_cpu, 1) or nil,
        runqueue_ms = runq and round(runq, 1) or nil,
        syscall = syscalls[1] and syscalls[1].name or nil,
        syscalls = syscalls,
        wchan = c.wchan[0] ~= 0 and ffi_string(c.wchan) or nil,
        proc_samples = {
            total = c.ticks, running = c.ticks_running,
            sleeping = c.ticks_sleeping, disk = c.ticks_disk,
        },
        detected_while_blocked = c.detected ~= 0,
        detect_ms = round(c.detect_ms, 1),
        report_ms = round(c.report_ms, 1),
        phase = PHASES[c.phase],
        lua_samples = #samples,
    }

    -- how long after the stall ended this report was made
    local now = C.ngx_loom_ffi_watchdog_wall()
    report.reported_after_ms = round((now - c.start) * 1000 - dur, 2)

    if c.timer ~= 0 then
        -- "<created at>|<callback>" or, from resty.loom.timer,
        -- "<created at>|<callback>|<name>"
        local site = c.site[0] ~= 0 and ffi_string(c.site) or ""
        local created, defined, name = str_match(site,
                                                 "^([^|]*)|([^|]*)|?(.*)$")
        report.timer = { created_at = created ~= "" and created or nil,
                         callback = defined ~= "" and defined or nil,
                         name = name ~= "" and name or nil }
    elseif c.request[0] ~= 0 then
        local req = ffi_string(c.request)
        local method, uri = str_match(req, "^(%S+) (.*)$")
        report.request = { method = method, uri = uri or req }
    end

    -- backtrace: the sample right after the blocking call if any, else
    -- the first CPU sample; hot frames from the CPU samples
    local bt_sample
    for _, s in ipairs(samples) do
        if s.offcpu then
            bt_sample = s
            break
        end
    end
    bt_sample = bt_sample or samples[1]

    if bt_sample then
        local frames = parse_stack(bt_sample.stack)
        if bt_sample.offcpu then
            fix_call_line(frames)
        end
        report.backtrace = frames
        report.vmstate = bt_sample.vmstate

        if report.timer then
            drop_runner_frames(report.timer, frames)
        end
    end

    local hot, folded = {}, {}
    local ncpu = 0
    for _, s in ipairs(samples) do
        if not s.offcpu then
            ncpu = ncpu + 1
        end
    end

    local cpu_weight = ncpu > 0 and (on_cpu or dur) / ncpu or 0
    for _, s in ipairs(samples) do
        local frames = parse_stack(s.stack)
        local labels = {}
        for i = #frames, 1, -1 do
            labels[#labels + 1] = frame_label(frames[i])
        end
        local w
        if s.offcpu then
            labels[#labels + 1] = "[" .. (report.syscall or "off-cpu") .. "]"
            w = off_cpu or dur
        else
            w = cpu_weight
            local top = frames[1] and frame_label(frames[1]) or "?"
            hot[top] = (hot[top] or 0) + 1
        end
        local key = tbl_concat(labels, ";")
        folded[key] = (folded[key] or 0) + w
    end

    if not bt_sample and off_cpu and off_cpu > 0 then
        local leaf = "[" .. (report.syscall or "off-cpu") .. "]"
        folded[leaf] = off_cpu
    end

    local hot_list = {}
    for frame, n in pairs(hot) do
        hot_list[#hot_list + 1] = {
            frame = frame, samples = n, share = round(n / ncpu, 2),
        }
    end
    tbl_sort(hot_list, function(a, b)
        if a.samples ~= b.samples then
            return a.samples > b.samples
        end
        return a.frame < b.frame
    end)
    report.hot = hot_list

    local lines = {}
    for k, v in pairs(folded) do
        lines[#lines + 1] = k .. " " .. floor(v + 0.5)
    end
    tbl_sort(lines)
    report.folded = tbl_concat(lines, "\n")

    if not bt_sample then
        if c.detected == 0 then
            report.backtrace_missing = "stall ended before the watchdog's "
                                       .. "next look"
        elseif kind == "blocked" then
            report.backtrace_missing = "blocked in a call the watchdog "
                                       .. "cannot interrupt safely"
        else
            report.backtrace_missing = "no safe point reached"
        end
    end

    return report
end


local _M = { _VERSION = "0.2.0" }


_M.round = round
_M.drain_samples = drain_samples
_M.build = build_report


return _M
