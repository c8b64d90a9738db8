-- Harness loaded by bench/events/run.py inside nginx. It drives either
-- resty.loom.events ("loom") or lua-resty-worker-events ("worker-events",
-- from the checkout named by PEER_WORKER_EVENTS), counts what every worker
-- receives, publishes from a timer, and exposes its counters over HTTP
-- (/_bench/stats, /_bench/ctl). Counters go through a shared dict so that
-- any worker can answer.
--
-- Modes:
--   kong  every `interval` seconds publish `n` events to "all" from worker 0
--         (posters = "one") or from every worker (posters = "all") while
--         the harness flag "posting" is set. With lib = "floor" there is
--         no bus: every worker's timer does, per interval, only what any
--         in-process bus must do in a receiving worker (decode the events
--         "all" delivery gives it from pre-encoded bytes, one table each,
--         and call the handler): the floor of the scenario. With lib =
--         "floor-shm", the least an inter-worker bus must do: each poster
--         encodes its events and copies them into shared memory, every
--         worker decodes each poster's events from there (no socket, no
--         broker, no acknowledgement, no system call)
--   sat   raw bus: worker 0 measures the cost of one publish, then
--         publishes as fast as the bus lets it for `duration` seconds
--   lat   raw bus: worker 0 publishes at `rate` events/s for `duration`
--         seconds; the bus's own publish-to-handler histogram is reported

local ffi = require "ffi"
local buffer = require "string.buffer"
local cjson = require "cjson.safe"

local ngx = ngx
local ngx_sleep = ngx.sleep
local worker_id = ngx.worker.id
local exiting = ngx.worker.exiting
local timer_at = ngx.timer.at
local floor = math.floor
local str_rep = string.rep
local tonumber = tonumber

local SOURCE, EVENT = "bench", "ev"
local FLUSH_EVERY = 0.2

-- our own binding of clock_gettime (the bus declares the plain name)
ffi.cdef [[
typedef struct { long sec; long nsec; } bench_ev_ts_t;
int bench_ev_clock_gettime(int clk, bench_ev_ts_t *ts)
    __asm__("clock_gettime");
]]
local ts = ffi.new("bench_ev_ts_t")
local clock_gettime = ffi.C.bench_ev_clock_gettime

-- CLOCK_MONOTONIC is shared by all processes: the runner compares the
-- publisher's start with the subscribers' last delivery
local function mono()
    clock_gettime(1, ts)
    return tonumber(ts.sec) + tonumber(ts.nsec) * 1e-9
end


local _M = {}

local cfg
local bus           -- resty.loom.events bus
local publish       -- function(data) -> ok, err
local shm

-- per-worker counters (copied into the shared dict by flush())
local recv = 0
local last_recv_at = 0
local attempted, accepted = 0, 0
local errors = {}
local ticks, tick_sum, tick_max = 0, 0, 0
local busy = 0
local cost_us               -- µs per publish call (sat mode)
local started_at, ended_at  -- publisher window (sat / lat)
local keys = {}

-- Payloads differ only in a counter (the string-hash trap of OpenResty's
-- LuaJIT bites serialised events that are alike except for a counter).
local PAYLOADS = {
    ["100"] = {
        seq = 0, kind = "health", upstream = "upstream-0001",
        host = "10.0.0.1", port = 8080, status = "healthy",
        checked = "2026-11-22T06:00:00Z",
    },
    -- about 10 KiB: a counter and a config blob
    ["10k"] = {
        seq = 0, kind = "config",
        blob = str_rep("0123456789abcdef", 640),
    },
}
local payload


local function on_event()
    recv = recv + 1
    if cfg.stamp then
        last_recv_at = mono()
    end
end


