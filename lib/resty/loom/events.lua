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
local shm = require "resty.loom.events.shm"
local broker = require "resty.loom.events.broker"
local dispatch = require "resty.loom.events.dispatch"
local own = require "resty.loom.events.own"
local collect = require "resty.loom.events.collect"
local client = require "resty.loom.events.client"
local exit = require "resty.loom.events.exit"
local evlog = require "resty.loom.events.log"
local histogram = require "resty.loom.histogram"
local options = require "resty.loom.opts"
local yield = require("resty.loom.yield").yield

local unique_target = broker.unique_target

local C = ffi.C
local ngx = ngx
local ngx_now = ngx.now
local get_phase = ngx.get_phase
local timer_at = ngx.timer.at
local buf_new = buffer.new
local type = type
local error = error
local pairs = pairs
local ipairs = ipairs
local pcall = pcall
local tostring = tostring
local tonumber = tonumber
local setmetatable = setmetatable
local getinfo = debug.getinfo
local str_sub = string.sub
local str_byte = string.byte
local min = math.min
local max = math.max
local huge = math.huge
local co_running = coroutine.running
local warn_once = evlog.warn_once
local mono = dispatch.mono
local inbox_len = dispatch.inbox_len
local inbox_push = dispatch.inbox_push
local dispatch_next = dispatch.dispatch_next
local handler_loop = dispatch.handler_loop
local hand_own = own.hand_own
local own_unique = own.own_unique
local release_own = own.release_own
local client_loop = client.client_loop
local exit_watch = exit.exit_watch

local EVENT_SIZE = frame.EVENT_SIZE
local ALL = frame.ALL
local OTHERS = frame.OTHERS
local WRITE_MAX = frame.WRITE_MAX
local UNIQUE = frame.UNIQUE
local AGENT = frame.AGENT
local LOCAL = -100                  -- "current": never leaves the worker

local MAX_PAYLOAD_LIMIT = 64 * 1024 * 1024
-- bounds of a publisher's ring (see shm.lua): a run is at most WRITE_MAX
local RING_MIN = 256 * 1024
local RING_MAX = 1024 * 1024 * 1024
-- default bound of the events waiting for one subscriber, in its inbox and
-- again at the broker: what a stalled handler leaves stale before drops
local BACKLOG = 10000
-- beyond these, an option is a mistake
local MAX_EVENTS = 100000000
local MAX_BYTES = 2 ^ 40
local MAX_SECONDS = 86400
local MAX_WORKER = 1023            -- nginx runs at most 1024 workers
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
    ring_bytes = 4 * 1024 * 1024,
}


