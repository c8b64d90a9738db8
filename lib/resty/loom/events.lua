-- resty.loom.events: an inter-worker event bus. One worker is the broker
-- on a `listen unix:` server; every other worker (and the privileged agent
-- when enabled) connects to it with a cosocket, the broker worker's client
-- without one; each publishes and receives events. See docs/events.md.


local ffi = require "ffi"
local buffer = require "string.buffer"
local semaphore = require "ngx.semaphore"
local frame = require "resty.loom.events.frame"
local fifo = require "resty.loom.events.fifo"
local ring = require "resty.loom.events.ring"
local broker = require "resty.loom.events.broker"
local histogram = require "resty.loom.histogram"
local at_close = require "resty.loom.at_close"
local yield = require("resty.loom.yield").yield
local on_error = require("resty.loom.error_handler").handler
local get_request = require("resty.core.base").get_request

local unique_target = broker.unique_target

local C = ffi.C
local frame_seq = frame.seq
local ngx = ngx
local ngx_log = ngx.log
local ngx_now = ngx.now
local ngx_sleep = ngx.sleep
local get_phase = ngx.get_phase
local timer_at = ngx.timer.at
local spawn = ngx.thread.spawn
local kill = ngx.thread.kill
local worker_exiting = ngx.worker.exiting
local buf_new = buffer.new
local type = type
local error = error
local pairs = pairs
local ipairs = ipairs
local xpcall = xpcall
local tostring = tostring
local tonumber = tonumber
local setmetatable = setmetatable
local getinfo = debug.getinfo
local str_sub = string.sub
local str_byte = string.byte
local random = math.random
local min = math.min
local max = math.max
local huge = math.huge
local co_running = coroutine.running

local ALERT = ngx.ALERT
local ERR = ngx.ERR
local WARN = ngx.WARN

local T_WELCOME = frame.WELCOME
local T_EVENT = frame.EVENT
local T_ACK = frame.ACK
local T_PING = frame.PING
local T_PONG = frame.PONG
local T_REJECT = frame.REJECT
local T_HELLO = frame.HELLO
local T_BYE = frame.BYE
local T_URGENT = frame.URGENT
local T_OWN_RUN = frame.OWN_RUN
local T_OWN_SKIP = frame.OWN_SKIP
local FRAME_SIZE = frame.FRAME_SIZE
local EVENT_SIZE = frame.EVENT_SIZE
local ALL = frame.ALL
local OTHERS = frame.OTHERS
local UNIQUE = frame.UNIQUE
local AGENT = frame.AGENT
local LOCAL = -100                  -- "current": never leaves the worker

local INTERNAL = "loom.bus"         -- source of the bus's own events
local READ_SIZE = frame.READ_SIZE
local YIELD_BYTES = frame.YIELD_BYTES
local WRITE_MAX = frame.WRITE_MAX
local EXACT_MIN = frame.EXACT_MIN
local CHUNK = frame.CHUNK
local SLICE = 256                   -- events handled between yields
-- the broker keeps the events it wrote to a worker until the worker
-- confirms them: every ACK_EVERY events, else ACK_DELAY s after the last
local ACK_EVERY = 256
local ACK_DELAY = 0.01
local CONNECT_TIMEOUT = 2
local SEND_TIMEOUT = 30
local LOG_INTERVAL = 10
-- an exiting worker's bus stays up until this long after its last publish
-- (its requests and timers may go on publishing for a while)
local EXIT_QUIET = 0.5
local MAX_PAYLOAD_LIMIT = 64 * 1024 * 1024
-- default bound of the events waiting for one subscriber, in its inbox and
-- again at the broker: what a stalled handler leaves stale before drops
local BACKLOG = 10000
-- beyond these, an option is a mistake
local MAX_EVENTS = 100000000
local MAX_BYTES = 2 ^ 40
local MAX_SECONDS = 86400
local UNIQUE_KEY_MAX = frame.KEY_MAX
-- queue bytes the largest event takes beyond its body: event header, the
-- longest unique key, each frame's header and trailer (256 frames at most)
local EVENT_ROOM = 8192
-- publishes in one go before a yield ("wait"), so that the writer, the
-- broker and the handlers carry the first events of a burst on while the
-- rest are published (publish-to-handler p99 at half the raw bus's rate:
-- 1.5-3.9 ms with 1,000, 0.09 ms with 64)
local BURST = 64
local HANDLER_SHARE = 2     -- handlers may fill 1/2 of the publisher queue
local STAMP_EVERY = 8       -- latency sampling, see publish()
local WAIT_PHASES = {
    rewrite = true, access = true, content = true, timer = true,
    ssl_cert = true, ssl_session_fetch = true,
}

local DEFAULTS = {
    broker = 0,
    max_queue = 100000,
    max_queue_bytes = 64 * 1024 * 1024,
    max_backlog = false,        -- min(max_queue, BACKLOG)
    max_payload = 1024 * 1024,
    overflow = "reject",
    wait_timeout = 1,
    privileged_agent = false,
    unique_window = 5,
    heartbeat = 1,
    slow_timeout = false,       -- 2 * heartbeat
    exit_timeout = 3,
}

local OVERFLOW = { reject = true, drop_oldest = true, wait = true }
local WEAK_VALUES = { __mode = "v" }


ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } loom_timespec_t;
int clock_gettime(int clk, loom_timespec_t *ts);
long long ngx_loom_ffi_generation(void);
int ngx_loom_ffi_pin_listener(const unsigned char *path, size_t len,
    int owner, int *matched, char **err);
int ngx_loom_ffi_prepare_socket(const unsigned char *path, size_t len,
    char **err);
long getrandom(void *buf, size_t len, unsigned int flags);
int ngx_loom_ffi_connection_log_level(void *r, int level);
]]

local CLOCK_MONOTONIC = 1
local ts = ffi.new("loom_timespec_t")
local errmsg = ffi.new("char *[1]")
local matched = ffi.new("int[1]")

-- a random non-zero number naming this process as a publisher: pids are
-- reused, so subscribers key their bookkeeping by this instead
local function incarnation()
    local v = ffi.new("uint32_t[1]")
    while v[0] == 0 do
        if C.getrandom(v, 4, 0) ~= 4 then
            v[0] = (ngx.worker.pid() * 2654435761 + ngx_now() * 1000)
                   % 4294967296
        end
    end
    return tonumber(v[0])
end


local function mono()
    C.clock_gettime(CLOCK_MONOTONIC, ts)
    return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end


local function log(level, ...)
    ngx_log(level, "[loom.events] ", ...)
end


local function count(t, key, n)
    t[key] = (t[key] or 0) + (n or 1)
end


local _M = { _VERSION = "0.2.0" }
local mt = { __index = _M }

local default_bus
local collectors = {}
-- every bus of this process that init_worker() started, for exit_worker()
local living = setmetatable({}, { __mode = "k" })


