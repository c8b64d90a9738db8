-- Per creation site / per name timer statistics: counters plus three
-- log-bucket histograms (run time, lateness, queue wait). Recording is O(1)
-- with no allocation; histograms merge exactly across workers. What every
-- run updates lives in one FFI struct per record (rec.c): a compiled run
-- writes it at fixed offsets from one pointer, where the fields of a Lua
-- table cost a guarded hash-slot check each (issue 27: a third less per
-- callback for the statistics).


local ffi = require "ffi"

local ffi_new = ffi.new
local floor = math.floor
local min = math.min
local max = math.max
local huge = math.huge
local tobit = require("bit").tobit
local log = math.log
local pairs = pairs
local ipairs = ipairs
local type = type
local tostring = tostring
local tonumber = tonumber


-- bucket 0 holds values under 1 us; bucket i >= 1 holds
-- [GROWTH^(i-1), GROWTH^i) us; 1.2^120 us is about 3.3 days
local NB = 120
local GROWTH = 1.2
local INV_LOG_G = 1 / log(GROWTH)

-- counts are doubles: exact to 2^53, where a uint32_t bucket of a site
-- running 500,000 times a second would wrap after 2.4 hours
pcall(ffi.cdef, [[
typedef struct {
    double running;
    double runs;
    double rt_sum;
    double rt_min;
    double rt_max;
    double late_max;
    double qw_max;
    double rt[120];
    double late[120];
    double qw[120];
} loom_timer_stat_t;
]])
local STAT = ffi.typeof("loom_timer_stat_t")


local _M = { _VERSION = "0.2.0", BUCKETS = NB, GROWTH = GROWTH }


local function bucket_of(us)
    if us < 1 then
        return 0
    end
    local i = floor(log(us) * INV_LOG_G) + 1
    if i >= NB then
        return NB - 1
    end
    return i
end


-- the buckets of whole microseconds under 262,144 (256 KB), which are
-- nearly all values, even of an overloaded worker: a table read instead of
-- a logarithm on every run
local LUT_N = 262144
local LUT_LAST = LUT_N - 1
local LUT = ffi_new("uint8_t[?]", LUT_N)
for us = 0, LUT_N - 1 do
    LUT[us] = bucket_of(us)
end


-- one branch, almost always taken the same way: a trace recorded on the
-- rare side would leave the common one through a side exit on every run
local function bucket(us)
    local i = tobit(min(max(us, 0), LUT_LAST))
    if i == us then
        return LUT[i]
    end
    return bucket_of(us)
end


function _M.new_record(kind, key)
    return {
        kind = kind,              -- "site" or "name"
        key = key,
        stack = nil,              -- folded creation stack (sites)
        created = 0,
        pending = 0,
        errors = 0,
        overruns = 0,
        skipped = 0,
        premature = 0,
        last_error = nil,
        -- running, runs, rt_sum, rt_min (-1 in raw() while there is no
        -- run), rt_max, late_max, qw_max, and the histograms rt, late, qw
        c = STAT({ rt_min = huge }),
    }
end


-- c: a record's rec.c; all values in microseconds; late < 0: none
-- (premature runs). Minima and maxima use min()/max() rather than
-- branches, which keeps the compiled run loop on one path
function _M.record(c, rt, late, qw)
    c.runs = c.runs + 1
    c.rt_sum = c.rt_sum + rt
    c.rt_max = max(c.rt_max, rt)
    c.rt_min = min(c.rt_min, rt)
    local i = bucket(rt)
    c.rt[i] = c.rt[i] + 1
    if late >= 0 then
        c.late_max = max(c.late_max, late)
        i = bucket(late)
        c.late[i] = c.late[i] + 1
    end
    c.qw_max = max(c.qw_max, qw)
    i = bucket(qw)
    c.qw[i] = c.qw[i] + 1
end


-- q-th quantile (0 < q <= 1) of a histogram given as cdata or as a sparse
-- Lua table { [bucket] = count }; upper bucket bound, capped by max
local function quantile(h, total, q, max, sparse)
    if total <= 0 then
        return nil
    end
    local rank = q * total
    local seen = 0
    for i = 0, NB - 1 do
        local c = h[i]
        if sparse then
            c = c or 0
        end
        seen = seen + c
        if seen >= rank then
            local upper = i == 0 and 1 or GROWTH ^ i
            if upper > max then
                upper = max
            end
            return upper
        end
    end
    return max
end
_M.quantile = quantile


