-- Events across nginx nodes over one Redis Stream.
--
-- publish() queues the event in this worker; a sender timer writes the
-- queue to the stream with pipelined XADDs. On every node one worker, the
-- holder of a lease in the node's shared dict, reads the node's consumer
-- group (XREADGROUP BLOCK) and fans each batch out to the node's workers
-- through resty.loom.events. Every worker drops the ids it has already
-- handled (marks in the shared dict), hands the rest to the bus's own
-- handlers as "current" events, and confirms once they ran; the reader
-- XACKs a batch once every worker confirmed it, so entries read but not
-- handled stay pending and are read again (the pending list first) by the
-- next reader.


local buffer = require "string.buffer"
local semaphore = require "ngx.semaphore"
local events = require "resty.loom.events"
local rconn = require "resty.loom.cluster.redis"
local marks = require "resty.loom.cluster.marks"
local resp = require "resty.loom.cluster.resp"

local ngx_now = ngx.now
local ngx_update_time = ngx.update_time
local ngx_sleep = ngx.sleep
local ngx_log = ngx.log
local ngx_null = ngx.null
local ngx_ERR = ngx.ERR
local ngx_WARN = ngx.WARN
local ngx_NOTICE = ngx.NOTICE
local timer_at = ngx.timer.at
local timer_every = ngx.timer.every
local worker_exiting = ngx.worker.exiting
local thread_spawn = ngx.thread.spawn
local thread_wait = ngx.thread.wait
local encode = buffer.encode
local decode = buffer.decode
local floor = math.floor
local min = math.min
local max = math.max
local unpack = unpack
local random = math.random
local type = type
local pairs = pairs
local pcall = pcall
local xpcall = xpcall
local tostring = tostring
local tonumber = tonumber
local traceback = debug.traceback
local error = error
local setmetatable = setmetatable
local str_format = string.format
local str_find = string.find
local str_byte = string.byte
local str_gsub = string.gsub
local str_match = string.match
local tab_new = require "table.new"
local clear_tab = require "table.clear"
local table_remove = table.remove

local LOG_TAG = "[loom.cluster] "
local SRC = "loom.cluster"        -- the bus source of the internal events
-- in the node's dict while a worker last failed to reach Redis: with
-- when_down = "reject" every worker of the node refuses, not only those
-- whose own sender has tried since
local DOWN_KEY = "down"
local LOG_EVERY = 10              -- seconds between two alike log lines
local EXIT_FLUSH = 3              -- seconds the sender flushes at exit
local TARGETS = { cluster = "c", nodes = "n", one = "o" }
local MAX_BODY = 256 * 1024       -- serialised data; a bus message holds
local CHUNK = 512 * 1024          -- at most this much of a batch's data
local MAX_INFLIGHT = 4            -- batches handed over, not confirmed yet
local ACK_LAG = 5                 -- ms: BLOCK while batches are in flight
local MARKS_MIN = 256 * 1024      -- bytes of marks kept per worker slot, at
local MARK_BYTES = 128            -- least MARK_BYTES per event in flight
local COUNTERS = {
    "published", "rejected", "sent", "send_errors", "redis_down",
    "dropped_at_exit", "read", "read_errors", "delivered", "duplicates",
    "undecodable", "acked", "ack_timeouts", "dead_letters", "trimmed",
    "claimed", "resyncs", "groups_removed", "reader_elections",
    "marks_loaded",
}

local DEFAULTS = {
    stream = "loom:cluster",
    batch = 256,
    block = 1,
    maxlen = 1000000,
    max_deliveries = 5,
    claim_idle = 30,
    ack_timeout = 5,
    dedupe_window = 30,
    max_buffer = 10000,
    when_down = "reject",
    group_idle = 86400,
    lease_ttl = 3,
    backoff_min = 0.1,
    backoff_max = 5,
}

-- option -> { kind, lo, hi }; "i" integers, "n" seconds
local LIMITS = {
    batch = { "i", 1, 10000 },
    block = { "n", 0.01, 60 },
    maxlen = { "i", 1000, 1e12 },
    max_deliveries = { "i", 1, 1000 },
    claim_idle = { "n", 0.1, 86400 },
    ack_timeout = { "n", 0.01, 3600 },
    dedupe_window = { "n", 1, 86400 },
    max_buffer = { "i", 1, 1e8 },
    group_idle = { "n", 1, 365 * 86400 },
    lease_ttl = { "n", 0.1, 3600 },
    backoff_min = { "n", 0.001, 60 },
    backoff_max = { "n", 0.001, 3600 },
}