local function check_opts(opts)
    if type(opts) ~= "table" then
        error("opts must be a table", 3)
    end
    local o = {}
    for k, v in pairs(DEFAULTS) do
        o[k] = v
    end
    for k, v in pairs(opts) do
        if DEFAULTS[k] == nil and k ~= "socket" then
            error("opts." .. tostring(k) .. " is not a known option", 3)
        end
        o[k] = v
    end

    local path = o.socket
    if type(path) ~= "string" then
        error("opts.socket must be a string (the path of the bus's "
              .. "UNIX socket)", 3)
    end
    if str_sub(path, 1, 5) == "unix:" then
        path = str_sub(path, 6)
    end
    if str_byte(path, 1) ~= 47 or #path >= 108 then
        error("opts.socket must be an absolute path shorter than 108 "
              .. "bytes", 3)
    end
    o.socket = path

    local function int(name, lo, hi)
        local v = o[name]
        if type(v) ~= "number" or v % 1 ~= 0 or v < lo or (hi and v > hi) then
            error("opts." .. name .. " must be an integer >= " .. lo
                  .. (hi and (" and <= " .. hi) or ""), 4)
        end
    end
    -- (seconds: nginx's timers count whole milliseconds; NaN compares
    -- false with everything, so it fails "lo <= v")
    local function seconds(name, lo)
        local v = o[name]
        if type(v) ~= "number" or not (lo <= v and v <= MAX_SECONDS) then
            error("opts." .. name .. " must be a number >= " .. lo
                  .. " and <= " .. MAX_SECONDS .. " (seconds)", 4)
        end
    end

    if not o.slow_timeout then
        o.slow_timeout = 2 * (tonumber(o.heartbeat) or 1)
    end
    int("broker", 0)
    int("max_queue", 1, MAX_EVENTS)
    if not o.max_backlog then
        o.max_backlog = min(o.max_queue, BACKLOG)
    end
    int("max_backlog", 1, MAX_EVENTS)
    int("max_queue_bytes", 1024, MAX_BYTES)
    int("max_payload", 1, MAX_PAYLOAD_LIMIT)
    seconds("wait_timeout", 0.001)
    seconds("unique_window", 0.001)
    seconds("heartbeat", 0.01)
    seconds("slow_timeout", 0.001)
    seconds("exit_timeout", 0.001)
    if not OVERFLOW[o.overflow] then
        error('opts.overflow must be "reject", "drop_oldest" or "wait"', 3)
    end
    if type(o.privileged_agent) ~= "boolean" then
        error("opts.privileged_agent must be a boolean", 3)
    end
    if o.slow_timeout >= 3 * o.heartbeat then
        -- a broker waiting that long would miss its peers' heartbeats
        error("opts.slow_timeout must be less than 3 * opts.heartbeat", 3)
    end
    if o.max_queue_bytes < o.max_payload + EVENT_ROOM then
        error("opts.max_queue_bytes must be at least opts.max_payload + "
              .. EVENT_ROOM .. " (the largest event with its headers)", 3)
    end
    return o
end


-- Creates the bus. Call it in init_by_lua: it prepares the socket's
-- directory (mode 0700) before nginx binds the socket.
function _M.new(opts)
    local o = check_opts(opts)

    local phase = get_phase()
    if phase == "init" then
        local p = o.socket
        if C.ngx_loom_ffi_prepare_socket(p, #p, errmsg) ~= 0 then
            error("opts.socket: " .. ffi.string(errmsg[0]), 2)
        end
    end

    local self = {
        opts = o,
        ready = false,
        connected = false,
        initialized = false,
        worker = nil,
        pid = nil,
        incarnation = nil,
        worker_count = 0,
        generation = nil,
        broker_state = nil,

        -- publishing
        seq = 0,
        all_seq = 0,
        others_seq = 0,
        direct_seq = {},
        unsent = buf_new(65536),
        urgent = buf_new(256),      -- urgent events (collect) to send
        local_link = nil,           -- the broker worker's link to it
        spare = buf_new(65536),     -- the broker worker's second unsent
        unsent_q = fifo.new(),      -- (seq, bytes) per unsent event
        unacked = buf_new(65536),
        unacked_q = fifo.new(),     -- (seq, bytes) per sent event
        pending = 0,                -- events unsent + unacked
        pending_bytes = 0,
        wsema = semaphore.new(),    -- data to send
        writer_idle = false,        -- the writer waits on wsema
        space = semaphore.new(),    -- room in the queue (its waiters:
                                    -- -count(), right if one is killed)
        burst = 0,                  -- publishes since burst_at (ngx.now())
        burst_at = 0,
        stamp_ms = 0,               -- ngx.now() of the last latency sample
        last_publish = 0,           -- ngx.now() of the last publish
        stopping = false,           -- exiting: the bus has closed
        exit_counted = false,       -- exit_watch counted what was pending
        left_counted = false,       -- the worker stops: the rest counted

        -- receiving
        inbox = ring.new(),         -- events for the handlers
        -- our handlers' copies of our own events ("all", to our own
        -- worker id, unique ones that land on us), in publish order,
        -- until the writer takes the events they follow: (key, source,
        -- event, data, published_at, unique), key being the event's seq,
        -- or S + 0.5 for an event to ourselves published after event S
        own = ring.new(),
        -- the copies taken from own behind a unique event of ours whose
        -- fate the broker has not told yet (it may be suppressed): that
        -- one first, (seq, ...), then the others, (false, ...)
        held = ring.new(),
        isema = semaphore.new(),
        handler_idle = false,       -- the handler loop waits on isema
        -- [1]: the coroutine running handlers (the handler loop, or a
        -- request in poll()), one at a time; .waiting: it waits for room
        -- to publish. Weak, so that a request killed in a handler that
        -- yielded holds nothing up once it is collected.
        dispatch = setmetatable({ waiting = false }, WEAK_VALUES),
        rspace = semaphore.new(),
        rwaiters = 0,
        -- per publisher incarnation: last seq seen, last stream seqs
        last_seq = {},
        last_all = {},
        last_others = {},
        last_direct = {},

        -- subscriptions
        subs = {},                  -- id -> { source, event, fn, site }
        sub_list = {},              -- live subscriptions, in id order
        next_sub = 0,
        gap_hooks = {},

        counters = {
            published = {},         -- target kind -> count
            delivered = 0,          -- events handed to handlers
            handler_calls = 0,
            handler_errors = 0,
            dropped = {},           -- reason -> count
            gaps = 0,
            duplicates = 0,
            feedback = 0,           -- handlers publishing what they handle
            reconnects = 0,
            rejected = 0,
        },
        latency = histogram.new(),
        last_warn = {},
    }
    setmetatable(self, mt)
    default_bus = self
    return self
end


-- The bus created last in this process (nil when none).
function _M.get()
    return default_bus
end


local function warn_once(self, what, ...)
    local now = ngx_now()
    if now - (self.last_warn[what] or 0) >= LOG_INTERVAL then
        self.last_warn[what] = now
        log(WARN, ...)
    end
end


-- inbox ------------------------------------------------------------------

local function inbox_len(self)
    return self.inbox:len()
end


local function inbox_push(self, source, event, data, wid, latency, pid)
    self.inbox:push(source, event, data, wid, latency, pid)
    if self.handler_idle then
        self.handler_idle = false
        self.isema:post(1)
    end
end


-- counts events of a publisher that never reached this worker, and tells
-- the gap hooks
local function report_gap(self, publisher, pid, missing)
    self.counters.gaps = self.counters.gaps + missing
    warn_once(self, "gap", "gap: ", missing, " event(s) from worker ",
              publisher, " (pid ", pid, ") missing; ", self.counters.gaps,
              " so far")
    for _, hook in ipairs(self.gap_hooks) do
        local ok, err = xpcall(hook, on_error, publisher, missing)
        if not ok then
            log(ERR, "gap hook failed: ", err)
        end
    end
end


-- a copy of our own event for our handlers: behind a unique event of
-- ours that waits for the broker's word, if any
local function hand_own(self, source, event, data, at)
    local held = self.held
    if held.n > 0 then
        held:push(false, source, event, data, at)
    else
        inbox_push(self, source, event, data, self.worker, at, self.pid)
    end
end