local function flush(full)
    shm:set(keys.recv, recv)
    shm:set(keys.recv_at, last_recv_at)
    shm:set(keys.attempted, attempted)
    shm:set(keys.accepted, accepted)
    shm:set(keys.ticks, ticks)
    shm:set(keys.tick_sum, tick_sum)
    shm:set(keys.tick_max, tick_max)
    shm:set(keys.busy, busy)
    if cost_us then
        shm:set(keys.cost, cost_us)
    end
    if started_at then
        shm:set(keys.started, started_at)
    end
    if ended_at then
        shm:set(keys.ended, ended_at)
    end
    if full then
        shm:set(keys.errors, cjson.encode(errors))
        if bus then
            local st = bus:stats()
            shm:set(keys.ready, bus:is_ready() and 1 or 0)
            shm:set(keys.bus, cjson.encode({
                pid = st.pid,
                latency = st.latency,
                dropped = st.dropped,
                gaps = st.gaps,
                duplicates = st.duplicates,
                reconnects = st.reconnects,
                queue = st.queue,
                delivered = st.delivered,
                published = st.published,
                broker = st.broker,
            }))
        else
            shm:set(keys.ready, 1)
        end
    end
end


local function flusher(premature)
    local n = 0
    while not premature and not exiting() do
        n = n + 1
        flush(n % 2 == 1)
        ngx_sleep(FLUSH_EVERY)
    end
    flush(true)
end


local function publish_one(seq)
    payload.seq = seq
    local ok, err = publish(payload)
    attempted = attempted + 1
    if ok then
        accepted = accepted + 1
    else
        errors[err] = (errors[err] or 0) + 1
    end
end


-- runs tick() every interval while the "posting" flag is set, until the
-- worker exits; a tick that overruns its period is followed at once by
-- the next one. Each tick's time goes to the tick statistics.
local function every_tick(interval, tick)
    while not exiting() do
        if shm:get("posting") == 1 then
            local t0 = mono()
            busy = 1
            tick()
            local dt = mono() - t0
            ticks = ticks + 1
            tick_sum = tick_sum + dt
            if dt > tick_max then
                tick_max = dt
            end
            busy = 0
            flush(false)
            local left = t0 + interval - mono()
            ngx_sleep(left > 0.001 and left or 0.001)
        else
            ngx_sleep(0.02)
        end
    end
end


-- kong mode: n events every interval while the "posting" flag is set
local function kong_poster(premature)
    if premature then
        return
    end
    local n = cfg.n
    local seq = 0
    every_tick(cfg.interval, function()
        for i = 1, n do
            seq = seq + 1
            publish_one(seq)
            -- a tick stops early once the runner stopped posting
            if i % 1000 == 0 and shm:get("posting") ~= 1 then
                break
            end
        end
    end)
end


-- the floors' events: count of them appended to enc, each as the bus
-- encodes a body (source, event, data), the payload's seq from first on
local function encode_events(enc, first, count)
    for seq = first, first + count - 1 do
        payload.seq = seq
        enc:encode(SOURCE)
        enc:encode(EVENT)
        enc:encode(payload)
    end
end


-- decodes every event in dec and hands each to the handler
local function decode_events(dec)
    local decode = dec.decode
    while #dec > 0 do
        local source = decode(dec)
        local event = decode(dec)
        local data = decode(dec)
        if source == SOURCE and event == EVENT then
            on_event(data)
        end
    end
end


-- floor: the payloads of a tick, encoded once; each tick decodes them all
-- again
local floor_raw, floor_len


local function floor_encode(count)
    local enc = buffer.new()
    encode_events(enc, 1, count)
    floor_raw = enc
    floor_len = #enc
end


-- floor mode: per interval, decode the events this worker would receive
-- (n per poster) and hand each to the handler; no yield inside a tick
local function floor_ticker(premature)
    if premature then
        return
    end
    local dec = buffer.new()
    local n = cfg.n
    local per_tick = n * (cfg.posters == "all" and ngx.worker.count() or 1)
    local own = (cfg.posters == "all" or worker_id() == 0) and n or 0
    floor_encode(per_tick)
    every_tick(cfg.interval, function()
        dec:set(floor_raw:ref(), floor_len)
        decode_events(dec)
        -- what the bus's posters would have published this tick
        attempted = attempted + own
        accepted = accepted + own
    end)
end


