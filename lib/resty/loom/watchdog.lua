-- resty.loom.watchdog: finds what blocks the nginx event loop, in
-- production.
--
-- The C part (src/ngx_loom_watchdog.c) times every event-loop iteration,
-- and a watchdog thread per worker looks at the main thread while an
-- iteration runs too long: on or off CPU, which system call, and a Lua
-- backtrace taken at a VM safe point during the stall. This module turns
-- the finished stalls into reports (a ring), log lines (rate limited),
-- loop-lag figures and folded stacks for a flame graph.


local ffi = require "ffi"
local jit = require "jit"
local bit = require "bit"
local jit_util = require "jit.util"
local semaphore = require "ngx.semaphore"
local options = require "resty.loom.opts"

local C = ffi.C
local ffi_new = ffi.new
local ffi_string = ffi.string
local ngx = ngx
local ngx_log = ngx.log
local ngx_WARN = ngx.WARN
local ngx_ERR = ngx.ERR
local ngx_now = ngx.now
local ngx_timer_at = ngx.timer.at
local ngx_worker_exiting = ngx.worker.exiting
local ngx_get_phase = ngx.get_phase
local debug_getinfo = debug.getinfo
local debug_getregistry = debug.getregistry
local funcbc = jit_util.funcbc
local funcinfo = jit_util.funcinfo
local band = bit.band
local tonumber = tonumber
local tostring = tostring
local type = type
local pairs = pairs
local ipairs = ipairs
local error = error
local pcall = pcall
local floor = math.floor
local str_byte = string.byte
local str_find = string.find
local str_format = string.format
local str_gmatch = string.gmatch
local str_gsub = string.gsub
local str_match = string.match
local str_sub = string.sub
local tbl_concat = table.concat
local tbl_sort = table.sort
local tbl_remove = table.remove


ffi.cdef[[
typedef struct {
    double    threshold_ms;
    double    interval_ms;
    double    long_ms;
    int       max_samples;
    int       profile;
    int       breakpoints;
} loom_wd_conf_t;

typedef struct {
    uint64_t  iterations;
    uint64_t  busy_ns;
    uint64_t  max_ns;
    uint64_t  stalls;
    uint64_t  reports_dropped;
    uint64_t  samples;
    uint64_t  samples_dropped;
    uint64_t  signals;
    uint64_t  breakpoints;
    uint64_t  started_ns;
    uint64_t  buckets[18];
    int       running;
    int       profiler;
    int       bp_state;
    int       bp_errno;
} loom_wd_stats_t;

typedef struct {
    uint64_t  seq;
    double    start;
    double    duration_ms;
    double    cpu_ms;
    double    runq_ms;
    double    detect_ms;
    double    report_ms;
    uint32_t  ticks;
    uint32_t  ticks_running;
    uint32_t  ticks_sleeping;
    uint32_t  ticks_disk;
    int32_t   sys_nr[4];
    uint32_t  sys_n[4];
    uint32_t  lua_samples;
    int32_t   phase;
    int32_t   detected;
    int32_t   cpu_known;
    int32_t   runq_known;
    int32_t   timer;
    int32_t   bt_signal;
    int32_t   bt_breakpoint;
    char      wchan[48];
    char      request[256];
    char      site[320];
} loom_wd_report_t;

typedef struct {
    uint64_t  seq;
    uint32_t  off;
    uint32_t  len;
    int32_t   vmstate;
    int32_t   offcpu;
} loom_wd_sample_t;

int ngx_loom_ffi_watchdog_start(const loom_wd_conf_t *conf, void *sem,
    char **err);
int ngx_loom_ffi_watchdog_configure(const loom_wd_conf_t *conf);
int ngx_loom_ffi_watchdog_enable(int on);
void ngx_loom_ffi_watchdog_detach(void);
const loom_wd_stats_t *ngx_loom_ffi_watchdog_stats(void);
int ngx_loom_ffi_watchdog_pop(loom_wd_report_t *out);
const loom_wd_sample_t *ngx_loom_ffi_watchdog_samples(int *n,
    const char **text);
void ngx_loom_ffi_watchdog_samples_reset(void);
double ngx_loom_ffi_watchdog_busy_ms(void);
double ngx_loom_ffi_watchdog_wall(void);
void ngx_loom_ffi_watchdog_log(int level, const char *msg, size_t len);
]]


local LOG_TAG = "[loom.watchdog] "
local NBUCKETS = 18

-- upper bounds of the C histogram buckets, milliseconds
local BOUNDS_MS = { 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250,
                    500, 1000, 2500, 5000, 10000 }

