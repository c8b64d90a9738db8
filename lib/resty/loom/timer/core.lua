-- The timer engine without nginx: job store, timing wheel, ready queue,
-- run/reschedule logic and statistics, driven by an injected clock
-- (microseconds). resty.loom.timer drives it from native timers; the unit
-- tests drive it with a fake clock.
--
-- Jobs live in parallel arrays indexed by a small integer id (an FFI struct
-- array for the numeric fields, grown without copying by
-- resty.loom.timer.array, and Lua arrays for the callback and its first two
-- arguments), so a pending timer costs about 100 bytes and no table.
-- A handle is the number gen * 2^24 + id; freeing a job bumps gen, so stale
-- handles are refused.


local ffi = require "ffi"
local bit = require "bit"
local wheel = require "resty.loom.timer.wheel"
local array = require "resty.loom.timer.array"
local stats = require "resty.loom.timer.stats"
local on_error = require("resty.loom.error_handler").handler

local ffi_sizeof = ffi.sizeof
local arr_new = array.new
local arr_grow = array.grow
local band = bit.band
local bor = bit.bor
local bnot = bit.bnot
local floor = math.floor
local ceil = math.ceil
local random = math.random
local type = type
local select = select
local error = error
local xpcall = xpcall
local unpack = unpack
local tostring = tostring
local setmetatable = setmetatable
local tonumber = tonumber
local pairs = pairs
local str_find = string.find
local str_sub = string.sub
local tbl_concat = table.concat
local getinfo = debug.getinfo
local record = stats.record
local new_record = stats.new_record

local ok_new, tbl_new = pcall(require, "table.new")
if not ok_new then
    tbl_new = function() return {} end
end
local ok_clear, tbl_clear = pcall(require, "table.clear")
if not ok_clear then
    tbl_clear = function(t)
        for k in pairs(t) do
            t[k] = nil
        end
    end
end


pcall(ffi.cdef, [[
typedef struct {
    double   due;       /* nominal due time (us); remaining time if paused */
    double   interval;  /* us; 0 for one-shot timers */
    uint32_t gen;
    uint32_t qtok;
    uint32_t site;      /* index of the site record; 0: none */
    uint8_t  state;
    uint8_t  flags;
    uint8_t  nargs;
    uint8_t  mode;
} loom_timer_job_t;
]])


local JOBS = ffi.typeof("loom_timer_job_t[?]")
local JOB_PTR = ffi.typeof("loom_timer_job_t *")
local JOB_SIZE = ffi_sizeof("loom_timer_job_t")

local FREE = 0
local PENDING = 1
local QUEUED = 2
local RUNNING = 3
local PAUSED = 4
local STATE_NAMES = { [PENDING] = "pending", [QUEUED] = "queued",
                      [RUNNING] = "running", [PAUSED] = "paused" }

local F_CANCEL = 1
local F_PAUSE = 2
local F_PREMATURE = 4
local F_EXTRA = 8           -- has a name, name statistics or max_run_time

local ONCE = 0
local FIXED_RATE = 1
local FIXED_DELAY = 2
local MODES = { fixed_rate = FIXED_RATE, fixed_delay = FIXED_DELAY }

local ID_SPAN = 16777216            -- 2^24 ids
local GEN_SPAN = 268435456          -- 2^28 generations
local MAX_STACK = 12
local MAX_CACHED = 4096
local MANY_ARGS = 255       -- job.nargs for 255 or more: the count is argv.n


local _M = {
    _VERSION = "0.2.0",
    MAX_TIMERS = ID_SPAN - 1,
}
local mt = { __index = _M }


-- ngx.timer turns a delay into whole milliseconds, an unsigned integer
-- added to its signed clock: NaN, negative delays and delays of 2^63 ms or
-- more expire at once, while every() refuses a delay that truncates to
-- 0 ms (which 2^64 ms or more, inf included, wrap to). The positional forms
-- of at() and every() keep those outcomes, so that patch() is drop-in.
local WRAP_MS = 2 ^ 63
local ZERO_MS = 2 ^ 64
local MAX_SECONDS = 1e9     -- about 31 years: longer is a mistake


local function seconds_from(v)
    return type(v) == "number" and v >= 0 and v <= MAX_SECONDS
end


local function seconds_over(v)
    return type(v) == "number" and v > 0 and v <= MAX_SECONDS
