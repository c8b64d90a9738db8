-- resty.loom.status's one histogram shape: cumulative counts at fixed upper
-- bounds in seconds, plus count and sum, as Prometheus wants them. Each
-- module keeps finer log-bucket histograms of its own; rebin() folds one
-- into this shape, each source bucket going to the bound above its middle.


local huge = math.huge

-- seconds; the watchdog's C histogram has exactly these bounds
local LE = { 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
             0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10 }
local NLE = #LE


local _M = { _VERSION = "0.2.0", LE = LE }


-- count(i) is source bucket i's count for i in first..last, bucket i
-- holding values in [lower(i), upper(i)) seconds; sum (seconds) when the
-- source keeps one, else estimated from the bucket middles
function _M.rebin(count, first, last, lower, upper, sum)
    local bins = {}
    for i = 1, NLE + 1 do
        bins[i] = 0
    end
    local n, est = 0, 0
    for i = first, last do
        local c = count(i)
        if c and c > 0 then
            local lo, hi = lower(i), upper(i)
            -- an unbounded bucket is above every bound (+Inf only); its
            -- values count at its lower end in the estimated sum
            local mid = hi == huge and huge or (lo + hi) / 2
            local j = 1
            while j <= NLE and LE[j] < mid do
                j = j + 1
            end
            bins[j] = bins[j] + c
            n = n + c
            est = est + c * (hi == huge and lo or mid)
        end
    end
    local buckets = {}
    local acc = 0
    for i = 1, NLE do
        acc = acc + bins[i]
        buckets[i] = acc
    end
    return { le = LE, buckets = buckets, count = n, sum = sum or est }
end


function _M.is(h)
    return type(h) == "table" and h.le ~= nil and h.buckets ~= nil
end


-- dst + src (dst nil: a copy of src)
function _M.add(dst, src)
    if not dst then
        dst = { le = LE, buckets = {}, count = 0, sum = 0 }
        for i = 1, NLE do
            dst.buckets[i] = 0
        end
    end
    for i = 1, NLE do
        dst.buckets[i] = dst.buckets[i] + (src.buckets[i] or 0)
    end
    dst.count = dst.count + src.count
    dst.sum = dst.sum + src.sum
    return dst
end


return _M