local PHASES = {
    [0x0001] = "set", [0x0002] = "rewrite", [0x0004] = "access",
    [0x0008] = "content", [0x0010] = "log", [0x0020] = "header_filter",
    [0x0040] = "body_filter", [0x0080] = "timer", [0x0100] = "init_worker",
    [0x0200] = "balancer", [0x0400] = "ssl_cert",
    [0x0800] = "ssl_session_store", [0x1000] = "ssl_session_fetch",
    [0x2000] = "exit_worker", [0x4000] = "ssl_client_hello",
    [0x8000] = "server_rewrite",
}

local VMSTATES = { [78] = "compiled", [73] = "interpreted", [67] = "C",
                   [71] = "GC", [74] = "JIT compiler" }

-- x86_64 system call numbers of the calls that block a worker most often
local SYSCALLS = {
    [0] = "read", [1] = "write", [2] = "open", [3] = "close", [4] = "stat",
    [5] = "fstat", [6] = "lstat", [7] = "poll", [8] = "lseek", [9] = "mmap",
    [17] = "pread64", [18] = "pwrite64", [19] = "readv", [20] = "writev",
    [21] = "access", [23] = "select", [34] = "pause", [35] = "nanosleep",
    [42] = "connect", [43] = "accept", [44] = "sendto", [45] = "recvfrom",
    [46] = "sendmsg", [47] = "recvmsg", [56] = "clone", [57] = "fork",
    [58] = "vfork", [59] = "execve", [61] = "wait4", [72] = "fcntl",
    [73] = "flock", [74] = "fsync", [75] = "fdatasync", [76] = "truncate",
    [77] = "ftruncate", [82] = "rename", [83] = "mkdir", [87] = "unlink",
    [202] = "futex", [230] = "clock_nanosleep", [232] = "epoll_wait",
    [247] = "waitid", [257] = "openat", [270] = "pselect6", [271] = "ppoll",
    [281] = "epoll_pwait", [288] = "accept4", [435] = "clone3",
}
if jit.arch ~= "x64" then
    SYSCALLS = {}
end

local BP_ERRORS = { [1] = "EPERM", [2] = "ENOENT", [13] = "EACCES",
                    [19] = "ENODEV", [22] = "EINVAL", [28] = "ENOSPC",
                    [38] = "ENOSYS", [95] = "EOPNOTSUPP" }

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
    log_window = 0,
    log_lines = 0,
    log_suppressed = 0,
}

local report_buf = ffi_new("loom_wd_report_t")
local nsamples_buf = ffi_new("int[1]")
local text_buf = ffi_new("const char *[1]")
local errmsg = ffi_new("char *[1]")


local function syscall_name(nr)
    return SYSCALLS[nr] or ("syscall " .. nr)
end


-- "name@loc" -> { func =, source =, line = }
local function parse_frame(s)
    local at = str_find(s, "@", 1, true)
    local name, loc = s, s
    if at then
        name, loc = str_sub(s, 1, at - 1), str_sub(s, at + 1)
    end
    local src, line = str_match(loc, "^(.*):(%d+)$")
    if name == loc or (src and str_match(name, "^(.*):%d+$") == src) then
        name = nil          -- no name: a main chunk or an anonymous function
    end
    return {
        func = name,
        source = src or loc,
        line = tonumber(line),
    }
end


local function frame_label(f)
    local loc = f.line and (f.source .. ":" .. f.line) or f.source
    if f.func then
        return f.func .. " (" .. loc .. ")"
    end
    return loc
end