end


local function interval_ok(v)
    return type(v) == "number" and v >= 0.001 and v <= MAX_SECONDS
end


local function is_string(v)
    return type(v) == "string"
end


local function is_boolean(v)
    return type(v) == "boolean"
end


local function is_mode(v)
    return MODES[v] ~= nil
end


-- the options of at() and every(): name -> { check, what it must be }.
-- An option is added here and nowhere else.
local SECONDS = "a number of seconds from 0 to 1e9"
local COMMON_OPTS = {
    name = { is_string, "a string" },
    replace = { is_boolean, "a boolean" },
    jitter = { seconds_from, SECONDS },
    max_run_time = { seconds_over, "a number of seconds over 0, at most 1e9" },
}
local AT_OPTS = { delay = { seconds_from, SECONDS } }
local EVERY_OPTS = {
    interval = { interval_ok, "a number of seconds from 0.001 to 1e9" },
    delay = { seconds_from, SECONDS },
    mode = { is_mode, "\"fixed_rate\" or \"fixed_delay\"" },
}
for k, v in pairs(COMMON_OPTS) do
    AT_OPTS[k] = v
    EVERY_OPTS[k] = v
end
_M.AT_OPTS = AT_OPTS
_M.EVERY_OPTS = EVERY_OPTS


local function default_log(_, msg)
    io.stderr:write(msg, "\n")
end