local _M = { _VERSION = "0.2.0" }
local mt = { __index = _M }

local last_made


local function count(self, name, n)
    self.dict:incr("s:" .. name, n or 1, 0)
end


-- at most one line per kind and LOG_EVERY seconds, with how many were
-- held back
local function log_throttled(self, level, kind, msg)
    local t = self.logged[kind]
    local now = ngx_now()
    if t and now - t[1] < LOG_EVERY then
        t[2] = t[2] + 1
        return
    end
    local held = t and t[2] or 0
    self.logged[kind] = { now, 0 }
    ngx_log(level, LOG_TAG, msg, held > 0
            and (" (" .. held .. " more since the last line)") or "")
end


local function check_number(opts, k, level)
    local v = opts[k]
    if v == nil then
        return DEFAULTS[k]
    end
    local lim = LIMITS[k]
    if type(v) ~= "number" or v ~= v or v < lim[2] or v > lim[3]
       or (lim[1] == "i" and v ~= floor(v))
    then
        error("opts." .. k .. " must be " .. (lim[1] == "i"
              and "an integer" or "a number of seconds") .. " between "
              .. lim[2] .. " and " .. lim[3], level)
    end
    return v
end


local function check_name(v, what, level)
    if type(v) ~= "string" or v == "" or #v > 200 or str_find(v, "%s") then
        error(what .. " must be a non-empty string without spaces "
              .. "(at most 200 bytes)", level)
    end
end


function _M.new(opts)
    if type(opts) ~= "table" then
        error("opts must be a table", 2)
    end
    for k in pairs(opts) do
        if DEFAULTS[k] == nil and k ~= "redis" and k ~= "node_id"
           and k ~= "shm" and k ~= "bus" and k ~= "marks_file"
        then
            error("opts." .. tostring(k) .. " is not an option", 2)
        end
    end
    local redis = rconn.check(opts.redis, 2)
    check_name(opts.node_id, "opts.node_id", 3)
    if opts.node_id == "one" then
        error('opts.node_id must not be "one" (the shared group)', 2)
    end
    local stream = opts.stream or DEFAULTS.stream
    check_name(stream, "opts.stream", 3)
    if type(opts.shm) ~= "string" or not ngx.shared[opts.shm] then
        error("opts.shm must name a lua_shared_dict", 2)
    end
    if opts.bus ~= nil and (type(opts.bus) ~= "table"
                            or type(opts.bus.publish) ~= "function")
    then
        error("opts.bus must be a resty.loom.events bus", 2)
    end
    local when_down = opts.when_down or DEFAULTS.when_down
    if when_down ~= "reject" and when_down ~= "queue" then
        error('opts.when_down must be "reject" or "queue"', 2)
    end
    local self = {
        redis = redis,
        node_id = opts.node_id,
        stream = stream,
        stream_one = stream .. ":one",
        stream_dead = stream .. ":dead",
        nodes_key = stream .. ":nodes",
        shm = opts.shm,
        bus = opts.bus,
        when_down = when_down,
    }
    for k in pairs(LIMITS) do
        self[k] = check_number(opts, k, 3)
    end
    if self.backoff_min > self.backoff_max then
        error("opts.backoff_min must be <= opts.backoff_max", 2)
    end
    if self.claim_idle >= self.group_idle then
        error("opts.claim_idle must be less than opts.group_idle", 2)
    end
    if self.ack_timeout >= self.claim_idle then
        error("opts.ack_timeout must be less than opts.claim_idle", 2)
    end
    local path = opts.marks_file
    if path == nil then
        local bus = opts.bus or events.get()
        local dir = bus and str_match(bus.opts.socket, "^(.*)/[^/]*$")
        if not dir then
            error("opts.marks_file must be set when no resty.loom.events "
                  .. "bus was made yet", 2)
        end
        path = dir .. "/loom-cluster-"
               .. str_gsub(stream .. "-" .. opts.node_id, "[^%w._-]", "_")
               .. ".marks"
    elseif type(path) ~= "string" or str_byte(path, 1) ~= 47 then
        error("opts.marks_file must be an absolute path", 2)
    end
    local store, err = marks.open(path, ngx.worker.count(),
                                  max(MARKS_MIN, MAX_INFLIGHT * self.batch
                                                 * MARK_BYTES))
    if not store then
        error("opts.marks_file: " .. err, 2)
    end
    self.marks = store
    last_made = setmetatable(self, mt)
    return self