-- The broker's word on our unique event seq that lands on us: our
-- handlers run it or not, then the copies held behind it, up to the
-- next such event. (A word for no event held: the second answer to an
-- event re-sent after a reconnect.)
local function own_unique(self, seq, run)
    local held = self.held
    if held.n == 0 or held:peek() ~= seq then
        return
    end
    local _, source, event, data, at = held:pop()
    if run then
        inbox_push(self, source, event, data, self.worker, at, self.pid)
    end
    while held.n > 0 and not held:peek() do
        _, source, event, data, at = held:pop()
        inbox_push(self, source, event, data, self.worker, at, self.pid)
    end
end


-- The writer took events first..last for the broker, which sends "all"
-- events to the other workers only: our handlers get our copies now, in
-- publish order; a unique event of ours that lands on us waits for the
-- broker's word, and what follows it waits behind it. With everything
-- (nothing left unsent, or nothing ever to be taken: first > last),
-- every copy goes. A copy whose event was never taken was dropped by
-- drop_oldest: our handlers miss it like the others do. poll: copies of
-- events not taken yet go too, up to the first unique one.
local function release_own(self, first, last, everything, poll)
    local own = self.own
    local dropped = 0
    while own.n > 0 do
        local key, source, event, data, at, unique = own:first()
        if (not everything and key >= last + 1) or (poll and unique) then
            break
        end
        own:pop()
        if key % 1 ~= 0 or (key >= first and key <= last) then
            if unique then
                self.held:push(key, source, event, data, at)
            else
                hand_own(self, source, event, data, at)
            end
        elseif not unique then
            dropped = dropped + 1
        end
    end
    if dropped > 0 then
        report_gap(self, self.worker, self.pid, dropped)
    end
end


-- the bus closed at exit: no word on our unique events will come (they
-- were not acknowledged: counted in dropped.exit); what they held runs
local function release_held(self)
    local held = self.held
    while held.n > 0 do
        own_unique(self, held:peek(), false)
    end
end


-- dispatch ---------------------------------------------------------------

local function run_handler(self, sub, data, event, source, wid, pid)
    self.counters.handler_calls = self.counters.handler_calls + 1
    local ok, err = xpcall(sub.fn, on_error, data, event, source, wid, pid)
    if not ok then
        self.counters.handler_errors = self.counters.handler_errors + 1
        log(ERR, "handler for source=", source, " event=", event,
            " (subscribed at ", sub.site, ") failed: ", err)
    end
end


local send_urgent

local function handle_internal(self, event, data, wid)
    if event == "collect" then
        local fn = collectors[data.name]
        local ok, value
        if fn then
            ok, value = xpcall(fn, on_error)
            if not ok then
                log(ERR, "collector ", data.name, " failed: ", value)
                value = nil
            end
        end
        local err
        ok, err = pcall(send_urgent, self, wid, "collected",
                        { id = data.id, worker = self.worker,
                          value = value })
        if not ok then
            log(ERR, "failed to answer collect(\"", data.name, "\"): ",
                err)
        end

    elseif event == "collected" then
        local pend = self.collecting and self.collecting[data.id]
        if pend then
            pend.results[tostring(data.worker)] = data.value or ngx.null
            pend.n = pend.n + 1
            pend.sema:post(1)
        end
    end
end


-- collect's requests and answers are urgent events (see frame.lua): sent
-- ahead of what is queued and handled on arrival, so that a bus full of
-- events (a feedback loop, a slow handler) still answers. An answer too
-- large for one frame takes the ordinary way. To this worker (or "all"):
-- handled here as well. Raises when data cannot be serialised.
function send_urgent(self, target, event, data)
    local size = frame.encode_body(INTERNAL, event, data)
    if size + EVENT_SIZE > CHUNK then
        local ok, err = self:publish(target == ALL and "all"
                                     or target == AGENT and "agent"
                                     or target, INTERNAL, event, data)
        if not ok then
            log(ERR, "failed to send ", event, ": ", err)
        end
        return
    end
    local link = self.local_link
    if target ~= self.worker and link then
        -- the broker worker: straight to the broker (its writer may be
        -- waiting there for room, with a batch of events)
        local out = buf_new(256)
        frame.put_urgent(out, target, self.worker, self.pid,
                         self.incarnation)
        local ok, err = broker.take_local(self, link, out)
        if not ok then
            log(ERR, "failed to hand an urgent event to the broker: ", err)
        end
    elseif target ~= self.worker then
        frame.put_urgent(self.urgent, target, self.worker, self.pid,
                         self.incarnation)
        local lane = self.lane
        if lane then
            lane.sema:post(1)
        elseif self.writer_idle then
            self.writer_idle = false
            self.wsema:post(1)
        end
    end
    if target == ALL or target == self.worker then
        handle_internal(self, event, data, self.worker)
    end
end


local function receive_urgent(self, p, len)
    local e, why = frame.check_event(p, len)
    if not e then
        return nil, why
    end
    local ok, source, event, data = pcall(frame.decode_body, p + EVENT_SIZE,
                                          e.body_len)
    if not ok or source ~= INTERNAL or type(data) ~= "table" then
        return nil, "bad urgent event"
    end
    handle_internal(self, event, data, e.publisher)
    return true
end


local function dispatch(self, source, event, data, wid, pid)
    if source == INTERNAL then
        return handle_internal(self, event, data, wid)
    end
    self.counters.delivered = self.counters.delivered + 1
    -- registration order, across wildcard and exact subscriptions
    local list = self.sub_list
    for i = 1, #list do
        local sub = list[i]
        if not sub.removed
           and (sub.source == "*" or sub.source == source)
           and (sub.event == "*" or sub.event == event) then
            run_handler(self, sub, data, event, source, wid, pid)
        end
    end
end


-- runs the handlers of the next event in the inbox in coroutine me (the
-- caller's: coroutine.running() would stitch the trace); false when empty
local function dispatch_next(self, me)
    local source, event, data, wid, latency, pid = self.inbox:pop()
    if not source then
        return false
    end
    if latency and latency > 0 then
        self.latency:record(mono() - latency)
    end
    if self.rwaiters > 0 then
        self.rspace:post(1)
    end
    local d = self.dispatch
    d[1], d.waiting = me, false
    d.source, d.event = source, event
    dispatch(self, source, event, data, wid, pid)
    d[1] = nil
    return true
end


local function handler_loop(premature, self)
    if premature then
        return
    end
    local run = 0
    local me = co_running()
    while true do
        if self.dispatch[1] then
            -- poll() runs handlers in a request: one event at a time, so
            -- wait (whoever pushes next wakes us)
            self.handler_idle = true
            self.isema:wait(1)
            self.handler_idle = false
        elseif dispatch_next(self, me) then
            run = run + 1
            if run >= SLICE then
                -- let requests in between long runs of handlers
                run = 0
                yield()
            end
        else
            -- (only once the bus closed: until then events keep coming,
            -- "current" ones even while the broker cannot be reached)
            if self.stopping and not self.connected then
                return
            end
            run = 0
            self.handler_idle = true
            self.isema:wait(1)
            self.handler_idle = false
        end
    end
end


-- receiving --------------------------------------------------------------

-- bookkeeping of one publisher's sequence numbers: drops duplicates (a
-- re-send after a broker restart) and counts gaps
local function accept_seq(self, e, seq)
    local pid = e.pid
    local inc = e.incarnation
    local last = self.last_seq[inc]
    if last and seq <= last then
        self.counters.duplicates = self.counters.duplicates + 1
        return false
    end
    self.last_seq[inc] = seq

    local target = e.target
    local stream = e.stream_seq
    if stream > 0 then
        local book = target == ALL and self.last_all
                     or target == OTHERS and self.last_others
                     or self.last_direct
        local prev = book[inc]
        book[inc] = stream
        if prev and stream > prev + 1 then
            report_gap(self, e.publisher, pid, stream - prev - 1)
        end
    end
    return true