function _M.new(opts)
    opts = opts or {}
    if type(opts) ~= "table" then
        error("opts must be a table", 2)
    end
    local res = opts.resolution or 0.01
    if type(res) ~= "number" or not (res >= 0.001 and res <= 1) then
        error("opts.resolution must be a number between 0.001 and 1", 2)
    end
    local clock = opts.clock
    if type(clock) ~= "function" then
        error("opts.clock must be a function", 2)
    end
    local max_rt = opts.max_run_time
    if max_rt ~= nil and not seconds_over(max_rt) then
        error("opts.max_run_time must be a number of seconds over 0, "
              .. "at most 1e9", 2)
    end
    local max_names = opts.max_names or 1000
    if type(max_names) ~= "number"
       or not (max_names >= 0 and max_names <= 1e6)
    then
        error("opts.max_names must be a number from 0 to 1e6", 2)
    end
    local cap = 1024
    local res_us = floor(res * 1e6 + 0.5)
    local now = clock()
    local store = arr_new(JOB_PTR, JOBS, JOB_SIZE, cap + 1)
    local self = {
        res = res_us,
        clock = clock,
        wake = opts.wake,           -- wake(ctx): the earliest deadline moved
        ctx = opts.ctx,
        log = opts.log or default_log,
        random = opts.random or random,
        with_stats = opts.stats ~= false,
        precise_sites = opts.precise_sites and true or false,
        site_level = opts.site_level or 3,  -- stack level of at()'s caller
        err_level = opts.err_level or 2,    -- error() level of at()'s caller
        max_rt = max_rt and max_rt * 1e6 or nil,
        max_names = max_names,
        sleep_until = nil,          -- set by the driver while it sleeps
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
        q_id = tbl_new(256, 0),
        q_tok = tbl_new(256, 0),
        q_time = tbl_new(256, 0),
        qh = 1,
        qt = 0,
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


-- ids -------------------------------------------------------------------


local function grow(self)
    local cap = self.cap * 2
    if cap > ID_SPAN - 1 then
        cap = ID_SPAN - 1
    end
    -- the arrays may move: callers re-read self.jobs after alloc()
    self.jobs = arr_grow(self.store, cap + 1)
    self.wheel:grow(cap)
    self.cap = cap
end


local function alloc(self)
    local n = self.nfree
    if n > 0 then
        local id = self.free[n]
        self.nfree = n - 1
        return id
    end
    local id = self.top + 1
    if id > self.cap then
        if self.cap >= ID_SPAN - 1 then
            return nil
        end
        grow(self)
    end
    self.top = id
    return id
end


local function handle_of(self, id)
    return self.jobs[id].gen * ID_SPAN + id
end


-- handle (number) or name (string) -> id of a live job, or nil
local function lookup(self, h)
    if type(h) == "string" then
        h = self.names[h]
        if not h then
            return nil
        end
    end
    if type(h) ~= "number" then
        return nil
    end
    local id = h % ID_SPAN
    if id < 1 or id > self.top then
        return nil
    end
    local j = self.jobs[id]
    if j.state == FREE or j.gen ~= (h - id) / ID_SPAN then
        return nil
    end
    return id
end


local function release_name(self, id)
    local name = self.name_of[id]
    if name then
        if self.names[name] == handle_of(self, id) then
            self.names[name] = nil
        end
        self.name_of[id] = nil
    end
end


local function free_job(self, id)
    local j = self.jobs[id]
    if j.state == PAUSED then
        self.paused = self.paused - 1
    end
    local extra = band(j.flags, F_EXTRA) ~= 0
    if extra then
        release_name(self, id)
    end
    j.state = FREE
    j.flags = 0
    j.gen = (j.gen + 1) % GEN_SPAN
    self.cb[id] = nil
    local n = j.nargs
    if n > 0 then
        self.a1[id] = nil
        if n > 1 then
            self.a2[id] = nil
            if n > 2 then
                self.argv[id] = nil
            end
        end
    end
    local si = j.site
    if si ~= 0 then
        local rec = self.site_list[si]
        rec.pending = rec.pending - 1
        j.site = 0
    end
    if extra then
        local rec = self.nrec[id]
        if rec then
            rec.pending = rec.pending - 1
            self.nrec[id] = nil
        end
        self.maxrt[id] = nil
    end
    local nf = self.nfree + 1
    self.free[nf] = id
    self.nfree = nf
    self.alive = self.alive - 1
end


-- queue -------------------------------------------------------------------


local function notify(self, at)
    local su = self.sleep_until
    if su and at < su then
        self.sleep_until = nil      -- one wake-up per sleep
        local wake = self.wake
        if wake then
            wake(self.ctx)
        end
    end
end


local function enqueue(self, id, now)
    local j = self.jobs[id]
    j.state = QUEUED
    local tok = (j.qtok + 1) % GEN_SPAN
    j.qtok = tok
    local qt = self.qt + 1
    self.qt = qt
    self.q_id[qt] = id
    self.q_tok[qt] = tok
    self.q_time[qt] = now
end


local function schedule(self, id, due)
    local j = self.jobs[id]
    j.due = due
    j.state = PENDING
    local res = self.res
    local tick = ceil(due / res)
    self.wheel:insert(id, tick)
    notify(self, tick * res)
end


-- called by the wheel for each expired id
local function on_expire(self, id)
    enqueue(self, id, self.now_us)
end


-- creation ----------------------------------------------------------------


-- frames of this library, and of the watchdog's ngx.timer wrapper, are
-- not the creation site
local function is_ours(src)
    return str_find(src, "resty/loom/timer", 1, true) ~= nil
           or str_find(src, "resty/loom/watchdog", 1, true) ~= nil
end


-- a chunk's file path in full ("@path" sources), else its short name
local function path_of(info)
    local src = info.source
    if str_sub(src, 1, 1) == "@" then
        return str_sub(src, 2)
    end
    return info.short_src
end


-- the statistics record of the place that created a timer. Without
-- precise_sites the place is looked up once per callback function (the
-- first creation with it) and cached, which keeps at() JIT-compiled.
local function site_for(self, cb)
    local precise = self.precise_sites
    local rec
    if not precise then
        if cb == self.last_cb then
            return self.last_rec
        end
        rec = self.site_by_cb[cb]
        if rec then
            self.last_cb = cb
            self.last_rec = rec
            return rec
        end
    end
    -- site_for (1) <- add (2, tail-called by at/every) <- caller (3):
    -- self.site_level; frames of our own modules are skipped
    local level = self.site_level
    local info = getinfo(level, "Sl")
    while info and is_ours(info.source) do
        level = level + 1
        info = getinfo(level, "Sl")
    end
    local key = info and (info.short_src .. ":" .. info.currentline) or "?"
    rec = self.sites[key]
    if not rec then
        rec = new_record("site", key)
        local def = getinfo(cb, "S")
        -- "<created at>|<callback defined at>", full paths: what the
        -- watchdog reports when this timer's callback stalls the loop
        rec.watchdog_site = (info and (path_of(info) .. ":"
                                       .. info.currentline) or "?")
                            .. "|" .. path_of(def) .. ":" .. def.linedefined
        local frames = {}
        local n = 0
        while info and n < MAX_STACK do
            if info.what ~= "C" then
                n = n + 1
                frames[n] = info.short_src .. ":" .. info.currentline
            end
            level = level + 1
            info = getinfo(level, "Sl")
        end
        local folded = {}
        for i = n, 1, -1 do
            folded[#folded + 1] = frames[i]
        end
        folded[#folded + 1] = "callback " .. def.short_src .. ":"
                              .. def.linedefined
        rec.stack = tbl_concat(folded, ";")
        self.sites[key] = rec
        local ns = self.nsites + 1
        self.nsites = ns
        self.site_list[ns] = rec
        rec.idx = ns
    end
    if not precise then
        -- a strong cache, emptied when full: a weak-keyed table would make
        -- every GC cycle walk the fresh closures of code that creates one
        -- per timer
        local n = self.ncached + 1
        if n > MAX_CACHED then
            tbl_clear(self.site_by_cb)
            n = 1
        end
        self.ncached = n
        self.site_by_cb[cb] = rec
        self.last_cb = cb
        self.last_rec = rec
    end
    return rec
end


local function name_rec(self, name)
    local rec = self.name_stats[name]
    if not rec and self.nnames < self.max_names then
        rec = new_record("name", name)
        self.name_stats[name] = rec
        self.nnames = self.nnames + 1
    end
    return rec
end


-- the common part of at() and every(); delay and interval in seconds
local function add(self, delay, interval, mode, opts, cb, n, ...)
    if self.exiting and (delay > 0 or interval > 0) then
        return nil, "process exiting"
    end

    local name
    if opts then
        name = opts.name
        if name ~= nil then
            local old = lookup(self, name)
            if old and band(self.jobs[old].flags, F_CANCEL) == 0 then
                if not opts.replace then
                    return nil, "exists"
                end
                _M.cancel(self, name)
            end
        end
        local jitter = opts.jitter
        if jitter and jitter > 0 then
            delay = delay + self.random() * jitter
        end
    end

    local id = alloc(self)
    if not id then
        return nil, "too many timers"
    end
    local clock = self.clock
    local now = clock()
    local j = self.jobs[id]         -- after alloc(): the array may move
    j.interval = interval * 1e6
    j.mode = mode
    j.flags = 0
    j.nargs = n < MANY_ARGS and n or MANY_ARGS
    self.cb[id] = cb
    if n > 0 then
        local v1, v2 = ...
        self.a1[id] = v1
        if n > 1 then
            self.a2[id] = v2
            if n >= MANY_ARGS then
                self.argv[id] = { n = n, ... }
            elseif n > 2 then
                self.argv[id] = { ... }
            end
        end
    end
    if self.with_stats then
        local rec = site_for(self, cb)
        rec.pending = rec.pending + 1
        rec.created = rec.created + 1
        j.site = rec.idx
    end
    if opts and (name ~= nil or opts.max_run_time) then
        j.flags = F_EXTRA
        if name ~= nil then
            self.name_of[id] = name
            self.names[name] = handle_of(self, id)
            if self.with_stats then
                local rec = name_rec(self, name)
                if rec then
                    rec.pending = rec.pending + 1
                    rec.created = rec.created + 1
                    self.nrec[id] = rec
                end
            end
        end
        local mrt = opts.max_run_time
        if mrt then
            self.maxrt[id] = mrt * 1e6
        end
    end
    self.alive = self.alive + 1
    local totals = self.totals
    totals.created = totals.created + 1

    if delay <= 0 then
        j.due = now
        enqueue(self, id, now)
        notify(self, now)
    else
        schedule(self, id, now + ceil(delay * 1e6))
    end
    return handle_of(self, id)
end


-- raises at the level of the API's caller: err_level counts from at() or
-- every(), and every caller of argerror() is a helper called by them
local function argerror(self, fname, msg)
    error("bad argument to '" .. fname .. "' (" .. msg .. ")",
          self.err_level + 2)
end


local function check_opts(self, fname, opts, spec, required)
    for k, v in pairs(opts) do
        local c = spec[k]
        if not c then
            argerror(self, fname, "opts." .. tostring(k) .. " is not an option")
        end
        if not c[1](v) then
            argerror(self, fname, "opts." .. k .. " must be " .. c[2])
        end
    end
    if opts[required] == nil then
        argerror(self, fname, "opts." .. required .. " is required")
    end
end


-- the positional delay of at() or interval of every(): a number, or a
-- string that reads as one (ngx.timer accepts both)
local function number_arg(self, fname, v)
    if type(v) == "number" then
        return v
    end
    local n = type(v) == "string" and tonumber(v)
    if not n then
        argerror(self, fname, "number or options table expected, got "
                 .. type(v))
    end
    return n
end


local function native_interval(self, v)
    local ms = v * 1000
    if ms ~= ms or ms <= -1 or (ms >= WRAP_MS and ms < ZERO_MS) then
        -- ngx.timer.every runs it on every event-loop turn: every tick
        return self.res / 1e6
    end
    if ms < 1 or ms >= ZERO_MS then
        argerror(self, "every", "interval must be at least 0.001 s and "
                 .. "under 2^64 ms; ngx.timer.every: delay cannot be zero")
    end
    return v
end


local function check_callback(self, fname, cb)
    if type(cb) ~= "function" then
        argerror(self, fname, "callback must be a function")
    end
end


-- at(delay | opts, callback, ...) -> handle | nil, err
function _M.at(self, delay, cb, ...)
    local opts
    if type(delay) == "table" then
        opts = delay
        check_opts(self, "at", opts, AT_OPTS, "delay")
        delay = opts.delay
    else
        delay = number_arg(self, "at", delay)
        if not (delay > 0 and delay * 1000 < WRAP_MS) then
            delay = 0           -- NaN, <= 0 or past the wrap: at once
        end
    end
    check_callback(self, "at", cb)
    return add(self, delay, 0, ONCE, opts, cb, select("#", ...), ...)
end


-- every(interval | opts, callback, ...) -> handle | nil, err
function _M.every(self, interval, cb, ...)
    local opts
    local mode = FIXED_RATE
    local delay
    if type(interval) == "table" then
        opts = interval
        check_opts(self, "every", opts, EVERY_OPTS, "interval")
        interval = opts.interval
        mode = MODES[opts.mode or "fixed_rate"]
        delay = opts.delay
    else
        interval = native_interval(self, number_arg(self, "every", interval))
    end
    check_callback(self, "every", cb)
    return add(self, delay or interval, interval, mode, opts, cb,
               select("#", ...), ...)
end


-- control -----------------------------------------------------------------


-- the job behind a handle, unless it is gone or was cancelled while it
-- runs: id, job, state
local function live(self, h)
    local id = lookup(self, h)
    if not id then
        return nil
    end
    local j = self.jobs[id]
    local st = j.state
    if st == RUNNING and band(j.flags, F_CANCEL) ~= 0 then
        return nil
    end
    return id, j, st
end


function _M.cancel(self, h)
    local id, j, st = live(self, h)
    if not id then
        return nil, "not found"
    end
    if st == RUNNING then
        j.flags = bor(j.flags, F_CANCEL)
        release_name(self, id)
    else
        if st == PENDING then
            self.wheel:remove(id)
        end
        free_job(self, id)
    end
    local totals = self.totals
    totals.cancelled = totals.cancelled + 1
    return true
end


function _M.pause(self, h)
    local id, j, st = live(self, h)
    if not id then
        return nil, "not found"
    end
    if st == RUNNING then
        j.flags = bor(j.flags, F_PAUSE)
        return true
    end
    if st == PAUSED then
        return true
    end
    local remaining = 0
    if st == PENDING then
        self.wheel:remove(id)
        remaining = j.due - self.clock()
        if remaining < 0 then
            remaining = 0
        end
    end
    j.due = remaining
    j.state = PAUSED
    self.paused = self.paused + 1
    return true
end


function _M.resume(self, h)
    local id, j, st = live(self, h)
    if not id then
        return nil, "not found"
    end
    if st == RUNNING then
        j.flags = band(j.flags, bnot(F_PAUSE))
        return true
    end
    if st ~= PAUSED then
        return true
    end
    self.paused = self.paused - 1
    local now = self.clock()
    local remaining = j.due
    if remaining <= 0 then
        j.due = now
        enqueue(self, id, now)
        notify(self, now)
    else
        schedule(self, id, now + remaining)
    end
    return true
end


-- "pending", "queued", "running", "paused", or nil (unknown, cancelled or
-- finished)
function _M.state(self, h)
    local id = lookup(self, h)
    if not id then
        return nil
    end
    local j = self.jobs[id]
    local f = j.flags
    if band(f, F_CANCEL) ~= 0 then
        return nil
    end
    if j.state == RUNNING and band(f, F_PAUSE) ~= 0 then
        return "paused"
    end
    return STATE_NAMES[j.state]
end


function _M.is_active(self, h)
    local st = _M.state(self, h)
    return st ~= nil and st ~= "paused"
end


-- the handle registered under name, or nil
function _M.handle(self, name)
    local id = lookup(self, name)
    if not id then
        return nil
    end
    return handle_of(self, id)
end


-- driving -----------------------------------------------------------------


-- moves every timer due at now_us (default: the clock) to the ready queue;
-- returns the queue length
function _M.advance(self, now_us)
    now_us = now_us or self.clock()
    self.now_us = now_us
    self.wheel:advance(floor(now_us / self.res), on_expire, self)
    return self.qt - self.qh + 1
end


-- when the driver must wake next (us), or nil when nothing is scheduled
function _M.next_wake(self)
    if self.qt >= self.qh then
        return 0
    end
    local t = self.wheel:next_tick()
    if t then
        return t * self.res
    end
    return nil
end


-- the next wheel deadline (us) only, ignoring the ready queue
function _M.next_deadline(self)
    local t = self.wheel:next_tick()
    if t then
        return t * self.res
    end
    return nil
end


function _M.queued(self)
    return self.qt - self.qh + 1
end


-- skips stale entries (jobs cancelled or paused while queued)
local function pop_slow(self)
    local qh, qt = self.qh, self.qt
    local jobs = self.jobs
    local q_id, q_tok = self.q_id, self.q_tok
    while qh <= qt do
        local id = q_id[qh]
        local tok = q_tok[qh]
        local qtime = self.q_time[qh]
        qh = qh + 1
        local j = jobs[id]
        if j.state == QUEUED and j.qtok == tok then
            if qh > qt then
                self.qh = 1
                self.qt = 0
            else
                self.qh = qh
            end
            return id, qtime
        end
    end
    self.qh = 1
    self.qt = 0
    return nil
end


-- loop-free in the common case, so that the caller's loop compiles
local function pop(self)
    local qh, qt = self.qh, self.qt
    if qh > qt then
        self.qh = 1
        self.qt = 0
        return nil
    end
    local id = self.q_id[qh]
    local j = self.jobs[id]
    if j.state == QUEUED and j.qtok == self.q_tok[qh] then
        local qtime = self.q_time[qh]
        if qh >= qt then
            self.qh = 1
            self.qt = 0
        else
            self.qh = qh + 1
        end
        return id, qtime
    end
    return pop_slow(self)
end


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


-- runs the next queued job; returns false when the queue is empty.
-- now: the clock, when the caller has just read it (a lane passes the end
-- of its previous run: runs back to back cost one clock read each)
function _M.run_next(self, now)
    local id, qtime = pop(self)
    if not id then
        return false
    end
    local j = self.jobs[id]
    local prem = band(j.flags, F_PREMATURE) ~= 0
    local mode = j.mode
    local totals = self.totals
    j.state = RUNNING
    local extra = band(j.flags, F_EXTRA) ~= 0
    -- read by the watchdog (src/ngx_loom_watchdog.c looks for locals of
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
    local nrec = extra and self.nrec[id] or nil
    if rec then
        rec.running = rec.running + 1
    end
    if nrec then
        nrec.running = nrec.running + 1
    end
    self.running = self.running + 1

    local pre = self.pre_run
    if pre then
        pre()
    end
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

    local t1 = clock()
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
    if rec then
        rec.running = rec.running - 1
        record(rec, rt, late, qw)
        if prem then
            rec.premature = rec.premature + 1
        end
    end
    if nrec then
        nrec.running = nrec.running - 1
        record(nrec, rt, late, qw)
        if prem then
            nrec.premature = nrec.premature + 1
        end
    end
    if not ok then
        totals.errors = totals.errors + 1
        report_error(self, id, rec, err)
    end
    local mrt = extra and self.maxrt[id] or self.max_rt
    if mrt and rt > mrt then
        totals.overruns = totals.overruns + 1
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
        queued = self.qt - self.qh + 1,
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
