-- Latency histogram with logarithmic buckets: O(1) record, no allocation,
-- percentiles accurate to one bucket (about 9%). Shared by resty.loom
-- modules that report percentiles.


local ffi = require "ffi"

local ffi_new = ffi.new
local floor = math.floor
local log = math.log

-- bucket i holds values in [MIN * GROWTH^i, MIN * GROWTH^(i+1))
local MIN = 1e-6           -- 1 microsecond (values are seconds)
local GROWTH = 1.09
local NBUCKETS = 256       -- up to MIN * 1.09^256, about 3.8e3 s
local LOG_GROWTH = log(GROWTH)


-- the layout, for readers of raw buckets (resty.loom.status)
local _M = { _VERSION = "0.2.0", MIN = MIN, GROWTH = GROWTH,
             NBUCKETS = NBUCKETS }
local mt = { __index = _M }


function _M.new()
    local self = {
        buckets = ffi_new("uint32_t[?]", NBUCKETS),
        count = 0,
        sum = 0,
        max = 0,
        min = nil,
    }
    return setmetatable(self, mt)
end


function _M.record(self, v)
    local i = 0
    if v > MIN then
        i = floor(log(v / MIN) / LOG_GROWTH)
        if i >= NBUCKETS then
            i = NBUCKETS - 1
        end
    end
    self.buckets[i] = self.buckets[i] + 1
    self.count = self.count + 1
    self.sum = self.sum + v
    if v > self.max then
        self.max = v
    end
    if not self.min or v < self.min then
        self.min = v
    end
end


-- the upper bound of the bucket that holds the q-th quantile (0 < q <= 1),
-- capped by the largest value seen
function _M.quantile(self, q)
    if self.count == 0 then
        return nil
    end
    local rank = q * self.count
    local seen = 0
    for i = 0, NBUCKETS - 1 do
        seen = seen + self.buckets[i]
        if seen >= rank then
            local upper = MIN * GROWTH ^ (i + 1)
            return upper < self.max and upper or self.max
        end
    end
    return self.max
end


-- a plain table for JSON: count, min, mean, max, p50, p90, p99 (seconds)
function _M.summary(self)
    if self.count == 0 then
        return { count = 0 }
    end
    return {
        count = self.count,
        min = self.min,
        mean = self.sum / self.count,
        max = self.max,
        p50 = self:quantile(0.5),
        p90 = self:quantile(0.9),
        p99 = self:quantile(0.99),
    }
end


function _M.reset(self)
    ffi.fill(self.buckets, NBUCKETS * 4)
    self.count = 0
    self.sum = 0
    self.max = 0
    self.min = nil
end


return _M