-- floor-shm: a region mapped before the fork (init_by_lua), shared by
-- every worker: per poster a header (a generation counter and the length
-- of each of two slots) and two slots of encoded events. A poster's tick
-- encodes its events into a local buffer, copies them into the slot the
-- next generation names and then publishes that generation; readers poll
-- every millisecond and decode a generation's slot whole. Two slots: a
-- reader has a whole interval to decode one before it is written again.
ffi.cdef [[
typedef struct {
    volatile int32_t gen;
    volatile int32_t len[2];
} bench_ev_ring_t;
void *bench_ev_mmap(void *addr, size_t len, int prot, int flags, int fd,
                    long off) __asm__("mmap");
]]
local RING_PTR = ffi.typeof("bench_ev_ring_t *")
local U8_PTR = ffi.typeof("uint8_t *")
local HEADER = 64               -- bytes per poster's header (a cache line)
local SLOT_PER_EVENT = 192      -- room per event in a slot (~125 B used)
local MAX_WORKERS = 16
local shm_base, shm_slot        -- the region, a slot's size


local function shm_map(n)
    shm_slot = n * SLOT_PER_EVENT
    local size = MAX_WORKERS * (HEADER + 2 * shm_slot)
    -- PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS
    local p = ffi.C.bench_ev_mmap(nil, size, 3, 0x21, -1, 0)
    assert(ffi.cast("intptr_t", p) ~= -1, "mmap failed")
    shm_base = ffi.cast(U8_PTR, p)
end


local function shm_ring(w)
    local at = shm_base + w * (HEADER + 2 * shm_slot)
    return ffi.cast(RING_PTR, at), at + HEADER
end


-- floor-shm poster: per interval, n events encoded and published
local function shm_poster(premature)
    if premature then
        return
    end
    local n = cfg.n
    local ring, slots = shm_ring(worker_id())
    local enc = buffer.new(n * SLOT_PER_EVENT)
    local seq = 0
    every_tick(cfg.interval, function()
        enc:reset()
        encode_events(enc, seq + 1, n)
        seq = seq + n
        local gen = ring.gen + 1
        local slot = gen % 2
        local p, len = enc:ref()
        assert(len <= shm_slot, "floor-shm: slot too small")
        ffi.copy(slots + slot * shm_slot, p, len)
        ring.len[slot] = len
        ring.gen = gen
        attempted = attempted + n
        accepted = accepted + n
    end)
end


-- floor-shm reader: every worker decodes every poster's new generation
local function shm_reader(premature)
    if premature then
        return
    end
    local dec = buffer.new()
    local count = ngx.worker.count()
    local rings, slots, seen = {}, {}, {}
    for w = 0, count - 1 do
        rings[w], slots[w] = shm_ring(w)
        seen[w] = rings[w].gen
    end
    while not exiting() do
        for w = 0, count - 1 do
            local ring = rings[w]
            local gen = ring.gen
            if gen ~= seen[w] then
                seen[w] = gen
                local slot = gen % 2
                dec:set(slots[w] + slot * shm_slot, ring.len[slot])
                decode_events(dec)
            end
        end
        ngx_sleep(0.001)
    end
end


local function wait_flag()
    while shm:get("go") ~= 1 do
        if exiting() then
            return false
        end
        ngx_sleep(0.01)
    end
    return true
end