end


local function receive_event(self, seq, p, len)
    local e, why = frame.check_event(p, len)
    if not e then
        return nil, why
    end
    local off = EVENT_SIZE + e.key_len
    if not accept_seq(self, e, seq) then
        return true
    end
    local ok, source, event, data = pcall(frame.decode_body, p + off,
                                          e.body_len)
    if not ok then
        return nil, "undecodable event"
    end
    inbox_push(self, source, event, data, e.publisher, e.published_at, e.pid)
    return true
end


-- n events left the queue: as many publishers waiting for room may go on
-- (the semaphore counts its waiters, also when one is killed)
local function wake_publishers(self, n)
    local waiting = -self.space:count()
    if waiting > 0 then
        self.space:post(min(n, waiting))
    end
end


local function on_ack(self, seq)
    local q = self.unacked_q
    local freed = 0
    while true do
        local s, bytes = q:peek()
        if not s or s > seq then
            break
        end
        q:pop()
        self.unacked:skip(bytes)
        self.pending = self.pending - 1
        self.pending_bytes = self.pending_bytes - bytes
        freed = freed + 1
    end
    if freed > 0 then
        wake_publishers(self, freed)
    end
end


-- Handles the whole frames at the front of rbuf (st collects a chunked
-- event across calls). Returns the bytes still missing of the next frame
-- (0: unknown), or nil and what was wrong.
local function consume(self, rbuf, st)
    local max_payload = self.opts.max_payload
    while true do
        local h, pp, size = frame.peek(rbuf, CHUNK)
        if h == nil then
            return pp
        end
        if h == false then
            return nil, pp
        end
        local typ = h.type
        local ok, err
        if typ == T_EVENT then
            local seq = frame_seq(h)
            local p, len = frame.collect(st, seq, h, pp, max_payload)
            if p == false then
                return nil, len
            end
            ok = true
            if p then
                ok, err = receive_event(self, seq, p, len)
                st.partial = nil
                st.got = st.got + 1
            end
            if not ok then
                return nil, err
            end

        elseif typ == T_ACK then
            on_ack(self, frame_seq(h))

        elseif typ == T_OWN_RUN or typ == T_OWN_SKIP then
            own_unique(self, frame_seq(h), typ == T_OWN_RUN)

        elseif typ == T_URGENT then
            ok, err = receive_urgent(self, pp, h.len)
            if not ok then
                return nil, err
            end

        elseif typ == T_REJECT then
            local _, reason = pcall(frame.decode_control, pp, h.len)
            return nil, "rejected by the broker: " .. tostring(reason)

        elseif typ ~= T_PONG then
            -- (a pong needs nothing: arriving resets the read timeout,
            -- which is the heartbeat)
            return nil, "unexpected frame type " .. tostring(typ)
        end
        rbuf:skip(size)
    end
end


-- back-pressure: no more events while the handlers are behind, unless a
-- handler waits for room to publish (see make_room)
local function wait_inbox_room(self, link)
    local d = self.dispatch
    while inbox_len(self) >= self.opts.max_backlog and not link.closed
          and not (d.waiting and d[1]) do
        self.rwaiters = self.rwaiters + 1
        self.rspace:wait(1)
        self.rwaiters = self.rwaiters - 1
    end
end


local function reader(self, sock, link)
    local rbuf = buf_new(READ_SIZE)
    local need = 0
    local since_yield = 0
    -- (the chunk being collected, and the events received: link.got)
    local st = link
    -- the broker answers our pings: silence this long means it is gone;
    -- a send may wait longer while the broker is busy with a slow worker
    sock:settimeouts(CONNECT_TIMEOUT * 1000, SEND_TIMEOUT * 1000,
                     self.opts.heartbeat * 3000)

    while true do
        wait_inbox_room(self, link)

        -- the rest of a frame, or what is there: see frame.lua for why
        local data, err
        if need > EXACT_MIN then
            data, err = sock:receive(need)
        else
            data, err = sock:receiveany(READ_SIZE)
        end
        if link.error then
            return nil, link.error
        end
        if not data then
            return nil, err == "timeout" and "broker heartbeat timeout"
                        or err
        end
        rbuf:put(data)
        need, err = consume(self, rbuf, st)
        if not need then
            return nil, err
        end
        if link.got > link.acked then
            -- the broker holds these until we confirm them: the writer
            -- does within ACK_DELAY, or at once for a long run
            if not link.since then
                link.since = ngx_now()
            end
            if self.writer_idle
               and (not link.short or link.got - link.acked >= ACK_EVERY) then
                self.writer_idle = false
                self.wsema:post(1)
            end
        end
        since_yield = since_yield + #data
        if since_yield >= YIELD_BYTES then
            -- a long run of reads: let requests in
            since_yield = 0
            yield()
        end
    end
end


-- sending ----------------------------------------------------------------

-- a header-only control frame
local function control(typ, seq)
    local out = buf_new(64)
    frame.put_empty(out, typ, seq or 0)
    return out:get()
end


-- sends on the connection; a failure is kept on the link for the reader
local function send(sock, link, data)
    local ok, err = sock:send(data)
    if not ok then
        link.error = "failed to send: " .. err
    end
    return ok
end


local function writer(self, sock, link)
    local last_send = ngx_now()
    local hb = self.opts.heartbeat
    while true do
        if #self.unsent == 0 and (#self.urgent == 0 or self.lane) then
            if self.stopping then
                -- what we received goes confirmed: the broker counts
                -- the rest as dropped for us
                if not send(sock, link, control(T_ACK, link.got)
                                        .. control(T_BYE)) then
                    return nil, link.error
                end
                return true
            end
            self.writer_idle = true
            -- events received and not confirmed yet: soon, in one frame
            -- for all that come meanwhile
            link.short = link.got > link.acked
            self.wsema:wait(link.short and ACK_DELAY or hb / 2)
            self.writer_idle = false
        end
        if link.closed then
            return true
        end
        if #self.urgent > 0 and not self.lane then
            -- (without a lane: behind the write under way)
            if not send(sock, link, self.urgent:get()) then
                return nil, link.error
            end
            last_send = ngx_now()
        end
        local got = link.got
        if got > link.acked
           and (#self.unsent == 0 or got - link.acked >= ACK_EVERY
                or ngx_now() - (link.since or 0) >= ACK_DELAY) then
            -- the broker keeps what it wrote to us until we confirm it:
            -- when we have nothing else to send, after a long run, or
            -- ACK_DELAY after the first unconfirmed event (not with every
            -- write: a send each costs both sides)
            if not send(sock, link, control(T_ACK, got)) then
                return nil, link.error
            end
            link.acked = got
            link.since = got < link.got and ngx_now() or nil
            last_send = ngx_now()
        end
        if #self.unsent > 0 then
            -- whole events, up to WRITE_MAX bytes per write; they stay in
            -- unacked until the broker acknowledges them
            local uq, aq = self.unsent_q, self.unacked_q
            local take = 0
            local first, last = uq:peek(), 0
            while true do
                local s, b = uq:peek()
                if not s or (take > 0 and take + b > WRITE_MAX) then
                    break
                end
                uq:pop()
                aq:push(s, b)
                take = take + b
                last = s
            end
            local data = self.unsent:get(take)
            self.unacked:put(data)
            if self.own.n > 0 then
                -- (a call with a loop in it would keep this loop from
                -- being compiled, so only when there is something)
                release_own(self, first, last, uq:len() == 0)
            end
            if not send(sock, link, data) then
                return nil, link.error
            end
            last_send = ngx_now()
        elseif ngx_now() - last_send >= hb / 2 then
            if not send(sock, link, control(T_PING)) then
                return nil, link.error
            end
            last_send = ngx_now()
        end
    end
