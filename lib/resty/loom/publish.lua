-- Batched, non-blocking publishing to Google Cloud Pub/Sub.
--
-- send() validates a message against Pub/Sub's limits, encodes it straight
-- into the current batch's string.buffer (base64 written through the FFI:
-- no payload strings are created) and returns; it never yields.
-- Per worker and topic, batches are cut by count, bytes or delay, one batch
-- per ordering key at a time; a pool of light threads in one timer sends
-- them over keep-alive connections, retrying transient failures with
-- backoff and jitter until a deadline. On worker exit (QUIT, HUP reload) the
-- buffer is flushed within a time budget and whatever is left is reported,
-- or, with a spool, written to disk and sent by a later worker.
-- The parts, in publish/: buffer.lua (the accepted messages), sender.lua,
-- report.lua (callbacks, warnings), shutdown.lua, stats.lua, auth.lua,
-- spool.lua and spoolfile.lua (the spool).


local semaphore = require "ngx.semaphore"
local http = require "resty.loom.http"
local auth = require "resty.loom.publish.auth"
local histogram = require "resty.loom.histogram"
local base64 = require "resty.loom.publish.base64"
local json = require "resty.loom.publish.json"
local buffer = require "resty.loom.publish.buffer"
local sender = require "resty.loom.publish.sender"
local shutdown = require "resty.loom.publish.shutdown"
local stats = require "resty.loom.publish.stats"
local spool = require "resty.loom.publish.spool"
local options = require "resty.loom.opts"

local ngx_now = ngx.now
local ngx_log = ngx.log
local ngx_ERR = ngx.ERR
local buf_new = require("string.buffer").new
local b64_into = base64.encode_into
local put_string = json.put_string
local fifo_new = buffer.fifo_new
local batch_for = buffer.batch_for
local added = buffer.added
local start = sender.start
local spool_put = spool.put
local parse_url = http.parse_url
local sub = string.sub
local match = string.match
local gsub = string.gsub
local floor = math.floor
local min = math.min
local type = type
local pairs = pairs
local next = next
local error = error
local setmetatable = setmetatable

local LOG_TAG = "[loom.publish] "
local MAX_MESSAGES = 1000             -- per publish request
local MAX_REQUEST_BYTES = 10000000    -- JSON body, per request
local MAX_ATTRIBUTES = 100
local MAX_KEY_BYTES = 256
local MAX_VALUE_BYTES = 1024
local MAX_ORDERING_KEY_BYTES = 1024
local ENVELOPE = #'{"messages":[]}'
local MAX_SECONDS = 86400
local DEFAULT_ENDPOINT = "https://pubsub.googleapis.com"
local ID_KEY = "loom_id"          -- the spool's id attribute

-- every publisher of this worker by name: for the stats collector and
-- init_worker()
local publishers = {}


local _M = { _VERSION = "0.2.0" }
local mt = { __index = _M }


-- Encodes the attribute after key k of t (the first for k == nil) into s,
-- as the count-th one. Returns its key; nil when there is none left, or
-- nil and why the attribute is refused. With a spool (idp), its id takes
-- one attribute and its key.
local function put_next_attribute(s, t, k, count, idp)
    local v
    k, v = next(t, k)
    if k == nil then
        return nil
    end
    if count > MAX_ATTRIBUTES or (idp and count == MAX_ATTRIBUTES) then
        return nil, "too many attributes"
    end
    if type(k) ~= "string" then
        return nil, "attribute key must be a string"
    end
    if idp and k == ID_KEY then
        return nil, "attribute key loom_id is reserved for the spool's id"
    end
    local klen = #k
    if klen == 0 or klen > MAX_KEY_BYTES then
        return nil, "attribute key must be 1 to 256 bytes"
    end
    if sub(k, 1, 4) == "goog" then
        return nil, "attribute key must not start with goog"
    end
    if type(v) ~= "string" then
        return nil, "attribute value must be a string"
    end
    if #v > MAX_VALUE_BYTES then
        return nil, "attribute value too long"
    end
    s:put(count == 1 and '"attributes":{' or ',')
    if not put_string(s, k) then
        return nil, "attribute key must be valid UTF-8"
    end
    s:put(':')
    if not put_string(s, v) then
        return nil, "attribute value must be valid UTF-8"
    end
    return k
end