-- an absolute path shorter than 108 bytes (a UNIX socket's longest),
-- "unix:" first or not
local function socket_path(v)
    if type(v) ~= "string" then
        return false
    end
    if str_sub(v, 1, 5) == "unix:" then
        v = str_sub(v, 6)
    end
    return str_byte(v, 1) == 47 and #v < 108
end

-- (seconds: from 1 ms, as nginx's timers count whole milliseconds)
local function seconds(lo)
    return options.number(lo, MAX_SECONDS)
end

local RULES = {
    socket = options.test(socket_path,
                          "an absolute path shorter than 108 bytes"),
    broker = options.whole(0, MAX_WORKER),
    max_queue = options.whole(1, MAX_EVENTS),
    max_queue_bytes = options.whole(1024, MAX_BYTES),
    max_backlog = options.or_value(options.whole(1, MAX_EVENTS), false,
                                   "false"),
    max_payload = options.whole(1, MAX_PAYLOAD_LIMIT),
    overflow = options.one_of("reject", "drop_oldest", "wait"),
    wait_timeout = seconds(0.001),
    privileged_agent = options.boolean,
    unique_window = seconds(0.001),
    heartbeat = seconds(0.01),
    slow_timeout = options.or_value(seconds(0.001), false, "false"),
    exit_timeout = seconds(0.001),
    ring_bytes = options.or_value(options.test(function(v)
        return type(v) == "number" and v >= RING_MIN and v <= RING_MAX
               and v % 4096 == 0
    end, "a multiple of 4096 from " .. RING_MIN .. " to " .. RING_MAX),
        false, "false"),
}

local WEAK_VALUES = { __mode = "v" }


ffi.cdef [[
long long ngx_loom_ffi_generation(void);
int ngx_loom_ffi_pin_listener(const unsigned char *path, size_t len,
    int owner, int *matched, char **err);
int ngx_loom_ffi_prepare_socket(const unsigned char *path, size_t len,
    char **err);
long getrandom(void *buf, size_t len, unsigned int flags);
]]

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


local function count(t, key, n)
    t[key] = (t[key] or 0) + (n or 1)
end


local _M = { _VERSION = "0.2.0" }
local mt = { __index = _M }

local default_bus


local function check_opts(opts)
    options.check(opts, RULES, 3)
    if opts.socket == nil then
        error("opts.socket is required", 3)
    end
    local o = {}
    for k, v in pairs(DEFAULTS) do
        o[k] = v
    end
    for k, v in pairs(opts) do
        o[k] = v
    end
    if str_sub(o.socket, 1, 5) == "unix:" then
        o.socket = str_sub(o.socket, 6)
    end
    if not o.slow_timeout then
        o.slow_timeout = 2 * o.heartbeat
    end
    if not o.max_backlog then
        o.max_backlog = min(o.max_queue, BACKLOG)
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
    local rings
    if phase == "init" then
        local p = o.socket
        if C.ngx_loom_ffi_prepare_socket(p, #p, errmsg) ~= 0 then
            error("opts.socket: " .. ffi.string(errmsg[0]), 2)
        end
        if o.ring_bytes then
            -- before the fork: every worker shares them
            local err
            rings, err = shm.new(ngx.worker.count(), o.ring_bytes)
            if not rings then
                ngx.log(ngx.WARN, "[loom.events] no rings, events go on "
                        .. "the socket: ", err)
            end
        end
    end

    local self = {
        opts = o,
        rings = rings,              -- the publishers' rings, or nil
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
        -- (seq, 0) per event in unsent that cannot travel in our ring
        -- (see shm.lua): a run stops before it
        plain_q = fifo.new(),
        has_ring = false,
        -- (last seq, position) per run in our ring not acknowledged yet:
        -- re-sent as events after a reconnect, so never written over
        ring_runs = fifo.new(),
        ring_out = buf_new(4096),   -- SHM frames for runs in our ring
        ring_buf = buf_new(65536),  -- a run copied from a ring
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
        -- the encoded bodies of the inbox's events from other workers
        -- (false, length in the inbox): decoded when their turn comes
        raw = buf_new(65536),
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
            ring_events = 0,        -- published through our ring
            ring_full = 0,          -- runs sent on the socket: ring full
            overwritten = 0,        -- lost: written over in a ring
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
    -- (a lone worker's "all" events go to its own handlers alone: a ring
    -- would only copy them)
    self.has_ring = self.rings ~= nil and self.rings:has(wid)
                    and (self.worker_count > 1 or opts.privileged_agent)
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
    exit.track(self)
    return true
end


-- events.exit_worker(), in exit_worker_by_lua*: counts and logs what each
-- bus of the worker will never deliver (see events/exit.lua).
_M.exit_worker = exit.exit_worker


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
    if self.has_ring and ((kind ~= ALL and kind ~= OTHERS)
                          or bytes > WRITE_MAX) then
        self.plain_q:push(seq, 0)
    end
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
        -- (false: no rings, see opts.ring_bytes)
        ring = self.rings and {
            events = s.ring_events,
            full = s.ring_full,
            held = self.has_ring and self.rings:held(self.worker) or 0,
            overwritten = s.overwritten,
        } or false,
        latency = self.latency:summary(),
        broker = broker.stats(self),
    }
end


-- Cross-worker collection (stats endpoints). fn() returns a serialisable
-- value for this worker.
_M.register_collector = collect.register_collector


-- Asks every worker for the collector's value: { [worker id] = value }.
-- Workers that do not answer in time are missing from the result.
_M.collect = collect.collect


_M.register_collector("loom.events", function()
    return default_bus and default_bus:stats()
end)


return _M