end


-- The broker worker's writer: hands all that is queued to the broker in
-- this process. Nothing waits for acknowledgement: what the broker holds
-- dies with this process, and so does its publisher.
local function local_writer(self, link)
    while true do
        if #self.unsent == 0 then
            if self.stopping or link.closed then
                return true
            end
            self.writer_idle = true
            self.wsema:wait(1)
            self.writer_idle = false
        end
        if #self.unsent > 0 then
            local uq = self.unsent_q
            local first, n = uq:peek(), uq:len()
            local bytes = #self.unsent
            uq:clear()
            -- publishes go on into the spare buffer while the broker takes
            -- this one (it may wait for a slow worker)
            local batch = self.unsent
            self.unsent, self.spare = self.spare, batch
            if self.own.n > 0 then
                release_own(self, first, self.seq, true)
            end
            local ok, err = broker.take_local(self, link.conn, batch)
            batch:reset()
            if not ok then
                -- frames we made ourselves: a bug, not a peer's fault
                log(ERR, "failed to hand events to the broker: ", err)
            end
            self.pending = self.pending - n
            self.pending_bytes = self.pending_bytes - bytes
            wake_publishers(self, n)
        end
    end
end


-- The broker worker talks to the broker without a socket.
local function run_local(self)
    local link = { closed = false }
    local st = { got = 0 }
    link.conn = broker.attach_local(self, function(batch)
        wait_inbox_room(self, link)
        local need, err = consume(self, batch, st)
        if not need then
            return nil, err
        end
        return true
    end, function(p, len)
        local ok, err = receive_urgent(self, p, len)
        if not ok then
            log(ERR, "failed to handle an urgent event: ", err)
        end
    end, function(seq, run)
        own_unique(self, seq, run)
    end)
    self.local_link = link.conn
    self.connected = true
    self.ready = true
    local_writer(self, link)
    self.local_link = nil
    link.closed = true
    self.rspace:post(1)
    broker.detach_local(self, link.conn)
    self.connected = false
end


-- after a reconnect, whatever the broker had not acknowledged goes again,
-- ahead of what was never sent
local function requeue_unacked(self)
    if #self.unacked == 0 then
        return
    end
    local rest = self.unsent:get()
    local merged = fifo.new()
    self.unacked_q:move_to(merged)
    self.unsent_q:move_to(merged)
    self.unsent_q = merged
    self.unsent:put(self.unacked:get())
    self.unsent:put(rest)
    self.unacked:reset()
end


local function talk(self, sock, lane)
    local ok, err = sock:connect("unix:" .. self.opts.socket)
    if not ok then
        return nil, "failed to connect: " .. err
    end
    ok, err = sock:send("GET /loom/events HTTP/1.1\r\nHost: loom\r\n"
                        .. "Upgrade: loom-events/1\r\n"
                        .. "Connection: Upgrade\r\n\r\n")
    if not ok then
        return nil, "failed to send the upgrade: " .. err
    end
    local line
    line, err = sock:receive("*l")
    if not line then
        return nil, "failed to read the upgrade response: " .. err
    end
    if str_sub(line, 1, 12) ~= "HTTP/1.1 101" then
        return nil, "broker refused the upgrade: " .. line
    end
    repeat
        line, err = sock:receive("*l")
        if not line then
            return nil, "failed to read the upgrade response: " .. err
        end
    until line == ""

    local out = buf_new(256)
    frame.put_control(out, T_HELLO, 0, {
        version = frame.VERSION,
        worker = self.worker,
        pid = self.pid,
        generation = self.generation,
        lane = lane,
    })
    ok, err = sock:send(out:get())
    if not ok then
        return nil, "failed to send the hello: " .. err
    end

    local hdr
    hdr, err = sock:receive(FRAME_SIZE)
    if not hdr then
        return nil, "no welcome: " .. err
    end
    local rbuf = buf_new()
    rbuf:put(hdr)
    local h = ffi.cast("loom_ev_frame_t *", (rbuf:ref()))
    local len = h.len
    local typ = h.type
    if h.version ~= frame.VERSION or len > 4096 then
        return nil, "bad welcome"
    end
    local rest
    rest, err = sock:receive(len + frame.TRAILER_SIZE)
    if not rest then
        return nil, "no welcome: " .. err
    end
    local body = str_sub(rest, 1, len)
    if typ == T_REJECT then
        local _, reason = pcall(buffer.decode, body)
        return nil, "rejected by the broker: " .. tostring(reason), reason
    end
    if typ ~= T_WELCOME then
        return nil, "bad welcome"
    end
    return true
end


-- Connects sock to the broker and says hello. A quit makes nginx log
-- what it does to a connection on its way: its master removes the socket
-- file as soon as it has told the workers to quit (a connect() to it then
-- is logged at [crit], ENOENT, whenever the client last saw the file),
-- and the kernel resets the connections still queued when the broker
-- closes its listener (a read then logs [error]). A worker starting (or
-- reconnecting) meanwhile finds no broker, which is no error: nginx's
-- own lines about the connection are held back until the broker welcomed
-- it (the caller's timer runs nothing else meanwhile, and its connection
-- has a log of its own), and the caller says what a failure means.
local function handshake(self, sock, lane)
    local r = get_request()
    local level = r and C.ngx_loom_ffi_connection_log_level(r, ALERT)
                  or -1
    local ok, a, b, c = pcall(talk, self, sock, lane)
    if level >= 0 then
        C.ngx_loom_ffi_connection_log_level(r, level)
    end
    if not ok then
        error(a, 0)
    end
    return a, b, c
end


-- The lane: a second connection to the broker for urgent events only
-- (collect and its answers), which neither side ever stops reading, so
-- that they do not wait behind this worker's events in either direction
-- while a queue is full (see broker.lua). It lives as long as the
-- connection; without it urgent events take the connection.
local function lane_reader(self, sock, lane)
    local rbuf = buf_new(READ_SIZE)
    local st = { got = 0 }
    sock:settimeouts(CONNECT_TIMEOUT * 1000, SEND_TIMEOUT * 1000,
                     self.opts.heartbeat * 3000)
    while not lane.closed do
        local data, err = sock:receiveany(READ_SIZE)
        if not data then
            lane.error = err
            break
        end
        rbuf:put(data)
        -- (the broker sends only urgent events and pongs here)
        local need
        need, err = consume(self, rbuf, st)
        if not need or st.got > 0 then
            lane.error = err or "events on the lane"
            break
        end
    end
    lane.closed = true
    lane.sema:post(1)
end


local function run_lane(self, lane)
    local sock = ngx.socket.tcp()
    sock:settimeout(CONNECT_TIMEOUT * 1000)
    local ok, err = handshake(self, sock, true)
    if not ok then
        sock:close()
        if not lane.closed then
            warn_once(self, "lane", "failed to open the lane (collect "
                      .. "goes with the events): ", err)
        end
        return
    end
    local rt = spawn(lane_reader, self, sock, lane)
    self.lane = lane
    local hb = self.opts.heartbeat
    local last_send = ngx_now()
    while not lane.closed do
        if #self.urgent == 0 then
            lane.sema:wait(hb / 2)
        end
        if lane.closed then
            break
        end
        local data
        if #self.urgent > 0 then
            data = self.urgent:get()
        elseif ngx_now() - last_send >= hb / 2 then
            -- the broker times a silent lane out like a connection
            data = control(T_PING)
        end
        if data then
            ok, err = sock:send(data)
            if not ok then
                lane.error = err
                break
            end
            last_send = ngx_now()
        end
    end
    self.lane = nil
    lane.closed = true
    kill(rt)
    sock:close()
    if lane.error and not self.stopping then
        warn_once(self, "lane", "lost the lane (collect goes with the "
                  .. "events): ", lane.error)
    end
    -- what is left goes with the events
    self.wsema:post(1)