-- ok, err = p:send(data, attributes?, ordering_key?)
-- Never yields. err: a validation message, "buffer full",
-- "ordering key paused" or "closed".
function _M.send(self, data, attributes, ordering_key)
    if type(data) ~= "string" then
        if data ~= nil then
            return nil, "data must be a string"
        end
        data = ""
    end
    local dlen = #data
    if dlen > MAX_REQUEST_BYTES then
        return nil, "message too large"
    end
    local key = ""
    if ordering_key ~= nil then
        if type(ordering_key) ~= "string" then
            return nil, "ordering key must be a string"
        end
        if #ordering_key > MAX_ORDERING_KEY_BYTES then
            return nil, "ordering key too long"
        end
        key = ordering_key
    end
    if self.closed then
        return nil, "closed"
    end

    -- the message before and after its data goes to two small buffers
    -- first: the data is base64-encoded straight into the batch once the
    -- message is known to be valid and where it goes
    local s = self.scratch
    s:reset()
    s:put(',{')
    local comma = ""
    local idp = self.id_prefix      -- with a spool: ids are given
    if attributes ~= nil then
        if type(attributes) ~= "table" then
            return nil, "attributes must be a table"
        end
        -- the first four attributes without a loop: LuaJIT aborts a trace
        -- that meets an inner loop, so a loop would leave send() and its
        -- caller interpreted up to it (more attributes still take it)
        local k, err = put_next_attribute(s, attributes, nil, 1, idp)
        if k ~= nil then
            k, err = put_next_attribute(s, attributes, k, 2, idp)
        end
        if k ~= nil then
            k, err = put_next_attribute(s, attributes, k, 3, idp)
        end
        if k ~= nil then
            k, err = put_next_attribute(s, attributes, k, 4, idp)
        end
        local count = 4
        while k ~= nil do
            count = count + 1
            k, err = put_next_attribute(s, attributes, k, count, idp)
        end
        if err then
            return nil, err
        end
        if #s > 2 then          -- more than the leading ',{'
            if idp then
                s:put(',"loom_id":"', idp, self.id_seq + 1, '"')
            end
            s:put('}')
            comma = ","
        end
    end
    -- the data is encoded last: with more than four attributes, only what
    -- follows their loop is compiled (as the loop's side trace)
    local b64len = 0
    local tail = self.scratch_tail
    tail:reset()
    if dlen > 0 then
        if idp and comma == "" then
            -- the spool's id as the only attribute
            s:put('"attributes":{"loom_id":"', idp, self.id_seq + 1, '"}')
            comma = ","
        end
        s:put(comma, '"data":"')
        b64len = floor((dlen + 2) / 3) * 4
        tail:put('"')
        comma = ","
    end
    if comma == "" then
        return nil, "message needs data or attributes"
    end
    if key ~= "" then
        tail:put(',"orderingKey":')
        if not put_string(tail, key) then
            return nil, "ordering key must be valid UTF-8"
        end
    end
    tail:put('}')
    local len = #s + b64len + #tail
    if len - 1 + ENVELOPE > MAX_REQUEST_BYTES then
        return nil, "message too large"
    end

    local now = ngx_now()
    local b, err = batch_for(self, key, len, now)
    if not b then
        return nil, err
    end
    local out = b.buf
    out:put(s)
    if b64len > 0 then
        out:commit(b64_into(out:reserve(b64len), data, dlen))
    end
    out:put(tail)
    added(self, b, len, now)
    if idp then
        self.id_seq = self.id_seq + 1
        local sp = self.spool_always
        if sp then
            -- in the spool before send() returns: a few stores
            spool_put(sp, b, key, out, len)
        end
    end
    if not self.running then
        local ok, err = start(self)
        if not ok then
            ngx_log(ngx_ERR, LOG_TAG, "failed to start the sender: ", err)
        end
    end
    return true
end


-- seals every open batch so senders take them now
function _M.flush(self)
    buffer.flush(self)
    return true
end


-- lets an ordering key that failed take messages again
function _M.resume(self, ordering_key)
    buffer.resume(self, ordering_key or "")
    return true
end


-- this worker's figures
function _M.stats(self)
    return stats.worker(self)
end


-- all = publish.stats_all(timeout): per publisher name, the figures of all
-- live workers merged (or of this worker when no events bus exists), plus
-- .workers (how many answered)
function _M.stats_all(timeout)
    return stats.all(publishers, timeout)
end


-- a project id, also a domain-scoped one (example.com:my-project)
local function is_project(v)
    return type(v) == "string" and match(v, "^[%w][%w.:-]*$") ~= nil
end


local function is_topic(v)
    return type(v) == "string" and #v >= 3 and #v <= 255
           and match(v, "^%a[%w%-_.~+%%]*$") ~= nil and sub(v, 1, 4) ~= "goog"
end


-- the emulator's address: http://<it> is a URL
local function is_host_port(v)
    return type(v) == "string" and parse_url("http://" .. v) ~= nil
end


-- a rule (see resty.loom.opts) saying what is wrong with a URL
local function url_rule(v)
    local what = "an http or https URL"
    if type(v) ~= "string" then
        return what
    end
    local scheme, err = parse_url(v)
    if not scheme then
        return what .. " (" .. err .. ")"
    end
end


local TEXT = options.nonempty

-- every option new() takes
local RULES = {
    project = options.test(is_project, "a project id"),
    topic = options.test(is_topic, "a topic id (3-255 characters, "
                                   .. "starting with a letter)"),
    credentials = options.table,        -- and publish/auth.lua's rules
    endpoint = url_rule,
    emulator_host = options.test(function(v)
        return v == false or is_host_port(v)
    end, "host:port or false"),
    ssl_verify = options.boolean,
    server_name = TEXT,
    batch_max_messages = options.whole(1, MAX_MESSAGES),
    batch_max_bytes = options.whole(1, MAX_REQUEST_BYTES - ENVELOPE),
    batch_max_delay = options.above(0, 3600),
    buffer_max_messages = options.whole(1, 1e9),
    buffer_max_bytes = options.whole(1, 1e12),
    overflow = options.one_of("reject", "drop_oldest"),
    concurrency = options.whole(1, 64),
    timeout = options.above(0, 3600),
    retry_deadline = options.above(0, MAX_SECONDS),
    retry_initial_backoff = options.above(0, 3600),
    retry_max_backoff = options.above(0, 3600),
    flush_timeout = options.above(0, 3600),
    warn_interval = options.above(0, MAX_SECONDS),
    on_success = options.func,
    on_error = options.func,
    user_project = TEXT,
    name = TEXT,
    spool = options.test(function(v)
        return type(v) == "string" and sub(v, 1, 1) == "/" and #v <= 3000
               and not match(v, "%z")
    end, "an absolute path (a directory)"),
    spool_mode = options.one_of("exit", "always"),
    spool_max_bytes = options.whole(65536, 1e12),
}


-- p = publish.new(opts): see docs/publish.md for every option. Every
-- option is checked before anything is created.
function _M.new(opts)
    options.check(opts, RULES, 2)
    local project, topic = opts.project, opts.topic
    if project == nil then
        error("opts.project is required", 2)
    end
    if topic == nil then
        error("opts.topic is required", 2)
    end
    local retry_initial = opts.retry_initial_backoff or 0.1
    local retry_max_backoff = opts.retry_max_backoff or 10
    if retry_initial > retry_max_backoff then
        error("opts.retry_initial_backoff must be at most "
              .. "opts.retry_max_backoff (" .. retry_max_backoff .. ")", 2)
    end
    local cred_opts = opts.credentials
    if cred_opts ~= nil then
        -- unused with the emulator, but a mistake in them must not wait
        -- for production
        auth.check(cred_opts, "opts.credentials", 2)
    end
    local emulator = opts.emulator_host
    if emulator == nil then
        emulator = os.getenv("PUBSUB_EMULATOR_HOST")
        if emulator == "" then
            emulator = nil
        elseif emulator and not is_host_port(emulator) then
            error("PUBSUB_EMULATOR_HOST must be host:port", 2)
        end
    end
    local endpoint = opts.endpoint or DEFAULT_ENDPOINT
    if emulator then
        endpoint = "http://" .. emulator
        cred_opts = { type = "none" }
    elseif cred_opts == nil then
        error("opts.credentials is required (or opts.emulator_host)", 2)
    end

    local scheme, host, port = parse_url(endpoint)
    local timeout = opts.timeout or 10
    local concurrency = opts.concurrency or 4
    local client = http.new({
        scheme = scheme, host = host, port = port,
        ssl_verify = opts.ssl_verify, server_name = opts.server_name,
        connect_timeout = min(timeout, 5), send_timeout = timeout,
        read_timeout = timeout, timeout = timeout,
        pool_size = concurrency * 2, keepalive_timeout = 60,
    })
    -- may still raise (a key that does not load, no such shared dict):
    -- the last check, and the first thing that stays (a shared credential)
    local cred = auth.new(cred_opts, "opts.credentials", 2)
    local user_project = opts.user_project
    local spool_dir = opts.spool
    if spool_dir == nil and (opts.spool_mode ~= nil
                             or opts.spool_max_bytes ~= nil)
    then
        error("opts.spool is required with opts.spool_mode or "
              .. "opts.spool_max_bytes", 2)
    end
    local phase = ngx.get_phase()
    if spool_dir then
        spool_dir = gsub(spool_dir, "/+$", "")
        if spool_dir == "" then
            spool_dir = "/"
        end
        if phase ~= "init" then
            -- in a worker, as the workers' user (in init, the master may
            -- run as root: publish.init_worker() checks)
            local ok, err = spool.check_dir(spool_dir)
            if not ok then
                return nil, err
            end
        end
    end

    local self = {
        name = opts.name or (project .. "/" .. topic),
        project = project,
        topic = topic,
        path = "/v1/projects/" .. project .. "/topics/" .. topic
               .. ":publish",
        headers = "Content-Type: application/json\r\n"
                  .. (user_project and ("X-Goog-User-Project: "
                      .. user_project .. "\r\n") or ""),
        batch_max_messages = opts.batch_max_messages or MAX_MESSAGES,
        batch_max_bytes = opts.batch_max_bytes or 1000000,
        batch_max_delay = opts.batch_max_delay or 0.05,
        buffer_max_messages = opts.buffer_max_messages or 100000,
        buffer_max_bytes = opts.buffer_max_bytes or 64 * 1024 * 1024,
        overflow = opts.overflow or "reject",
        concurrency = concurrency,
        timeout = timeout,
        retry_deadline = opts.retry_deadline or 60,
        retry_initial = retry_initial,
        retry_max_backoff = retry_max_backoff,
        flush_timeout = opts.flush_timeout or 3,
        warn_interval = opts.warn_interval or 10,
        on_success = opts.on_success,
        on_error = opts.on_error,
        cred = cred,
        client = client,
        -- state
        queues = {},
        opening = fifo_new(),    -- batches by creation time (deadlines)
        sealed = fifo_new(),     -- batches ready to go
        sending = {},            -- batches in flight (set)
        sema = semaphore.new(0),
        scratch = buf_new(2048),
        scratch_tail = buf_new(2048),
        free_bufs = {},
        backlog = false,         -- draining a big buffer: see buffer.settle()
        garbage = 0,             -- bytes of body pieces not yet collected
        running = false,
        recycling = false,       -- senders moving to a fresh timer
        recycle_at = 0,          -- self.requests when they do
        exiting = false,
        exit_deadline = nil,
        closed = false,
        run_fn = sender.run,
        exit_fn = sender.exit_watch,
        trouble = nil,           -- failures since the last warning
        -- the spool (spool.lua): its options, its files once set up in
        -- a worker, the ids given to messages
        spool_dir = spool_dir,
        spool_mode = spool_dir and (opts.spool_mode or "exit"),
        spool_max_bytes = opts.spool_max_bytes or 256 * 1024 * 1024,
        spool = nil,
        spool_always = nil,      -- the spool, in always mode
        id_prefix = nil,
        id_seq = 0,
        kept = {},               -- batches cut at exit, for the spool
        spool_setup_errors = 0,
        -- figures
        queued_messages = 0,
        queued_bytes = 0,
        inflight_messages = 0,
        inflight_bytes = 0,
        inflight = 0,
        sent = 0,
        failed = 0,
        retried = 0,
        dropped = 0,
        rejected = 0,
        batches = 0,
        batched_messages = 0,
        requests = 0,
        latency = histogram.new(),
    }
    setmetatable(self, mt)
    if phase ~= "init" and spool_dir then
        spool.setup(self, start)
    end
    if phase ~= "init" then
        local ok, err = self.cred:start()
        if not ok then
            return nil, err
        end
    end
    publishers[self.name] = self
    shutdown.add(self)
    stats.register_collector(publishers)
    return self
end


-- publish.exit_worker(), in exit_worker_by_lua*: hands whatever is still
-- buffered to on_error and logs the count. A fast stop (SIGTERM, nginx -s
-- stop) runs no timer and no cosocket: this hook is all that runs.
function _M.exit_worker()
    shutdown.exit_worker()
    return true
end


-- in init_worker, for publishers made in init: sets up their spools (a
-- spool that cannot be used is logged and counted: the publisher goes on
-- from memory) and starts their token refreshers
function _M.init_worker()
    for _, p in pairs(publishers) do
        if p.spool_dir and not p.spool then
            local ok, err = spool.check_dir(p.spool_dir)
            if ok then
                spool.setup(p, start)
            else
                p.spool_setup_errors = p.spool_setup_errors + 1
                ngx_log(ngx_ERR, LOG_TAG, p.name, ": ", err,
                        "; publishing from memory only")
            end
        end
    end
    for _, p in pairs(publishers) do
        local ok, err = p.cred:start()
        if not ok then
            return nil, err
        end
    end
    stats.register_collector(publishers)
    return true
end


return _M
