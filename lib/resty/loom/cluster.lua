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
-- Here: the options, publish() and init_worker(); the sender, the reader,
-- every worker's receiving side, the janitor and the counters are in
-- cluster/*.lua.


local buffer = require "string.buffer"
local semaphore = require "ngx.semaphore"
local events = require "resty.loom.events"
local options = require "resty.loom.opts"
local rconn = require "resty.loom.cluster.redis"
local marks = require "resty.loom.cluster.marks"
local reader = require "resty.loom.cluster.reader"
local receiver = require "resty.loom.cluster.receiver"
local sender = require "resty.loom.cluster.sender"
local stats = require "resty.loom.cluster.stats"

local ngx_now = ngx.now
local ngx_update_time = ngx.update_time
local ngx_log = ngx.log
local ngx_WARN = ngx.WARN
local timer_at = ngx.timer.at
local timer_every = ngx.timer.every
local encode = buffer.encode
local floor = math.floor
local max = math.max
local random = math.random
local type = type
local pairs = pairs
local pcall = pcall
local tostring = tostring
local error = error
local setmetatable = setmetatable
local str_format = string.format
local str_find = string.find
local str_byte = string.byte
local str_gsub = string.gsub
local str_match = string.match
local tab_new = require "table.new"
local count = stats.count
local COUNTERS = stats.COUNTERS
local on_batch = receiver.on_batch
local on_done = receiver.on_done
local on_ran = receiver.on_ran
local on_ran_node = receiver.on_ran_node
local confirm = receiver.confirm
local load_marks = receiver.load_marks

local LOG_TAG = "[loom.cluster] "
local SRC = receiver.SRC
local DOWN_KEY = sender.DOWN_KEY
local MAX_INFLIGHT = reader.MAX_INFLIGHT
local TARGETS = { cluster = "c", nodes = "n", one = "o" }
local MAX_BODY = 256 * 1024       -- bytes of an event's serialised data
local MARKS_MIN = 256 * 1024      -- bytes of marks kept per worker slot, at
local MARK_BYTES = 128            -- least MARK_BYTES per event in flight

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

-- a stream's or a node's name: in Redis keys and consumer groups
local function is_name(v)
    return type(v) == "string" and v ~= "" and #v <= 200
           and not str_find(v, "%s")
end

local NAME = options.test(is_name, "a string of 1 to 200 bytes without spaces")

local RULES = {
    redis = options.table,          -- checked by rconn.check
    node_id = NAME,
    stream = NAME,
    shm = options.test(function(v)
        return type(v) == "string" and ngx.shared[v] ~= nil
    end, "the name of a lua_shared_dict"),
    bus = options.test(function(v)
        return type(v) == "table" and type(v.publish) == "function"
    end, "a resty.loom.events bus"),
    marks_file = options.test(function(v)
        return type(v) == "string" and str_byte(v, 1) == 47
    end, "an absolute path"),
    when_down = options.one_of("reject", "queue"),
    batch = options.whole(1, 10000),
    block = options.number(0.01, 60),
    maxlen = options.whole(1000, 1e12),
    max_deliveries = options.whole(1, 1000),
    claim_idle = options.number(0.1, 86400),
    ack_timeout = options.number(0.01, 3600),
    dedupe_window = options.number(1, 86400),
    max_buffer = options.whole(1, 1e8),
    group_idle = options.number(1, 365 * 86400),
    lease_ttl = options.number(0.1, 3600),
    backoff_min = options.number(0.001, 60),
    backoff_max = options.number(0.001, 3600),
}
local REQUIRED = { "redis", "node_id", "shm" }


local _M = { _VERSION = "0.2.0" }
local mt = { __index = _M }

local last_made


function _M.new(opts)
    options.check(opts, RULES, 2)
    for i = 1, #REQUIRED do
        if opts[REQUIRED[i]] == nil then
            error("opts." .. REQUIRED[i] .. " is required", 2)
        end
    end
    local redis = rconn.check(opts.redis, 2)
    if opts.node_id == "one" then
        error('opts.node_id must not be "one" (the shared group)', 2)
    end
    local self = {
        redis = redis,
        node_id = opts.node_id,
        shm = opts.shm,
        bus = opts.bus,
    }
    for k, v in pairs(DEFAULTS) do
        local o = opts[k]
        if o == nil then
            o = v
        end
        self[k] = o
    end
    local stream = self.stream
    self.stream_one = stream .. ":one"
    self.stream_dead = stream .. ":dead"
    self.nodes_key = stream .. ":nodes"
    if self.backoff_min > self.backoff_max then
        error("opts.backoff_min must be at most opts.backoff_max", 2)
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
            error("opts.marks_file is required when no resty.loom.events "
                  .. "bus was made yet", 2)
        end
        path = dir .. "/loom-cluster-"
               .. str_gsub(stream .. "-" .. opts.node_id, "[^%w._-]", "_")
               .. ".marks"
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
    ok, err = timer_at(0, sender.run, self)
    if ok then
        ok, err = timer_every(self.lease_ttl / 3, reader.elect, self)
    end
    if ok then
        ok, err = timer_at(0, reader.elect, self)
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