end


function _M.get()
    return last_made
end


-- publish side -------------------------------------------------------------

function _M.publish(self, target, source, event, data)
    local t = TARGETS[target]
    if not t then
        error('target must be "cluster", "nodes" or "one"', 2)
    end
    if type(source) ~= "string" or source == "" then
        error("source must be a non-empty string", 2)
    end
    if type(event) ~= "string" or event == "" then
        error("event must be a non-empty string", 2)
    end
    if not self.wid then
        return nil, "not initialized"
    end
    if self.when_down == "reject"
       and (self.down or self.dict:get(DOWN_KEY))
    then
        count(self, "rejected")
        return nil, "redis down"
    end
    local n = self.q_tail - self.q_head
    if n >= self.max_buffer then
        count(self, "rejected")
        return nil, "queue full"
    end
    local seq = self.seq + 1
    local env = self.envelope
    env.i, env.q, env.s, env.e, env.d = self.id_prefix, seq, source, event,
                                        data
    local ok, body = pcall(encode, env)
    env.d = nil
    if not ok then
        return nil, "failed to serialise data: " .. tostring(body)
    end
    if #body > MAX_BODY then
        return nil, "payload too large"
    end
    self.seq = seq
    local i = self.q_tail + 1
    self.q_tail = i
    self.q_t[i] = t
    self.q_p[i] = body
    count(self, "published")
    if n == 0 and self.sender_idle then
        self.sender_idle = false
        self.wake:post(1)
    end
    return true
end


-- the node's "Redis down" mark (DOWN_KEY), set and cleared by any worker
local function mark_node_down(self, down)
    if down then
        self.dict:set(DOWN_KEY, true)
    elseif self.dict:get(DOWN_KEY) then
        self.dict:delete(DOWN_KEY)
    end
end


local function drop_queued(self, upto)
    local q_t, q_p = self.q_t, self.q_p
    for i = self.q_head + 1, upto do
        q_t[i], q_p[i] = nil, nil
    end
    self.q_head = upto
end


-- one pipeline of XADDs; true, or nil, err (the events stay queued: a
-- pipeline cut half-way is sent again whole, and the readers drop the ids
-- they have seen)
local function send_batch(self, r)
    local from = self.q_head + 1
    local to = min(self.q_tail, self.q_head + self.batch)
    local args, out = self.xadd_args, r.out
    local stream, one = self.stream, self.stream_one
    for i = from, to do
        local t = self.q_t[i]
        args[2] = t == "o" and one or stream
        args[8] = t
        args[10] = self.q_p[i]
        resp.put(out, args, 10)
    end
    local ok, err = resp.exchange(r, to - from + 1, self.replies)
    if not ok then
        return nil, err
    end
    drop_queued(self, to)
    count(self, "sent", to - from + 1)
    return true
end


local function sender(premature, self)
    if premature then
        return
    end
    local red, r, fails = nil, nil, 0
    local gen       -- self.redis.gen when red was made
    local exit_by
    while true do
        if worker_exiting() then
            ngx_update_time()
            exit_by = exit_by or ngx_now() + EXIT_FLUSH
            if self.q_tail == self.q_head or ngx_now() > exit_by then
                break
            end
        end
        if self.q_tail == self.q_head then
            self.sender_idle = true
            self.wake:wait(1)
            self.sender_idle = false

        else
            local err
            if red and gen ~= self.redis.gen then
                red:close()     -- a failover started or ended
                red = nil
            end
            if not red then
                red, err = rconn.connect(self.redis, 5)
                r = red and resp.reader(red)
                gen = self.redis.gen
            end
            local ok = red
            if red then
                ok, err = send_batch(self, r)
                if not ok then
                    red:close()
                    red = nil
                end
            end
            if ok then
                if self.down then
                    self.down = false
                    ngx_log(ngx_NOTICE, LOG_TAG, "redis reachable again, ",
                            self.q_tail - self.q_head, " events queued")
                end
                mark_node_down(self, false)
                fails = 0
            else
                if not self.down then
                    self.down = true
                    count(self, "redis_down")
                end
                mark_node_down(self, true)
                count(self, "send_errors")
                log_throttled(self, rconn.log_level(err), "send",
                              "failed to send events: " .. tostring(err)
                              .. "; " .. (self.q_tail - self.q_head)
                              .. " queued")
                fails = fails + 1
                ngx_sleep(rconn.backoff(fails, self.backoff_min,
                                        self.backoff_max))
            end
        end
    end
    if red then
        red:close()
    end
    local left = self.q_tail - self.q_head
    if left > 0 then
        count(self, "dropped_at_exit", left)
        ngx_log(ngx_ERR, LOG_TAG, left, " events not sent at exit")
    end