end


-- The lane runs in a timer of its own, so that its handshake holds back
-- nginx's lines about its own connection only (see handshake).
local function lane_timer(premature, self, lane)
    if not premature then
        local ok, err = pcall(run_lane, self, lane)
        if not ok then
            log(ERR, "the lane failed: ", err)
        end
    end
    lane.ended = true
    lane.done:post(1)
end


local function client_loop(premature, self)
    if premature then
        return
    end
    if self.worker == self.opts.broker then
        run_local(self)
        self.isema:post(1)
        return
    end
    local backoff = 0.01
    local first = true
    while not self.stopping do
        local sock = ngx.socket.tcp()
        sock:settimeout(2000)
        local ok, err, reason = handshake(self, sock)
        if ok then
            if not first then
                self.counters.reconnects = self.counters.reconnects + 1
            end
            first = false
            self.connected = true
            self.ready = true
            backoff = 0.01
            requeue_unacked(self)
            local link = { closed = false, error = nil, got = 0, acked = 0 }
            local wt = spawn(writer, self, sock, link)
            local lane = { closed = false, sema = semaphore.new(),
                           ended = false, done = semaphore.new() }
            local lane_started = timer_at(0, lane_timer, self, lane)
            local rok, rerr = reader(self, sock, link)
            link.closed = true
            self.wsema:post(1)
            lane.closed = true
            lane.sema:post(1)
            while lane_started and not lane.ended do
                lane.done:wait(1)
            end
            -- a writer stuck in a send to a dead broker is stopped here;
            -- what it was sending is still in unacked and goes again
            kill(wt)
            local wok, werr = not link.error, link.error
            self.connected = false
            sock:close()
            if self.stopping then
                break
            end
            if not rok or not wok then
                log(WARN, "lost the broker: ", rerr or werr,
                    "; reconnecting")
            end
        else
            sock:close()
            if reason then
                self.counters.rejected = self.counters.rejected + 1
            end
            if reason == "other generation" then
                -- an old worker during a reload: the old broker is gone
                if worker_exiting() then
                    break
                end
            elseif not worker_exiting() then
                warn_once(self, "connect", "cannot reach the broker: ", err)
            end
            if worker_exiting() and self.pending == 0 then
                break
            end
        end
        if self.stopping then
            break
        end
        ngx_sleep(backoff * (0.5 + random()))
        backoff = min(backoff * 2, 1)
    end
    -- (only at exit: publishes from now on would never leave)
    self.stopping = true
    self.connected = false
    release_held(self)
    self.isema:post(1)
end


-- At worker exit the bus stays up while the worker uses it: until
-- EXIT_QUIET s after its last publish, everything sent and acknowledged,
-- every handler run, and (on the broker worker) every other worker gone.
-- Then it says goodbye and publish() returns "closed". Waiting on
-- something that makes no progress (an unreachable broker, a handler
-- stuck) ends exit_timeout s after the last publish; what is left then is
-- counted and logged.
local function exit_watch(premature, self)
    if not premature then
        return
    end
    local timeout = self.opts.exit_timeout
    local is_broker = self.worker == self.opts.broker
    local since = ngx_now()     -- the worker's last use of the bus
    while true do
        ngx.update_time()
        local now = ngx_now()
        local peers = is_broker and broker.peers(self) > 0
        if peers or self.last_publish > since then
            since = peers and now or self.last_publish
        end
        if now - since >= EXIT_QUIET and self.pending == 0
           and inbox_len(self) == 0 then
            break
        end
        if now - since >= timeout and now - since >= EXIT_QUIET then
            break
        end
        self.wsema:post(1)
        ngx_sleep(0.01)
    end
    self.stopping = true
    self.exit_counted = true
    if self.pending > 0 then
        count(self.counters.dropped, "exit", self.pending)
        log(WARN, "worker exiting with ", self.pending,
            " event(s) not acknowledged by the broker")
    end
    release_held(self)
    self.wsema:post(1)
    self.isema:post(1)
end


-- The worker stops (its Lua VM closes next): counts, once, what the bus
-- will never deliver. Returns the events published and not sent, sent
-- and not acknowledged by the broker (both unless exit_watch counted them
-- already: the rest of a graceful exit), received (or published to this
-- worker) and not handled, and held by the broker in this worker for
-- others that no publisher counts (see broker.count_left).
local function count_left(self)
    if self.left_counted then
        return 0, 0, 0, 0
    end
    self.left_counted = true
    self.stopping = true
    local unsent, unacked = 0, 0
    if not self.exit_counted then
        unsent = self.unsent_q:len()
        if self.worker == self.opts.broker then
            -- what the broker has not taken yet of the batch it is
            -- taking (the rest is in its queues)
            unacked = frame.count_events(self.spare:ref())
        else
            unacked = self.pending - unsent
        end
    end
    local unhandled = inbox_len(self)
    local own = self.own
    while own.n > 0 do
        -- (copies of events to this worker published behind unsent
        -- ones: the other copies are of events counted as not sent)
        if own:pop() % 1 ~= 0 then
            unhandled = unhandled + 1
        end
    end
    local dropped = self.counters.dropped
    if unsent + unacked > 0 then
        count(dropped, "exit", unsent + unacked)
    end
    if unhandled > 0 then
        count(dropped, "not handled", unhandled)
    end
    return unsent, unacked, unhandled, broker.count_left(self)
end


-- at VM close (see resty.loom.at_close): what no exit_worker() reported
local function unreported_at_close()
    local unsent, unacked, unhandled, held = 0, 0, 0, 0
    for bus in pairs(living) do
        local u, a, h, b = count_left(bus)
        unsent, unacked = unsent + u, unacked + a
        unhandled, held = unhandled + h, held + b
    end
    local lost = unsent + unacked + unhandled + held
    if lost > 0 then
        return "warn", "[loom.events] " .. lost .. " event(s) lost at "
               .. "worker exit without a report (" .. unsent .. " not sent, "
               .. unacked .. " not acknowledged, " .. unhandled
               .. " not handled, " .. held .. " held by the broker): call "
               .. "require(\"resty.loom.events\").exit_worker() in "
               .. "exit_worker_by_lua_block"
    end
end