-- sat mode: the cost of one publish (batches of 50, each in a millisecond
-- of its own: fewer than the bus's publishes in one go before it yields,
-- so the time is the calls' alone), then as fast as the bus accepts for
-- cfg.duration seconds
local function sat_poster(premature)
    if premature or not wait_flag() then
        return
    end
    local seq = 0
    local batch, best = 50, nil
    for _ = 1, 100 do
        local t0 = mono()
        for _ = 1, batch do
            seq = seq + 1
            publish_one(seq)
        end
        local us = (mono() - t0) * 1e6 / batch
        if not best or us < best then
            best = us
        end
        ngx_sleep(0.002)
    end
    cost_us = best
    -- let the cost-phase events reach everyone before the clock starts
    while recv < accepted and not exiting() do
        ngx_sleep(0.01)
    end
    ngx_sleep(0.2)
    shm:set("sat_base", accepted)
    started_at = mono()
    local stop = started_at + cfg.duration
    busy = 1
    while not exiting() do
        for _ = 1, 64 do
            seq = seq + 1
            publish_one(seq)
        end
        if mono() >= stop then
            break
        end
    end
    ended_at = mono()
    busy = 0
    flush(true)
end


-- lat mode: cfg.rate events/s, topped up every millisecond
local function lat_poster(premature)
    if premature or not wait_flag() then
        return
    end
    local rate = cfg.rate
    local seq = 0
    started_at = mono()
    local stop = started_at + cfg.duration
    busy = 1
    while not exiting() do
        local now = mono()
        if now >= stop then
            break
        end
        local due = floor((now - started_at) * rate)
        while seq < due do
            seq = seq + 1
            publish_one(seq)
        end
        ngx_sleep(0.001)
    end
    ended_at = mono()
    busy = 0
    flush(true)
end


function _M.init(c)
    cfg = c
    shm = ngx.shared.bench_events
    payload = PAYLOADS[cfg.payload or "100"]
    if cfg.lib == "floor-shm" then
        shm_map(cfg.n)
    end
    if cfg.lib == "loom" then
        local events = require "resty.loom.events"
        bus = events.new({
            socket = cfg.socket,
            overflow = "wait",
            wait_timeout = cfg.wait_timeout or 5,
            broker = cfg.broker,
        })
    end
    -- lua-resty-worker-events is required in init_worker: loaded in the
    -- master, its configure() would reset the handlers (see the docs)
end


function _M.init_worker()
    local w = worker_id()
    for _, k in ipairs({ "recv", "recv_at", "attempted", "accepted",
                         "ticks", "tick_sum", "tick_max", "busy", "cost",
                         "started", "ended", "errors", "ready", "bus" }) do
        keys[k] = k .. ":" .. w
    end

    if cfg.lib == "loom" then
        bus:subscribe(SOURCE, EVENT, on_event)
        local ok, err = bus:init_worker()
        if not ok then
            ngx.log(ngx.ERR, "bench: bus init_worker failed: ", err)
            return
        end
        publish = function(data)
            return bus:publish("all", SOURCE, EVENT, data)
        end
    elseif cfg.lib ~= "floor" and cfg.lib ~= "floor-shm" then
        local we = require "resty.worker.events"
        -- Kong 2.8's production settings
        local ok, err = we.configure({
            shm = "process_events",
            timeout = 5,
            interval = 1,
            wait_interval = 0.010,
            wait_max = 0.5,
        })
        if not ok then
            ngx.log(ngx.ERR, "bench: worker-events configure failed: ", err)
            return
        end
        we.register(on_event, SOURCE, EVENT)
        local post = we.post
        publish = function(data)
            return post(SOURCE, EVENT, data)
        end
    end

    assert(timer_at(0, flusher))

    local mode = cfg.mode
    if mode == "kong" and cfg.lib == "floor" then
        if cfg.n > 0 then
            assert(timer_at(0, floor_ticker))
        end
    elseif mode == "kong" and cfg.lib == "floor-shm" then
        if cfg.n > 0 then
            assert(timer_at(0, shm_reader))
            if cfg.posters == "all" or w == (cfg.poster or 0) then
                assert(timer_at(0, shm_poster))
            end
        end
    elseif mode == "kong" then
        if cfg.n > 0 and (cfg.posters == "all" or w == (cfg.poster or 0))
        then
            assert(timer_at(0, kong_poster))
        end
    elseif w == 0 then
        assert(timer_at(0, mode == "sat" and sat_poster or lat_poster))
    end
end


function _M.stats()
    local out = { workers = {}, posting = shm:get("posting"),
                  sat_base = shm:get("sat_base") }
    for w = 0, ngx.worker.count() - 1 do
        local function get(k)
            return shm:get(k .. ":" .. w)
        end
        local ws = {
            recv = get("recv"), recv_at = get("recv_at"),
            attempted = get("attempted"), accepted = get("accepted"),
            ticks = get("ticks"), tick_sum = get("tick_sum"),
            tick_max = get("tick_max"), busy = get("busy"),
            cost_us = get("cost"), started = get("started"),
            ended = get("ended"), ready = get("ready"),
            errors = cjson.decode(get("errors") or "{}"),
            bus = cjson.decode(get("bus") or "null"),
        }
        out.workers[tostring(w)] = ws
    end
    ngx.header.content_type = "application/json"
    ngx.say(cjson.encode(out))
end


function _M.ctl()
    local args = ngx.req.get_uri_args()
    for _, k in ipairs({ "posting", "go" }) do
        if args[k] then
            shm:set(k, tonumber(args[k]))
        end
    end
    ngx.say("ok")
end


return _M