end


-- every worker: batches from the node's reader --------------------------------

-- runs in the bus's handler timer of every worker of the node: hands the
-- events this worker slot has not handled to the bus's handlers; returns
-- the marks to set once they ran (key, value, ...). "cluster" events of
-- one publisher come in its order (the stream's), so a slot keeps the
-- highest sequence it handled per publisher; "nodes" and "one" events
-- (claimed ones come out of order) are marked one by one.
local function hand_over(self, items, node)
    local dict, bus, handing = self.dict, self.bus, self.handing
    local marks = {}
    local new, bad = 0, 0
    for i = 1, #items do
        local ok, m = pcall(decode, items[i])
        if not ok or type(m) ~= "table" or type(m.i) ~= "string"
           or type(m.q) ~= "number" or type(m.s) ~= "string"
           or type(m.e) ~= "string"
        then
            bad = bad + 1
            log_throttled(self, ngx_ERR, "decode", "an event not "
                          .. "decodable: " .. tostring(ok and "" or m))
        else
            local fresh
            local q = m.q
            if node then
                local key = self.mark_node .. m.i .. q
                fresh = not handing[key] and not dict:get(key)
                if fresh then
                    handing[key] = q
                    marks[#marks + 1] = key
                    marks[#marks + 1] = true
                end
            else
                local key = self.mark .. m.i
                local hw = handing[key] or dict:get(key) or 0
                fresh = q > hw
                if fresh then
                    handing[key] = q
                    local n = #marks
                    if marks[n - 1] == key then
                        marks[n] = q
                    else
                        marks[n + 1] = key
                        marks[n + 2] = q
                    end
                end
            end
            if fresh then
                bus:publish("current", m.s, m.e, m.d)
                if self.marks_w then
                    -- right after its handlers: into the marks file
                    bus:publish("current", SRC, node and "ran_node" or "ran",
                                m)
                end
                new = new + 1
            end
        end
    end
    count(self, "delivered", new)
    if bad > 0 then
        count(self, "undecodable", bad)
    end
    local dups = #items - new - bad
    if dups > 0 then
        count(self, "duplicates", dups)
    end
    return marks
end


local function on_batch(self, msg)
    local marks = hand_over(self, msg.items, msg.node)
    -- "current" events run in order: this one runs after the batch's
    -- handlers. Marking only then means a worker killed among them
    -- leaves its successor the events it had not marked (some of which
    -- may have run), rather than losing events marked and never run.
    self.bus:publish("current", SRC, "done",
                     { b = msg.b, r = msg.r, marks = marks })
end


local function confirm(self, b)
    local w = self.waits[b]
    if w then
        w.got = w.got + 1
        if w.got >= w.need then
            w.sema:post(1)
        end
    end
end


local function on_ran(self, m)
    marks.put(self.marks_w, marks.CLUSTER, m.i, m.q)
end


local function on_ran_node(self, m)
    marks.put(self.marks_w, marks.NODE, m.i, m.q)
end


-- the marks the file holds: "nodes"/"one" ones of every slot (any worker
-- may read for the node), "cluster" ones of this worker's slot
local function load_marks(self)
    local dict, window, slot = self.dict, self.dedupe_window, self.wid
    local high, n = {}, 0
    marks.each(self.marks, function(kind, key, q, s)
        if kind == marks.NODE then
            dict:set(self.mark_node .. key .. q, true, window)
            n = n + 1
        elseif s == slot and q > (high[key] or 0) then
            high[key] = q
        end
    end)
    for pub, q in pairs(high) do
        local key = self.mark .. pub
        if q > (dict:get(key) or 0) then
            dict:set(key, q, window)
        end
        n = n + 1
    end
    count(self, "marks_loaded", n)
end


local function on_done(self, msg)
    local dict, handing, window = self.dict, self.handing, self.dedupe_window
    local marks = msg.marks
    for i = 1, #marks - 1, 2 do
        local key, v = marks[i], marks[i + 1]
        dict:set(key, v, window)
        if handing[key] == v or v == true then
            handing[key] = nil
        end
    end
    if msg.r == self.wid then
        confirm(self, msg.b)
    else
        self.bus:publish(msg.r, SRC, "ack", msg.b)
    end
end


-- the reader ---------------------------------------------------------------

-- hands items (encoded events) to the workers in messages of at most
-- CHUNK bytes; each message is to be confirmed by `need` workers (w.need
-- counts them); node: the items are handled once per node
local function hand_to_workers(self, w, need, target, items, node)
    local from, bytes = 1, 0
    local n = #items
    for i = 1, n do
        bytes = bytes + #items[i]
        if bytes >= CHUNK or i == n then
            local part = items
            if from > 1 or i < n then
                part = { unpack(items, from, i) }
            end
            w.need = w.need + need
            local ok, err = self.bus:publish(target, SRC, "batch",
                                             { b = w.b, r = self.wid,
                                               items = part, node = node })
            if not ok then
                return nil, err
            end
            from, bytes = i + 1, 0
        end
    end
    return true
end


-- entries -> a batch in flight: w.ids are to be acknowledged once the
-- workers confirmed (w.got == w.need), w.now at once (dead letters and
-- entries trimmed away); nil, err when Redis failed
local function deliver(self, red, key, entries, counts)
    local all, here, now, ids = {}, {}, {}, {}
    local dead = 0
    red:init_pipeline()
    for k = 1, #entries do
        local e = entries[k]
        local id, f = e[1], e[2]
        if type(f) ~= "table" then
            -- trimmed away while pending (XREADGROUP 0 returns it empty)
            now[#now + 1] = id
            count(self, "trimmed")
        else
            local n = counts and counts[id] or 1
            local t = f[1] == "t" and f[3] == "p" and f[2]
            if not (t == "c" or t == "n" or t == "o") or #f ~= 4
               or n > self.max_deliveries
            then
                red:xadd(self.stream_dead, "MAXLEN", "~", 10000, "*",
                         "stream", key, "entry", id, "group",
                         key == self.stream and self.node_id or "one",
                         "deliveries", n, "fields", encode(f))
                now[#now + 1] = id
                dead = dead + 1
            else
                local to = t == "c" and all or here
                to[#to + 1] = f[4]
                ids[#ids + 1] = id
            end
        end
    end
    if dead > 0 then
        local res, err = red:commit_pipeline()
        if not res then
            return nil, "failed to dead-letter: " .. tostring(err)
        end
        count(self, "dead_letters", dead)
        log_throttled(self, ngx_ERR, "dead", dead .. " entries of " .. key
                      .. " moved to " .. self.stream_dead)
    else
        red:cancel_pipeline()
    end
    local b = self.next_batch + 1
    self.next_batch = b
    ngx_update_time()
    local w = { b = b, need = 0, got = 0, sema = semaphore.new(), ids = ids,
                now = now, n = #ids, deadline = ngx_now() + self.ack_timeout }
    self.waits[b] = w
    local ok, err = true, nil
    if #all > 0 then
        ok, err = hand_to_workers(self, w, self.nworkers, "all", all)
    end
    if ok and #here > 0 then
        -- "nodes" and "one" events: this worker handles them for the node
        ok, err = hand_to_workers(self, w, 1, "current", here, true)
    end
    if not ok then
        w.failed = err
    end
    return w
end


-- takes the batches in flight whose workers confirmed, from the oldest,
-- adding their ids to `acks`; waits for the oldest when `all` or when
-- MAX_INFLIGHT are in flight. Returns false when one timed out (its
-- entries stay pending, to be read again)
local function settle(self, inflight, acks, all)
    local fine = true
    while #inflight > 0 do
        local w = inflight[1]
        if w.got < w.need and not w.failed then
            if not all and #inflight < MAX_INFLIGHT then
                break
            end
            ngx_update_time()
            local left = w.deadline - ngx_now()
            if left > 0 then
                w.sema:wait(left)
            end
        end
        for i = 1, #w.now do
            acks[#acks + 1] = w.now[i]
        end
        if w.got >= w.need and not w.failed then
            for i = 1, w.n do
                acks[#acks + 1] = w.ids[i]
            end
        else
            fine = false
            count(self, "ack_timeouts")
            log_throttled(self, ngx_WARN, "ack", "workers did not confirm "
                          .. "a batch of " .. w.n .. " events ("
                          .. tostring(w.failed or "timeout")
                          .. "); they stay pending")
        end
        self.waits[w.b] = nil
        table_remove(inflight, 1)
    end
    return fine
end


-- XPENDING delivery counts of a run of pending entries
local function pending_counts(red, key, group, consumer, entries)
    local res = red:xpending(key, group, entries[1][1],
                             entries[#entries][1], #entries, consumer)
    local counts = {}
    if type(res) == "table" then
        for i = 1, #res do
            counts[res[i][1]] = tonumber(res[i][4])
        end
    end
    return counts
end


local function resync(self, why)
    count(self, "resyncs")
    ngx_log(ngx_ERR, LOG_TAG, "the group of this node ", why, ": events ",
            "published meanwhile are lost; telling the workers to ",
            "resynchronise")
    self.bus:publish("all", SRC, "resync", why)
end


-- creates the group; a group this node had and lost (Redis lost its data,
-- or the janitor removed it after group_idle) means a resync
local function flush_acks(self, red, key, group, acks)
    if #acks == 0 then
        return true
    end
    local n, err = red:xack(key, group, unpack(acks))
    if not n then
        return nil, "failed to ack: " .. tostring(err)
    end
    count(self, "acked", #acks)
    clear_tab(acks)
    return true
end


local function create_group(self, red, key, group, from)
    local ok, err = red:xgroup("CREATE", key, group, from, "MKSTREAM")
    if not ok then
        if str_find(tostring(err), "BUSYGROUP", 1, true) then
            self.dict:set("joined:" .. key, true)
            return true
        end
        return nil, "failed to create group " .. group .. ": "
                    .. tostring(err)
    end
    if key == self.stream then
        local removed = red:hdel(self.stream .. ":removed", self.node_id)
        if removed == 1 then
            resync(self, "was removed after opts.group_idle")
        elseif self.dict:get("joined:" .. key) then
            resync(self, "was lost by Redis")
        end
    end
    self.dict:set("joined:" .. key, true)
    return true
end


local function redis_ms(red)
    local t, err = red:time()
    if type(t) ~= "table" then
        return nil, err
    end
    return tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)
end


-- heartbeat in <stream>:nodes (Redis's clock), removal of the groups of
-- nodes silent for group_idle, and of the marks in <stream>:removed older
-- than group_idle: a node back after that is a new node (it resyncs only
-- if its shared dict remembers the group)
local function maintain(self, red)
    local now, err = redis_ms(red)
    if not now then
        return nil, err
    end
    red:hset(self.nodes_key, self.node_id, now)
    local removed_key = self.stream .. ":removed"
    local marks = red:hgetall(removed_key)
    if type(marks) == "table" then
        for i = 1, #marks - 1, 2 do
            local at = tonumber(marks[i + 1])
            if not at or now - at > self.group_idle * 1000 then
                red:hdel(removed_key, marks[i])
            end
        end
    end
    local all = red:hgetall(self.nodes_key)
    if type(all) ~= "table" then
        return true
    end
    for i = 1, #all - 1, 2 do
        local node, seen = all[i], tonumber(all[i + 1])
        if node ~= self.node_id and seen
           and now - seen > self.group_idle * 1000
        then
            red:xgroup("DESTROY", self.stream, node)
            red:xgroup("DELCONSUMER", self.stream_one, "one", node)
            red:hdel(self.nodes_key, node)
            red:hset(removed_key, node, now)
            count(self, "groups_removed")
            ngx_log(ngx_NOTICE, LOG_TAG, "removed the group of node ", node,
                    ", silent for ", floor((now - seen) / 1000), " s")
        end
    end
    return true
end


-- one stream, one group: pending entries first, then new ones; "one"
-- also claims entries other consumers left idle for claim_idle
local function consume(self, red, key, group, from)
    local ok, err = create_group(self, red, key, group, from)
    if not ok then
        return nil, err
    end
    local consumer = self.node_id
    local cursor = "0"
    local r, reply = resp.reader(red), {}
    local block = floor(self.block * 1000)
    local read_new = { "XREADGROUP", "GROUP", group, consumer, "COUNT",
                       self.batch, "BLOCK", block, "STREAMS", key, ">" }
    local ack_args = { "XACK", key, group }
    local inflight, acks = {}, {}
    local next_chores = 0
    local conf, gen = self.redis, self.redis.gen
    -- a failover started or ended (gen): read from the master from now on
    while self.reading and not worker_exiting() and conf.gen == gen do
        ngx_update_time()
        if ngx_now() >= next_chores then
            next_chores = ngx_now() + min(self.claim_idle / 2, 10)
            if key == self.stream then
                ok, err = maintain(self, red)
            else
                local res
                res, err = red:xautoclaim(key, group, consumer,
                                          floor(self.claim_idle * 1000),
                                          "0-0", "COUNT", self.batch)
                ok = res
                if type(res) == "table" and type(res[2]) == "table"
                   and #res[2] > 0
                then
                    count(self, "claimed", #res[2])
                    cursor = "0"    -- they are ours now: read as pending
                end
            end
            if not ok then
                return nil, err
            end
        end
        local res
        if cursor then
            -- the pending list: one batch at a time
            if not settle(self, inflight, acks, true) then
                cursor = "0"
            end
            ok, err = flush_acks(self, red, key, group, acks)
            if not ok then
                return nil, err
            end
            res, err = red:xreadgroup("GROUP", group, consumer, "COUNT",
                                      self.batch, "STREAMS", key, cursor)
        else
            if not settle(self, inflight, acks, false) then
                cursor = "0"    -- read what was not confirmed again
            end
            local n = 1
            if #acks > 0 then
                for i = 1, #acks do
                    ack_args[3 + i] = acks[i]
                end
                resp.put(r.out, ack_args, 3 + #acks)
                n = 2
            end
            -- while batches are in flight, come back soon to ack them
            read_new[8] = #inflight > 0 and ACK_LAG or block
            resp.put(r.out, read_new, 11)
            ok, err = resp.exchange(r, n, reply)
            if ok and n == 2 then
                count(self, "acked", #acks)
            end
            clear_tab(acks)
            res = ok and reply[n]
            if not ok and not str_find(tostring(err), "NOGROUP", 1, true)
            then
                return nil, "failed to read " .. key .. ": " .. tostring(err)
            end
        end
        if not res then
            if str_find(tostring(err), "NOGROUP", 1, true) then
                -- lost or removed while this reader was connected
                ok, err = create_group(self, red, key, group, "$")
                if not ok then
                    return nil, err
                end
            else
                return nil, "failed to read " .. key .. ": " .. tostring(err)
            end
        end
        local entries = res and res ~= ngx_null and res[1][2]
        if cursor and (not entries or #entries == 0) then
            cursor = nil       -- pending list done
        elseif entries and #entries > 0 then
            count(self, "read", #entries)
            local counts
            if cursor then
                counts = pending_counts(red, key, group, consumer, entries)
                cursor = entries[#entries][1]
            end
            local w
            w, err = deliver(self, red, key, entries, counts)
            if not w then
                return nil, err
            end
            inflight[#inflight + 1] = w
        end
    end
    -- leaving (reload, quit, lease lost): acknowledge what was confirmed
    settle(self, inflight, acks, true)
    return flush_acks(self, red, key, group, acks)
end


local function read_forever(self, key, group, from)
    local fails = 0
    while self.reading and not worker_exiting() do
        local red, err = rconn.connect(self.redis, self.block + 5)
        local ok
        mark_node_down(self, not red)
        if red then
            if fails > 0 then
                ngx_log(ngx_NOTICE, LOG_TAG, "reading ", key, " again")
            end
            fails = 0
            ok, err = consume(self, red, key, group, from)
            red:close()
        end
        if not ok then
            fails = fails + 1
            count(self, "read_errors")
            log_throttled(self, rconn.log_level(err), "read " .. key,
                          "reader: " .. tostring(err))
            ngx_sleep(rconn.backoff(fails, self.backoff_min,
                                    self.backoff_max))
        end
    end
end


local function release(self)
    self.reading = false
    if self.dict:get("reader") == self.token then
        self.dict:delete("reader")
    end
end


local function reader(premature, self)
    if premature then
        release(self)
        return
    end
    ngx_log(ngx_NOTICE, LOG_TAG, "worker ", self.wid, " reads for node ",
            self.node_id)
    count(self, "reader_elections")
    local one = thread_spawn(read_forever, self, self.stream_one, "one", "0")
    local ok, err = xpcall(read_forever, traceback, self, self.stream,
                           self.node_id, "$")
    if not ok then
        ngx_log(ngx_ERR, LOG_TAG, "reader failed: ", err)
    end
    self.reading = false
    thread_wait(one)
    release(self)
end


-- the node's reader lease, in the shared dict (shared by the generations
-- of a reload, so old and new workers never read at once)
local function elect(premature, self)
    if premature then
        return
    end
    local dict = self.dict
    if self.reading then
        if dict:get("reader") == self.token then
            dict:set("reader", self.token, self.lease_ttl)
        else
            self.reading = false          -- lost it (a stall past the ttl)
        end
        return
    end
    if worker_exiting() then
        return
    end
    if dict:add("reader", self.token, self.lease_ttl) then
        self.reading = true
        local ok, err = timer_at(0, reader, self)
        if not ok then
            release(self)
            ngx_log(ngx_ERR, LOG_TAG, "failed to start the reader: ", err)
        end
    end
end


function _M.init_worker(self)
    if self.wid then
        return true
    end
    local bus = self.bus or events.get()
    if not bus then
        return nil, "failed to init: no resty.loom.events bus"
    end
    self.bus = bus
    self.dict = ngx.shared[self.shm]
    self.wid = ngx.worker.id()
    self.nworkers = ngx.worker.count()
    ngx_update_time()
    local pid = ngx.worker.pid()
    local start = floor(ngx_now() * 1000)
    self.token = str_format("%d-%d-%d", pid, start, random(1e9))
    self.id_prefix = str_format("%s/%x%x/", self.node_id, pid, start)
    self.mark = "d:" .. self.wid .. ":"
    self.mark_node = "d:n:"
    self.seq = 0
    self.q_head, self.q_tail = 0, 0
    self.q_t, self.q_p = tab_new(256, 0), tab_new(256, 0)
    self.envelope = {}
    self.xadd_args = { "XADD", "", "MAXLEN", "~", self.maxlen, "*", "t", "",
                       "p", "" }
    self.replies = {}
    self.wake = semaphore.new()
    self.sender_idle = false
    self.down = false
    self.logged = {}
    self.waits = {}
    self.handing = {}       -- marks of events handed over, not yet run
    self.next_batch = 0
    self.reading = false
    self.marks_w = marks.attach(self.marks, self.wid, pid, self.dict)
    if self.marks_w then
        load_marks(self)
        bus:subscribe(SRC, "ran", function(m) on_ran(self, m) end)
        bus:subscribe(SRC, "ran_node", function(m) on_ran_node(self, m) end)
    else
        ngx_log(ngx_WARN, LOG_TAG, "both marks regions of worker ", self.wid,
                " are in use (reloads in quick succession): what this ",
                "worker handles may run again if the whole node dies")
    end
    bus:subscribe(SRC, "batch", function(msg) on_batch(self, msg) end)
    bus:subscribe(SRC, "done", function(msg) on_done(self, msg) end)
    bus:subscribe(SRC, "ack", function(b) confirm(self, b) end)
    local ok, err = rconn.watch(self.redis)
    if not ok then
        return nil, err
    end
    ok, err = timer_at(0, sender, self)
    if ok then
        ok, err = timer_every(self.lease_ttl / 3, elect, self)
    end
    if ok then
        ok, err = timer_at(0, elect, self)
    end
    if not ok then
        return nil, "failed to init: " .. tostring(err)
    end
    return true
end


-- the node's counters (the shared dict) and this worker's state
function _M.stats(self)
    local t = { node_id = self.node_id, worker = self.wid }
    if self.dict then
        for i = 1, #COUNTERS do
            local k = COUNTERS[i]
            t[k] = self.dict:get("s:" .. k) or 0
        end
        t.reader = self.reading
        t.queued = self.q_tail - self.q_head
        t.redis_down = self.down or self.dict:get(DOWN_KEY) == true
    end
    return t
end


return _M
