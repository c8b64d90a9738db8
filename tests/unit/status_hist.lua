-- resty.loom.status.hist.rebin: source buckets land at the status bounds
-- that hold them; an unbounded last bucket only in +Inf (count).

local hist = require "resty.loom.status.hist"

local LE = hist.LE
local huge = math.huge


-- source layout: the status bounds themselves plus [10 s, inf), as the
-- watchdog's C histogram has them
local function rebin(counts)
    local function upper(i)
        return LE[i] or huge
    end
    local function lower(i)
        return i == 1 and 0 or upper(i - 1)
    end
    return hist.rebin(function(i) return counts[i] end, 1, #LE + 1,
                      lower, upper, 0)
end


do
    -- one iteration over 10 s: above every finite bound
    local h = rebin({ [#LE + 1] = 1 })
    assert(h.count == 1, h.count)
    assert(h.buckets[#LE] == 0, "a value over 10 s counted at le=10: "
           .. h.buckets[#LE])
    print("ok unbounded last bucket is +Inf only")
end


do
    -- a bucket ending at a bound is counted at that bound, cumulatively
    local counts = {}
    for i = 1, #LE + 1 do
        counts[i] = 1
    end
    local h = rebin(counts)
    for i = 1, #LE do
        assert(h.buckets[i] == i, i .. ": " .. h.buckets[i])
    end
    assert(h.count == #LE + 1)
    print("ok same bounds are exact")
end


do
    -- estimated sums stay finite with an unbounded bucket: it counts at
    -- its lower end
    local h = hist.rebin(function(i) return i == 2 and 1 or 0 end, 1, 2,
                         function(i) return i == 1 and 0 or 20 end,
                         function(i) return i == 1 and 20 or huge end)
    assert(h.sum == 20 and h.count == 1 and h.buckets[#LE] == 0, h.sum)
    print("ok estimated sum of an unbounded bucket")
end
