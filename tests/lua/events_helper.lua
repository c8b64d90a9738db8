-- Test helper for the events bus: records what each worker receives and
-- exposes publish / inspect endpoints through one content handler.

local cjson = require "cjson.safe"
local events = require "resty.loom.events"

local _M = {}

local received = {}     -- "publisher:source:event" -> count
local last_n = {}       -- publisher -> last n seen (ordering check)
local order_errors = 0
local total = 0
local sizes = {}
local requests = {}     -- request id -> "running" or its JSON answer
local gap_calls = {}    -- publisher -> missing events reported to on_gap
local trace = {}        -- data.n of source "trace", in the order handled


function _M.init(opts)
    opts = opts or {}
    opts.socket = opts.socket or (ngx.config.prefix() .. "sock/bus.sock")
    return events.new(opts)
end


local function state()
    local bus = events.get()
    return {
        worker = ngx.worker.id(),
        pid = ngx.worker.pid(),
        received = received,
        total = total,
        order_errors = order_errors,
        sizes = sizes,
        gap_calls = gap_calls,
        trace = trace,
        ready = bus:is_ready(),
        stats = bus:stats(),
    }
end


function _M.init_worker()
    local bus = events.get()
    events.register_collector("events_helper", state)
    local ok, err = bus:init_worker()
    if not ok then
        ngx.log(ngx.ERR, "events init_worker failed: ", err)
        return
    end
    bus:on_gap(function(publisher, missing)
        local k = tostring(publisher)
        gap_calls[k] = (gap_calls[k] or 0) + missing
    end)
    bus:subscribe("*", "*", function(data, event, source, wid)
        total = total + 1
        local k = tostring(wid) .. ":" .. source .. ":" .. event
        received[k] = (received[k] or 0) + 1
        if source == "trace" then
            trace[#trace + 1] = data.n
            return
        end
        if type(data) == "table" and data.n then
            -- a respawned worker is a new publisher: key by pid if known
            local key = tostring(data.pid or wid) .. ":" .. source
            local prev = last_n[key]
            if prev and data.n ~= prev + 1 then
                order_errors = order_errors + 1
            end
            last_n[key] = data.n
        end
        if type(data) == "table" and data.blob then
            sizes[#sizes + 1] = #data.blob
        end
    end)
end


-- waits (up to 5 s) until the broker has acknowledged all we published
local function wait_acked(bus)
    for _ = 1, 500 do
        local q = bus:stats().queue
        if q.unsent == 0 and q.unacked == 0 then
            return
        end
        ngx.sleep(0.01)
    end
end


-- a unique key starting with prefix that lands on this worker (the bus
-- sends unique:<key> to worker crc32(key) % worker_count)
local function own_key(bus, prefix)
    local count = bus.worker_count
    for j = 0, 100 * count do
        local key = prefix .. "-" .. j
        if ngx.crc32_short(key) % count == ngx.worker.id() then
            return key
        end
    end
    error("no unique key lands on worker " .. ngx.worker.id())
end


local function args()
    return ngx.req.get_uri_args()
end


-- answers with the shared dict `name` as a JSON object (tests keep there
-- what must outlive a worker)
function _M.dump_dict(name)
    local d = ngx.shared[name]
    local out = {}
    for _, k in ipairs(d:get_keys(0)) do
        out[k] = d:get(k)
    end
    ngx.say(cjson.encode(out))
end


function _M.handle()
    local bus = events.get()
    local a = args()
    local what = ngx.var.uri:match("/ev/(%w+)")
    if what == "pub" then
        if a.only and tonumber(a.only) ~= ngx.worker.id() then
            -- the test wants this published from another worker
            ngx.status = 409
            ngx.say("worker ", ngx.worker.id())
            return
        end
        -- a request id makes a retried publish answer with the first
        -- one's result instead of publishing again (a client that timed
        -- out retries a request that may have succeeded late)
        local rid = a.rid
        if rid and requests[rid] then
            while requests[rid] == "running" do
                ngx.sleep(0.05)
            end
            ngx.say(requests[rid])
            return
        end
        if rid then
            requests[rid] = "running"
        end
        local n = tonumber(a.n or 1)
        local target = a.target or "all"
        if tonumber(target) then
            target = tonumber(target)
        end
        local source = a.source or "test"
        local pad = a.size and string.rep("x", tonumber(a.size)) or nil
        local start = tonumber(a.start or 1)
        local okc, errs = 0, {}
        if a.settle then
            -- nothing of ours in flight (e.g. the answers to the test's
            -- own collect() calls), so the queue bound is all ours
            wait_acked(bus)
        end
        if a.warm then
            -- one event first, delivered before the rest is published
            assert(bus:publish(target, source, a.event or "e",
                               { n = start - 1 }))
            -- until the broker has acknowledged it
            wait_acked(bus)
        end
        local key
        for i = start, start + n - 1 do
            local data = { n = i, blob = pad }
            local to = target
            if to == "mixrare" then
                -- "all", and every 50th to worker 0: a plain event now and
                -- then among runs
                to = i % 50 == 0 and 0 or "all"
            elseif to == "mixself" then
                -- "all", then this worker by id, and so on
                to = i % 2 == 1 and "all" or ngx.worker.id()
            elseif to == "mixunique" then
                -- "all", a unique key that lands on this worker, the same
                -- key again (suppressed), this worker by id, and so on
                local r = i % 4
                if r == 2 then
                    key = own_key(bus, source .. i)
                end
                to = r == 1 and "all" or r == 0 and ngx.worker.id()
                     or "unique:" .. key
            end
            local ok, err = bus:publish(to, source, a.event or "e", data)
            if ok then
                okc = okc + 1
            else
                errs[err] = (errs[err] or 0) + 1
            end
        end
        local res = cjson.encode({ ok = okc, errors = errs,
                                   worker = ngx.worker.id() })
        if rid then
            requests[rid] = res
        end
        ngx.say(res)
    elseif what == "state" then
        ngx.say(cjson.encode(state()))
    elseif what == "collect" then
        local res, err = bus:collect(a.name or "events_helper",
                                     tonumber(a.timeout) or 2)
        if not res then
            ngx.status = 500
            ngx.say(err)
            return
        end
        ngx.say(cjson.encode(res))
    elseif what == "reset" then
        received, last_n, order_errors, total, sizes = {}, {}, 0, 0, {}
        ngx.say("ok")
    else
        ngx.status = 404
    end
end


return _M
