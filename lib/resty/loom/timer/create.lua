-- Creating timers: at() and every(), their arguments and options (checked
-- before anything is made), and the job record they fill in.


local bit = require "bit"
local options = require "resty.loom.opts"
local job = require "resty.loom.timer.jobs"
local sched = require "resty.loom.timer.schedule"
local sites = require "resty.loom.timer.sites"
local control = require "resty.loom.timer.control"

local band = bit.band
local ceil = math.ceil
local type = type
local select = select
local error = error
local tostring = tostring
local tonumber = tonumber
local pairs = pairs
local alloc = job.alloc
local lookup = job.lookup
local handle_of = job.handle_of
local enqueue = sched.enqueue
local notify = sched.notify
local schedule = sched.schedule
local site_for = sites.site_for
local name_rec = sites.name_rec
local cancel = control.cancel

local F_CANCEL = job.F_CANCEL
local F_EXTRA = job.F_EXTRA
local ONCE = job.ONCE
local FIXED_RATE = job.FIXED_RATE
local MODES = job.MODES
local MANY_ARGS = job.MANY_ARGS


-- ngx.timer turns a delay into whole milliseconds, an unsigned integer
-- added to its signed clock: NaN, negative delays and delays of 2^63 ms or
-- more expire at once, while every() refuses a delay that truncates to
-- 0 ms (which 2^64 ms or more, inf included, wrap to). The positional forms
-- of at() and every() keep those outcomes, so that patch() is drop-in.
local WRAP_MS = 2 ^ 63
local ZERO_MS = 2 ^ 64
local MAX_SECONDS = 1e9     -- about 31 years: longer is a mistake


-- the options of at() and every(): name -> rule (resty.loom.opts). An
-- option is added here and nowhere else.
local SECONDS = options.number(0, MAX_SECONDS)
local COMMON_RULES = {
    name = options.string,
    replace = options.boolean,
    jitter = SECONDS,
    max_run_time = options.above(0, MAX_SECONDS),
}
local AT_RULES = { delay = SECONDS }
local EVERY_RULES = {
    interval = options.number(0.001, MAX_SECONDS),
    delay = SECONDS,
    mode = options.one_of("fixed_rate", "fixed_delay"),
}
for k, v in pairs(COMMON_RULES) do
    AT_RULES[k] = v
    EVERY_RULES[k] = v
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
                cancel(self, name)
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


-- the rules' wording (resty.loom.opts), inside at()'s and every()'s
-- "bad argument" like their other argument errors
local function check_opts(self, fname, opts, rules, required)
    for k, v in pairs(opts) do
        local rule = rules[k]
        if not rule then
            argerror(self, fname, "opts." .. tostring(k) .. " is not an option")
        end
        local bad = rule(v)
        if bad then
            argerror(self, fname, "opts." .. k .. " must be " .. bad)
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


local _M = { _VERSION = "0.2.0" }


-- at(delay | opts, callback, ...) -> handle | nil, err
function _M.at(self, delay, cb, ...)
    local opts
    if type(delay) == "table" then
        opts = delay
        check_opts(self, "at", opts, AT_RULES, "delay")
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
        check_opts(self, "every", opts, EVERY_RULES, "interval")
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


return _M