-- Connects this worker to the bus. Call it in init_worker_by_lua.
function _M.init_worker(self)
    if self.initialized then
        return true
    end
    local opts = self.opts
    local wid = ngx.worker.id()
    local ptype = require("ngx.process").type()
    if ptype == "privileged agent" then
        if not opts.privileged_agent then
            return nil, "privileged agent not enabled (opts.privileged_agent)"
        end
        wid = AGENT
    elseif wid == nil then
        return nil, "failed to init: not a worker process"
    end
    self.worker = wid
    self.pid = ngx.worker.pid()
    self.incarnation = incarnation()
    self.worker_count = ngx.worker.count()
    self.generation = tonumber(C.ngx_loom_ffi_generation())

    if wid ~= AGENT then
        local p = opts.socket
        local rc = C.ngx_loom_ffi_pin_listener(p, #p, opts.broker, matched,
                                              errmsg)
        if rc ~= 0 then
            return nil, "failed to pin the listener: "
                        .. ffi.string(errmsg[0])
        end
        if matched[0] == 0 then
            return nil, "failed to init: no `listen unix:" .. p
                        .. ";` server for the bus"
        end
        if opts.broker >= self.worker_count then
            return nil, "failed to init: opts.broker (" .. opts.broker
                        .. ") >= worker_processes"
        end
    end

    local ok, err = timer_at(0, client_loop, self)
    if not ok then
        return nil, "failed to start the client: " .. err
    end
    ok, err = timer_at(0, handler_loop, self)
    if not ok then
        return nil, "failed to start the handlers: " .. err
    end
    -- a timer far in the future fires early (premature) at worker exit
    ok, err = timer_at(365 * 86400, exit_watch, self)
    if not ok then
        return nil, "failed to start the exit watch: " .. err
    end
    self.initialized = true
    living[self] = true
    at_close.register(unreported_at_close)
    -- (the check reads this bus's buffers: see at_close.renew)
    at_close.renew()
    return true
end


-- events.exit_worker(), in exit_worker_by_lua*: a fast stop (SIGTERM,
-- SIGINT, nginx -s stop) runs no timer and no cosocket, so this is the
-- only code of the bus that runs then. Counts and logs what each bus of
-- the worker will never deliver; after a graceful exit, what it could not
-- (a stuck handler). Nothing once everything was delivered.
function _M.exit_worker()
    for bus in pairs(living) do
        local unsent, unacked, unhandled, held = count_left(bus)
        local lost = unsent + unacked + unhandled + held
        if lost > 0 then
            log(WARN, "worker stopping: ", lost, " event(s) lost: ", unsent,
                " published and not sent, ", unacked, " sent and not "
                .. "acknowledged by the broker (some may have reached "
                .. "their workers), ", unhandled, " received and not "
                .. "handled, ", held, " held by the broker for other "
                .. "workers (some may have reached them)")
        end
    end
    return true
end


-- Serves one worker connection: content_by_lua on the bus's unix server.
function _M.serve(self)
    return broker.serve(self)
end


-- share: 1, or HANDLER_SHARE for a publish from a handler, which may only
-- fill that part of the queue: a handler that publishes what it handles
-- (a feedback loop) leaves the rest to the worker's requests and timers
local function full(self, bytes, share)
    local opts = self.opts
    return self.pending * share >= opts.max_queue
           or (self.pending_bytes + bytes) * share > opts.max_queue_bytes
end


-- true when the running coroutine is in a handler (dispatch)
local function in_handler(self)
    local d1 = self.dispatch[1]
    -- (coroutine.running() only then: it is not compiled)
    return d1 ~= nil and d1 == co_running()
end


local function make_room(self, bytes, share, source, event)
    if not full(self, bytes, share) then
        return true, false
    end
    local opts = self.opts
    local policy = opts.overflow
    local waited = false
    if policy == "drop_oldest" and share == 1 then
        -- (not for a handler beyond its share: the oldest events are
        -- mostly the requests' and timers', whose half it would take)
        local q = self.unsent_q
        while full(self, bytes, share) do
            local s, b = q:pop()
            if not s then
                break
            end
            self.unsent:skip(b)
            self.pending = self.pending - 1
            self.pending_bytes = self.pending_bytes - b
            if self.held:peek() == s then
                -- re-queued after a reconnect, and now never sent: the
                -- broker's word on it will not come
                own_unique(self, s, false)
            end
            count(self.counters.dropped, "oldest")
            warn_once(self, "drop", "queue full: dropped the oldest "
                      .. "event(s); ", self.counters.dropped.oldest, " so far")
        end
    elseif policy == "wait" and WAIT_PHASES[get_phase()] then
        -- Room comes with the broker's acks, which arrive behind the events
        -- this worker has not read yet. A handler that waits here holds
        -- the handlers up, so the reader must go on reading meanwhile, or
        -- each would wait for the other until wait_timeout.
        local d = self.dispatch
        local handler = share > 1
        if handler then
            d.waiting = true
            if self.rwaiters > 0 then
                self.rspace:post(self.rwaiters)
            end
        end
        local deadline = ngx_now() + opts.wait_timeout
        while full(self, bytes, share) do
            local left = deadline - ngx_now()
            if left <= 0 then
                break
            end
            -- (at least 1 ms: a shorter wait returns at once without
            -- yielding, and ngx.now() would never reach the deadline)
            self.space:wait(max(left, 0.001))
            waited = true
        end
        if handler then
            d.waiting = false
        end
    end
    if full(self, bytes, share) then
        local dropped = self.counters.dropped
        if share == 1 or full(self, bytes, 1) then
            count(dropped, "queue full")
            warn_once(self, "full", "queue full: publish refused; ",
                      dropped["queue full"], " so far")
        else
            -- refused for a handler only: name what it handles
            local d = self.dispatch
            count(dropped, "handler share")
            warn_once(self, "share", "handlers fill their half of the "
                      .. "queue: publish refused to the handler of source=",
                      d.source, " event=", d.event, " (publishing source=",
                      source, " event=", event, "); ",
                      dropped["handler share"], " so far")
        end
        return nil
    end
    return true, waited
end


local TARGET_KIND = {
    all = ALL, others = OTHERS, current = LOCAL, agent = AGENT,
}


-- Publishes an event. Returns true, or nil and "payload too large",
-- "queue full" or "not initialized".
function _M.publish(self, target, source, event, data)
    if type(source) ~= "string" or source == "" then
        error("source must be a non-empty string", 2)
    end
    if type(event) ~= "string" or event == "" then
        error("event must be a non-empty string", 2)
    end

    local kind, key
    if type(target) == "number" then
        if target % 1 ~= 0 or target < 0
           or (self.worker_count > 0 and target >= self.worker_count) then
            error("target must be a worker id between 0 and "
                  .. (self.worker_count - 1), 2)
        end
        kind = target
    elseif type(target) == "string" then
        kind = TARGET_KIND[target]
        if not kind then
            if str_sub(target, 1, 7) == "unique:" and #target > 7 then
                key = str_sub(target, 8)
                if #key > UNIQUE_KEY_MAX then
                    error("unique key longer than " .. UNIQUE_KEY_MAX
                          .. " bytes", 2)
                end
                kind = UNIQUE
            else
                error('target must be "all", "others", "current", "agent", '
                      .. '"unique:<key>" or a worker id', 2)
            end
        elseif kind == AGENT and not self.opts.privileged_agent then
            error('target "agent" needs opts.privileged_agent', 2)
        end
    else
        error("target must be a string or a worker id", 2)
    end

    if not self.initialized then
        return nil, "not initialized"
    end
    if self.stopping then
        -- the worker is exiting and its bus has said goodbye: nothing
        -- published now would leave the worker, or be handled
        count(self.counters.dropped, "closed")
        warn_once(self, "closed", "worker exiting: publish refused, the "
                  .. "bus is closed; ", self.counters.dropped.closed,
                  " so far")
        return nil, "closed"
    end

    local stats = self.counters.published
    if kind == LOCAL then
        -- asynchronous, in this worker only; data is not copied
        inbox_push(self, source, event, data, self.worker, nil, self.pid)
        count(stats, "current")
        return true
    end

    local ok, size = pcall(frame.encode_body, source, event, data)
    if not ok then
        return nil, "failed to serialise data: " .. tostring(size)
    end
    if size > self.opts.max_payload then
        count(self.counters.dropped, "payload too large")
        return nil, "payload too large"
    end
    if kind == self.worker then
        -- to ourselves: a copy for our handlers, no round trip; after
        -- whatever of ours is still queued
        local data_copy = frame.copy_data(data)
        if #self.unsent == 0 then
            if self.own.n > 0 then
                release_own(self, 1, 0, true)
            end
            hand_own(self, source, event, data_copy, mono())
        else
            self.own:push(self.seq + 0.5, source, event, data_copy, mono(),
                          false)
        end
        count(stats, kind == AGENT and "agent" or "worker")
        return true
    end
    local handler = in_handler(self)
    if handler then
        local d = self.dispatch
        if source == d.source and event == d.event then
            -- a handler publishing what it handles: a feedback loop, if it
            -- does so for every one
            local c = self.counters
            c.feedback = c.feedback + 1
            warn_once(self, "feedback", "a handler of source=", source,
                      " event=", event, " published the same event (a "
                      .. "feedback loop?); ", c.feedback, " so far")
        end
    end
    local room, waited = make_room(self, size + EVENT_SIZE + 64,
                                   handler and HANDLER_SHARE or 1, source,
                                   event)
    if not room then
        return nil, "queue full"
    end
    if waited then
        -- another publish may have used the scratch buffer meanwhile
        frame.encode_body(source, event, data)
    end

    local seq = self.seq + 1
    self.seq = seq
    local stream = 0
    if kind == ALL then
        stream = self.all_seq + 1
        self.all_seq = stream
    elseif kind == OTHERS then
        stream = self.others_seq + 1
        self.others_seq = stream
    elseif kind >= 0 or kind == AGENT then
        stream = (self.direct_seq[kind] or 0) + 1
        self.direct_seq[kind] = stream
    end

    -- the latency histogram samples the event that starts a millisecond
    -- and every STAMP_EVERY-th after it: a clock read costs 40-100 ns at
    -- both ends, a tenth of an event at full rate; 0 is "not sampled"
    local now = 0
    local ms = ngx_now()
    if not handler then
        -- (what handlers publish keeps no exiting bus up: see exit_watch)
        self.last_publish = ms
    end
    if ms ~= self.stamp_ms or seq % STAMP_EVERY == 0 then
        self.stamp_ms = ms
        now = mono()
    end
    local bytes = frame.put_event(self.unsent, seq, kind, self.worker,
                                  self.pid, self.incarnation, stream, now,
                                  key)
    if kind == ALL then
        -- the broker sends "all" to the others; our copy waits for the
        -- writer to take the event (a copy, not a decode: 3x cheaper)
        self.own:push(seq, source, event, frame.copy_data(data), now, false)
    elseif key and unique_target(key, self.worker_count) == self.worker then
        -- lands on us: the broker only says whether it runs (see
        -- release_own)
        self.own:push(seq, source, event, frame.copy_data(data), now, true)
    end
    self.unsent_q:push(seq, bytes)
    self.pending = self.pending + 1
    self.pending_bytes = self.pending_bytes + bytes
    if self.writer_idle then
        self.writer_idle = false
        self.wsema:post(1)
    end

    count(stats, kind == ALL and "all" or kind == OTHERS and "others"
                 or kind == UNIQUE and "unique" or kind == AGENT and "agent"
                 or "worker")
    if self.opts.overflow == "wait" then
        -- a publisher that may be slowed is: a long run of publishes in
        -- one go lets the event loop turn every BURST events (requests,
        -- and the bus's own stages)
        if ms ~= self.burst_at then
            self.burst_at, self.burst = ms, 0
        end
        local burst = self.burst + 1
        if burst >= BURST and WAIT_PHASES[get_phase()] then
            burst = 0
            yield()
        end
        self.burst = burst
    end
    return true
end


-- Subscribes handler(data, event, source, publisher_worker_id) to events
-- of source and event ("*" matches any). Returns the subscription id.
function _M.subscribe(self, source, event, handler)
    if type(source) ~= "string" or source == "" then
        error("source must be a non-empty string", 2)
    end
    if type(event) ~= "string" or event == "" then
        error("event must be a non-empty string", 2)
    end
    if type(handler) ~= "function" then
        error("handler must be a function", 2)
    end
    local info = getinfo(2, "Sl")
    local id = self.next_sub + 1
    self.next_sub = id
    local sub = {
        source = source,
        event = event,
        fn = handler,
        site = info and (info.short_src .. ":" .. info.currentline) or "?",
    }
    self.subs[id] = sub
    self.sub_list[#self.sub_list + 1] = sub
    return id
end


function _M.unsubscribe(self, id)
    local sub = self.subs[id]
    if not sub then
        return false
    end
    self.subs[id] = nil
    -- a new list, so a dispatch walking the old one is not disturbed; that
    -- one skips it from now on
    sub.removed = true
    local list = {}
    for _, s in ipairs(self.sub_list) do
        if s ~= sub then
            list[#list + 1] = s
        end
    end
    self.sub_list = list
    return true
end


-- Registers fn(publisher_worker_id, missing_count), called when events
-- from a publisher went missing, so the application can resynchronise.
function _M.on_gap(self, fn)
    if type(fn) ~= "function" then
        error("fn must be a function", 2)
    end
    self.gap_hooks[#self.gap_hooks + 1] = fn
end


-- Runs the handlers of every event already received, in the caller's
-- context. Returns "done", or "recursive" when called from a handler.
-- (Handlers also run on their own; this is for code that wants them now.)
function _M.poll(self)
    if self.dispatch[1] then
        return "recursive"
    end
    if self.own.n > 0 then
        -- our own events published so far, even those the writer has not
        -- taken yet (as a shared-dict bus would have them), up to one
        -- that waits for the broker's word
        release_own(self, 1, huge, true, true)
    end
    local me = co_running()
    while dispatch_next(self, me) do
        -- keep going until the inbox is empty
    end
    return "done"
end


function _M.is_ready(self)
    return self.ready
end


function _M.stats(self)
    local s = self.counters
    return {
        worker = self.worker,
        pid = self.pid,
        connected = self.connected,
        published = s.published,
        delivered = s.delivered,
        handler_calls = s.handler_calls,
        handler_errors = s.handler_errors,
        dropped = s.dropped,
        gaps = s.gaps,
        duplicates = s.duplicates,
        feedback = s.feedback,
        reconnects = s.reconnects,
        rejected = s.rejected,
        queue = {
            unsent = self.unsent_q:len(),
            -- (the broker worker has nothing unacked: see local_writer)
            unacked = self.pending - self.unsent_q:len(),
            pending_bytes = self.pending_bytes,
            inbox = inbox_len(self),
        },
        latency = self.latency:summary(),
        broker = broker.stats(self),
    }
end


-- Cross-worker collection (stats endpoints). fn() returns a serialisable
-- value for this worker.
function _M.register_collector(name, fn)
    if type(name) ~= "string" then
        error("name must be a string", 2)
    end
    if type(fn) ~= "function" then
        error("fn must be a function", 2)
    end
    collectors[name] = fn
end


-- Asks every worker for the collector's value: { [worker id] = value }.
-- Workers that do not answer in time are missing from the result.
function _M.collect(self, name, timeout)
    timeout = timeout or 1
    local id = (self.collect_id or 0) + 1
    self.collect_id = id
    self.collecting = self.collecting or {}
    local pend = { results = {}, n = 0, sema = semaphore.new() }
    self.collecting[id] = pend
    local err = not self.initialized and "not initialized"
                or self.stopping and "closed"
    if not err then
        local ok, e = pcall(send_urgent, self, ALL, "collect",
                            { name = name, id = id })
        err = not ok and e
    end
    if err then
        self.collecting[id] = nil
        return nil, "failed to collect: " .. tostring(err)
    end
    local want = self.worker_count + (self.opts.privileged_agent and 1 or 0)
    local deadline = ngx_now() + timeout
    while pend.n < want do
        local left = deadline - ngx_now()
        if left <= 0 then
            break
        end
        pend.sema:wait(max(left, 0.001))
        ngx.update_time()
    end
    self.collecting[id] = nil
    return pend.results
end


_M.register_collector("loom.events", function()
    return default_bus and default_bus:stats()
end)


return _M
