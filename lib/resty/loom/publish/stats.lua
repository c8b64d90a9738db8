-- A publisher's figures: this worker's (p:stats()), and every worker's
-- merged per publisher name (publish.stats_all(), through the events bus's
-- "loom.publish" collector when there is one).


local histogram = require "resty.loom.histogram"

local ngx_log = ngx.log
local ngx_WARN = ngx.WARN
local ipairs = ipairs
local pairs = pairs
local pcall = pcall
local type = type

local LOG_TAG = "[loom.publish] "

local collector_registered = false


local _M = { _VERSION = "0.2.0" }


local function export(self)
    local lat = self.latency
    local buckets = {}
    local nb = 0
    for i = 0, 255 do
        local c = lat.buckets[i]
        if c > 0 then
            nb = nb + 1
            buckets[nb] = { i, tonumber(c) }
        end
    end
    local st = _M.worker(self)
    st.latency_buckets = buckets
    st.latency_sum = lat.sum
    st.latency_min = lat.min
    st.latency_max = lat.max
    return st
end


-- this worker's figures of publisher self
function _M.worker(self)
    local sp = self.spool
    return {
        name = self.name,
        topic = self.topic,
        buffered_messages = self.queued_messages + self.inflight_messages,
        buffered_bytes = self.queued_bytes + self.inflight_bytes,
        queued_messages = self.queued_messages,
        in_flight = self.inflight,
        in_flight_messages = self.inflight_messages,
        sent = self.sent,
        failed = self.failed,
        retried = self.retried,
        dropped = self.dropped,
        rejected = self.rejected,
        batches = self.batches,
        mean_batch_size = self.batches > 0
                          and self.batched_messages / self.batches or 0,
        http_requests = self.requests,
        connections = self.client.connects,
        latency = self.latency:summary(),
        token_refreshes = self.cred:refresh_count(),
        -- the spool (0 without one)
        spooled = sp and sp.spooled or 0,
        replayed = sp and sp.replayed or 0,
        spool_bytes = sp and sp.bytes or 0,
        spool_errors = (sp and sp.errors or 0) + self.spool_setup_errors,
    }
end


local SUM_FIELDS = {
    "buffered_messages", "buffered_bytes", "queued_messages", "in_flight",
    "in_flight_messages", "sent", "failed", "retried", "dropped",
    "rejected", "batches", "http_requests", "connections", "spooled",
    "replayed", "spool_bytes", "spool_errors",
}


-- merges exported per-worker figures of one publisher
local function merge(list)
    local total = {}
    for _, f in ipairs(SUM_FIELDS) do
        total[f] = 0
    end
    local hist = histogram.new()
    local batched = 0
    local refreshes = 0
    for _, st in ipairs(list) do
        total.name, total.topic = st.name, st.topic
        for _, f in ipairs(SUM_FIELDS) do
            total[f] = total[f] + (tonumber(st[f]) or 0)
        end
        batched = batched + (st.mean_batch_size or 0) * (st.batches or 0)
        refreshes = math.max(refreshes, st.token_refreshes or 0)
        for _, pair in ipairs(st.latency_buckets or {}) do
            hist.buckets[pair[1]] = hist.buckets[pair[1]] + pair[2]
            hist.count = hist.count + pair[2]
        end
        hist.sum = hist.sum + (st.latency_sum or 0)
        if st.latency_max and st.latency_max > hist.max then
            hist.max = st.latency_max
        end
        if st.latency_min and (not hist.min or st.latency_min < hist.min) then
            hist.min = st.latency_min
        end
    end
    total.mean_batch_size = total.batches > 0 and batched / total.batches
                            or 0
    total.latency = hist:summary()
    total.token_refreshes = refreshes
    return total
end


-- publishers: name -> publisher, this worker's
local function collect(publishers)
    local out = {}
    for name, p in pairs(publishers) do
        out[name] = export(p)
    end
    return out
end


-- per publisher name, the figures of all live workers merged (or of this
-- worker's publishers when no events bus exists), plus .workers (how many
-- answered)
function _M.all(publishers, timeout)
    local per_worker
    local ok, events = pcall(require, "resty.loom.events")
    local bus = ok and type(events) == "table" and events.get
                and events.get()
    if bus and collector_registered then
        local res, err = bus:collect("loom.publish", timeout or 1)
        if res then
            per_worker = res
        else
            ngx_log(ngx_WARN, LOG_TAG, "collect failed: ", err)
        end
    end
    if not per_worker then
        per_worker = { [ngx.worker.id() or 0] = collect(publishers) }
    end
    local by_name = {}
    local workers = 0
    for _, pubs in pairs(per_worker) do
        workers = workers + 1
        if type(pubs) ~= "table" then
            pubs = {}
        end
        for name, st in pairs(pubs) do
            local l = by_name[name]
            if not l then
                l = {}
                by_name[name] = l
            end
            l[#l + 1] = st
        end
    end
    local out = { workers = workers, publishers = {} }
    for name, l in pairs(by_name) do
        out.publishers[name] = merge(l)
    end
    return out
end


-- the events bus's "loom.publish" collector, once per worker: it exports
-- the figures of this worker's publishers
function _M.register_collector(publishers)
    if collector_registered then
        return
    end
    local ok, events = pcall(require, "resty.loom.events")
    if ok and type(events) == "table" and events.register_collector then
        local rok, err = pcall(events.register_collector, "loom.publish",
                               function() return collect(publishers) end)
        if rok then
            collector_registered = true
        else
            ngx_log(ngx_WARN, LOG_TAG, "no stats collector: ", err)
        end
    end
end


return _M