local function hist_total(h, sparse)
    local n = 0
    if sparse then
        for _, c in pairs(h) do
            n = n + c
        end
        return n
    end
    for i = 0, NB - 1 do
        n = n + h[i]
    end
    return n
end


local function sparse_copy(h)
    local out = {}
    for i = 0, NB - 1 do
        local c = h[i]
        if c > 0 then
            out[i] = c
        end
    end
    return out
end


-- a plain table of the raw figures (histograms as sparse tables keyed by
-- bucket number, as strings so that JSON round trips keep them)
function _M.raw(rec)
    local function strkeys(t)
        local o = {}
        for k, v in pairs(t) do
            o[tostring(k)] = v
        end
        return o
    end
    local c = rec.c
    return {
        kind = rec.kind, key = rec.key, stack = rec.stack,
        created = rec.created, pending = rec.pending,
        running = c.running, runs = c.runs, errors = rec.errors,
        overruns = rec.overruns, skipped = rec.skipped,
        premature = rec.premature, rt_sum = c.rt_sum,
        rt_min = c.rt_min == huge and -1 or c.rt_min,
        rt_max = c.rt_max,
        late_max = c.late_max, qw_max = c.qw_max,
        last_error = rec.last_error,
        rt = strkeys(sparse_copy(c.rt)),
        late = strkeys(sparse_copy(c.late)),
        qw = strkeys(sparse_copy(c.qw)),
    }
end


local SUMS = { "created", "pending", "running", "runs", "errors",
               "overruns", "skipped", "premature", "rt_sum" }

-- merges raw records (from raw()) into one raw record
function _M.merge(dst, src)
    if not dst then
        dst = { kind = src.kind, key = src.key, stack = src.stack,
                rt_min = -1, rt_max = 0, late_max = 0, qw_max = 0,
                rt = {}, late = {}, qw = {} }
        for _, f in ipairs(SUMS) do
            dst[f] = 0
        end
    end
    for _, f in ipairs(SUMS) do
        dst[f] = dst[f] + (src[f] or 0)
    end
    if src.rt_min and src.rt_min >= 0
       and (dst.rt_min < 0 or src.rt_min < dst.rt_min)
    then
        dst.rt_min = src.rt_min
    end
    for _, f in ipairs({ "rt_max", "late_max", "qw_max" }) do
        if (src[f] or 0) > dst[f] then
            dst[f] = src[f]
        end
    end
    dst.last_error = src.last_error or dst.last_error
    for _, f in ipairs({ "rt", "late", "qw" }) do
        local d = dst[f]
        for k, c in pairs(src[f] or {}) do
            d[k] = (d[k] or 0) + c
        end
    end
    return dst
end


local function r6(us)
    -- microseconds to seconds, rounded to the microsecond
    if not us then
        return nil
    end
    return floor(us + 0.5) / 1e6
end


local function summary_of(h, sparse, max)
    local n = hist_total(h, sparse)
    if n == 0 then
        return { count = 0 }
    end
    return {
        count = n,
        p50 = r6(quantile(h, n, 0.5, max, sparse)),
        p99 = r6(quantile(h, n, 0.99, max, sparse)),
        max = r6(max),
    }
end


-- the public shape (seconds) of a live record or of a raw one
function _M.summary(rec)
    local c = rec.c or rec      -- a live record's per-run figures, or raw
    local sparse = type(c.rt) == "table"
    local rt, late, qw = c.rt, c.late, c.qw
    if sparse then
        local function numkeys(t)
            local o = {}
            for k, v in pairs(t) do
                o[tonumber(k)] = v
            end
            return o
        end
        rt, late, qw = numkeys(rt), numkeys(late), numkeys(qw)
    end
    local n = c.runs
    local run_time = { count = n }
    if n > 0 then
        run_time.min = r6(c.rt_min)
        run_time.avg = r6(c.rt_sum / n)
        run_time.max = r6(c.rt_max)
        run_time.p99 = r6(quantile(rt, hist_total(rt, sparse), 0.99,
                                   c.rt_max, sparse))
    end
    return {
        created = rec.created,
        pending = rec.pending,
        running = c.running,
        runs = n,
        errors = rec.errors,
        overruns = rec.overruns,
        skipped = rec.skipped,
        premature = rec.premature,
        run_time = run_time,
        lateness = summary_of(late, sparse, c.late_max),
        queue_wait = summary_of(qw, sparse, c.qw_max),
        last_error = rec.last_error,
        stack = rec.stack,
    }
end


return _M
