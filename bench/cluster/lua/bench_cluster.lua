-- bench-cluster node: publishes at a rate (resty.loom.cluster, or a
-- Kong-like table in Redis that one worker per node polls), and records
-- the publish-to-handler latency of what it receives in shm buckets.

local ffi = require "ffi"
local events = require "resty.loom.events"
local cluster = require "resty.loom.cluster"
local redis = require("resty.loom.cluster.redis").driver
local cjson = require "cjson.safe"

ffi.cdef [[
    typedef struct { long tv_sec; long tv_usec; } loom_bench_tv;
    int gettimeofday(loom_bench_tv *tv, void *tz);
]]
local tv = ffi.new("loom_bench_tv")
local floor = math.floor
local min = math.min

local _M = {}
local POLL_KEY = "bench:cluster_events"
local LOOK_BACK = 1000      -- ms


local function now_us()
    ffi.C.gettimeofday(tv, nil)
    return tonumber(tv.tv_sec) * 1e6 + tonumber(tv.tv_usec)
end


-- 0.1 ms buckets below 20 ms, 1 ms below 1 s, 10 ms above
local function bucket(us)
    local ms = us / 1000
    if ms < 20 then
        return floor(ms * 10) / 10
    elseif ms < 1000 then
        return floor(ms)
    end
    return floor(ms / 10) * 10
end


local function record(data)
    local d = ngx.shared.bench
    d:incr(_M.mode .. ":" .. bucket(now_us() - data.t), 1, 0)
    d:incr("n:" .. _M.mode, 1, 0)
end


function _M.init(opts, poll, mode)
    _M.mode = mode
    events.new({ socket = ngx.config.prefix() .. "sock/bus.sock" })
    _M.c = cluster.new(opts)
    _M.poll = poll
    _M.port = opts.redis.port
end


local function connect()
    local red = redis:new()
    red:set_timeout(5000)
    assert(red:connect("127.0.0.1", _M.port))
    return red
end


-- the baseline: every `interval` s one worker per node reads the rows
-- newer than the last it saw (by score, Redis time in ms, as Kong keeps
-- the DB's `at`) and broadcasts them to the node's workers over the bus
local function poller(premature, interval)
    if premature then
        return
    end
    local red = connect()
    local last = 0
    while not ngx.worker.exiting() do
        ngx.sleep(interval)
        local t = red:time()
        local now = tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)
        -- Kong looks back (db_update_propagation, the clock offset) and
        -- marks the rows it ran in a shared dict, so a row written with
        -- a time just behind the last poll is not skipped
        local rows = red:zrangebyscore(POLL_KEY, "(" .. (last - LOOK_BACK),
                                       now)
        last = now
        if type(rows) == "table" then
            local d, fresh = ngx.shared.bench, {}
            for i = 1, #rows do
                if d:add("ran:" .. rows[i], true, 30) then
                    fresh[#fresh + 1] = rows[i]
                end
            end
            rows = fresh
        end
        -- pages of 1,000 rows, as Kong reads them
        if type(rows) == "table" then
            for i = 1, #rows, 1000 do
                events.get():publish("all", "bench", "rows",
                                     { unpack(rows, i, min(i + 999, #rows)) })
            end
        end
    end
    red:close()
end


function _M.init_worker()
    local bus = events.get()
    assert(bus:init_worker())
    assert(_M.c:init_worker())
    bus:subscribe("bench", "ev", record)
    bus:subscribe("bench", "rows", function(rows)
        for i = 1, #rows do
            record({ t = tonumber(rows[i]:match("|(%d+)$")) })
        end
    end)
    if _M.poll and ngx.worker.id() == 0 then
        ngx.timer.at(0, poller, _M.poll)
    end
end


-- publishes `rate` events/s for `secs` s in ticks of 10 ms
local function publisher(premature, mode, rate, secs)
    if premature then
        return
    end
    local per_tick = rate / 100
    local red = mode == "poll" and connect()
    local start = now_us()
    local sent, failed = 0, 0
    local n = 0
    while now_us() - start < secs * 1e6 do
        local due = floor((now_us() - start) / 1e6 * rate) + per_tick
        if red then
            red:init_pipeline()
        end
        while n < due do
            n = n + 1
            local t = floor(now_us())
            if red then
                -- Kong: an INSERT per event; expired rows cleaned below
                local ms = floor(t / 1000)
                red:zadd(POLL_KEY, ms, string.format("%d|%d", n, t))
            else
                local ok = _M.c:publish("cluster", "bench", "ev",
                                        { t = t, n = n })
                if ok then
                    sent = sent + 1
                else
                    failed = failed + 1
                end
            end
        end
        if red then
            local res = red:commit_pipeline()
            if res then
                sent = n
            end
            red:zremrangebyscore(POLL_KEY, "-inf",
                                 floor(now_us() / 1000) - 60000)
        end
        ngx.sleep(0.01)
    end
    local d = ngx.shared.bench
    d:set("sent", sent)
    d:set("failed", failed)
    d:set("done", true)
    if red then
        red:close()
    end
end


function _M.handle()
    local args = ngx.req.get_uri_args()
    local what = ngx.var.uri:match("/b/(%w+)")
    local d = ngx.shared.bench
    if what == "pub" then
        d:set("done", false)
        assert(ngx.timer.at(0, publisher, args.mode, tonumber(args.rate),
                            tonumber(args.secs)))
        ngx.say("started")

    elseif what == "lat" then
        -- the histogram of one mode, then cleared
        local out = {}
        for _, k in ipairs(d:get_keys(0)) do
            local mode, b = k:match("^(%w+):([%d.]+)$")
            if mode == args.mode then
                out[b] = d:get(k)
                d:delete(k)
            end
        end
        local n = d:get("n:" .. args.mode) or 0
        d:delete("n:" .. args.mode)
        ngx.say(cjson.encode({ buckets = out, n = n, done = d:get("done"),
                               sent = d:get("sent"),
                               failed = d:get("failed") }))

    elseif what == "stats" then
        ngx.say(cjson.encode(_M.c:stats()))

    elseif what == "hello" then
        ngx.say("hello")
    end
end


return _M