-- dumpstack text (outermost first, ";"-separated) -> frames innermost first
local function parse_stack(text)
    local frames = {}
    for part in str_gmatch(text, "[^;]+") do
        frames[#frames + 1] = parse_frame(part)
    end
    local n = #frames
    for i = 1, floor(n / 2) do
        frames[i], frames[n - i + 1] = frames[n - i + 1], frames[i]
    end
    return frames
end


local function round(x, digits)
    local m = 10 ^ (digits or 1)
    return floor(x * m + 0.5) / m
end


local RUNNER_SOURCE = str_sub(debug_getinfo(1, "S").source, 2)


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


local BCNAMES = require("jit.vmdef").bcnames
local CALL_OPS = { CALL = true, CALLM = true, ITERC = true, ITERN = true }


-- An off-CPU sample is taken at the instruction after the blocking call:
-- find the line of a call whose next instruction is on "resume_line".
local function call_line(fn, resume_line)
    local best
    for pc = 1, 65536 do
        local ins = funcbc(fn, pc)
        if not ins then
            break
        end
        local op = band(ins, 0xff)
        local name = str_match(str_sub(BCNAMES, op * 6 + 1, op * 6 + 6),
                               "^(%S+)")
        if CALL_OPS[name] then
            local nxt = funcinfo(fn, pc + 1)
            if nxt and nxt.currentline == resume_line then
                local here = funcinfo(fn, pc).currentline
                if here and here <= resume_line
                   and (not best or here > best)
                then
                    best = here
                end
            end
        end
    end
    return best
end


local function fix_call_line(frames)
    local reg = debug_getregistry()
    local fn = reg["loom.watchdog.fn"]
    reg["loom.watchdog.fn"] = nil
    local top = frames[1]
    if type(fn) ~= "function" or not top or not top.line then
        return
    end
    local info = debug_getinfo(fn, "S")
    local src = info.source
    if str_byte(src, 1) == 64 or str_byte(src, 1) == 61 then
        src = str_sub(src, 2)
    end
    if src ~= top.source or top.line < info.linedefined
       or (info.lastlinedefined > 0 and top.line > info.lastlinedefined)
    then
        return
    end
    local line = call_line(fn, top.line)
    if line then
        top.resumed_at = top.line
        top.line = line
    end
end


-- a frame of the code that runs timer callbacks: this module's ngx.timer
-- wrapper, resty.loom.timer, or the xpcall it calls callbacks with
local function is_runner(f)
    return f.source == RUNNER_SOURCE
           or str_find(f.source, "resty/loom/timer", 1, true) ~= nil
           or str_find(f.source, "[builtin#", 1, true) == 1
end


-- drops the runner's frames under a timer's callback (frames innermost
-- first); the callback has no name of its own. Without a site (a loom
-- timer made with stats = false) the callback frame stands for it.
local function drop_runner_frames(timer, frames)
    local n = #frames
    if n == 0 or not is_runner(frames[n]) then
        return
    end
    while n > 0 and is_runner(frames[n]) do
        frames[n] = nil
        n = n - 1
    end
    local cb = frames[n]
    if cb then
        cb.func = nil
        if not timer.callback then
            timer.callback = cb.source
        end
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


-- the bottom frame of every timer made while the watchdog runs; the C side
-- reads its local loom_timer_site to tell where the timer was created
local function loom_timer_runner(premature, loom_timer_site, cb, ...)
    cb(premature, ...)
end


local function src_name(info)
    local src = info.source
    if str_byte(src, 1) == 64 then        -- "@path"
        return str_sub(src, 2)
    end
    return info.short_src
end


-- "<where ngx.timer.at was called>|<where the callback is defined>"
local function timer_site(cb)
    local info = debug_getinfo(3, "Sl")
    local def = debug_getinfo(cb, "S")
    local site = info and (src_name(info) .. ":" .. (info.currentline or 0))
                 or "?"
    return site .. "|" .. src_name(def) .. ":" .. def.linedefined
end


-- ngx.timer.at or every (as made by make) with the creation site noted
local function noting_site(make)
    return function(delay, cb, ...)
        if type(cb) ~= "function" then
            return make(delay, cb, ...)
        end
        return make(delay, loom_timer_runner, timer_site(cb), cb, ...)
    end
end


-- wraps what ngx.timer.at/every are now (native ones, or another
-- library's), except resty.loom.timer's after its patch(): those name
-- their timers themselves, and raise at their caller's line
local function wrap_timers()
    local timer = ngx.timer
    local loom = package.loaded["resty.loom.timer"]
    local patched = type(loom) == "table"
    -- luacheck: push ignore 122
    if not (patched and timer.at == loom.at) then
        timer.at = noting_site(timer.at)
    end
    if not (patched and timer.every == loom.every) then
        timer.every = noting_site(timer.every)
    end
    -- luacheck: pop
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
        error("opts.interval must not exceed opts.threshold", 3)
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
    if o.backtraces ~= state.opts.backtraces
       or o.breakpoints ~= state.opts.breakpoints
       or o.timers ~= state.opts.timers
    then
        error("backtraces, breakpoints and timers can only be set by start",
              2)
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
    if opts ~= nil and type(opts) ~= "table" then
        error("opts must be a table", 2)
    end
    local o = { title = "Event-loop stalls", unit = "ms" }
    for k, v in pairs(opts or {}) do
        o[k] = v
    end
    -- the SVG alone: ngx.print(watchdog.flamegraph()) must serve a valid
    -- document (the renderer's second value, the frame count, would follow
    -- </svg>)
    local ok, svg = pcall(flamegraph.svg, _M.folded(reports), o)
    if not ok then
        -- a bad option: named at the caller's line, not this one
        error((str_gsub(tostring(svg), "^[^:]*:%d+: ", "")), 2)
    end
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
