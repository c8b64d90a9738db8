-- Batched, non-blocking publishing to Google Cloud Pub/Sub.
--
-- send() validates a message against Pub/Sub's limits, encodes it straight
-- into the current batch's string.buffer (base64 written through the FFI:
-- no payload strings are created) and returns; it never yields.
-- Per worker and topic, batches are cut by count, bytes or delay, one batch
-- per ordering key at a time; a pool of light threads in one timer sends
-- them over keep-alive connections, retrying transient failures with
-- backoff and jitter until a deadline. On worker exit (QUIT, HUP reload) the
-- buffer is flushed within a time budget and whatever is left is reported.


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
local sub = string.sub
local tostring = tostring
local ipairs = ipairs
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

-- every publisher of this worker by name, for the stats collector
local publishers = {}


local _M = { _VERSION = "0.2.0" }
local mt = { __index = _M }


-- Encodes the attribute after key k of t (the first for k == nil) into s,
-- as the count-th one. Returns its key; nil when there is none left, or
-- nil and why the attribute is refused.
local function put_next_attribute(s, t, k, count)
    local v
    k, v = next(t, k)
    if k == nil then
        return nil
    end
    if count > MAX_ATTRIBUTES then
        return nil, "too many attributes"
    end
    if type(k) ~= "string" then
        return nil, "attribute key must be a string"
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
    if attributes ~= nil then
        if type(attributes) ~= "table" then
            return nil, "attributes must be a table"
        end
        -- the first four attributes without a loop: LuaJIT aborts a trace
        -- that meets an inner loop, so a loop would leave send() and its
        -- caller interpreted up to it (more attributes still take it)
        local k, err = put_next_attribute(s, attributes, nil, 1)
        if k ~= nil then
            k, err = put_next_attribute(s, attributes, k, 2)
        end
        if k ~= nil then
            k, err = put_next_attribute(s, attributes, k, 3)
        end
        if k ~= nil then
            k, err = put_next_attribute(s, attributes, k, 4)
        end
        local count = 4
        while k ~= nil do
            count = count + 1
            k, err = put_next_attribute(s, attributes, k, count)
        end
        if err then
            return nil, err
        end
        if #s > 2 then          -- more than the leading ',{'
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


-- every option new() takes
local OPTIONS = {
    project = true, topic = true, credentials = true, endpoint = true,
    emulator_host = true, ssl_verify = true, server_name = true,
    batch_max_messages = true, batch_max_bytes = true,
    batch_max_delay = true, buffer_max_messages = true,
    buffer_max_bytes = true, overflow = true, concurrency = true,
    timeout = true, retry_deadline = true, retry_initial_backoff = true,
    retry_max_backoff = true, flush_timeout = true, warn_interval = true,
    on_success = true, on_error = true, user_project = true, name = true,
}
local MAX_SECONDS = 86400


-- a number option: finite, above 0, at most hi, whole when integer
local function num(opts, name, default, hi, integer)
    local v = opts[name]
    if v == nil then
        return default
    end
    if type(v) ~= "number" or not (v > 0 and v <= hi)
       or (integer and v % 1 ~= 0)
    then
        error("opts." .. name .. " must be "
              .. (integer and "a whole number from 1" or "a number above 0")
              .. " to " .. hi, 3)
    end
    return v
end


local function str(opts, name)
    local v = opts[name]
    if v ~= nil and (type(v) ~= "string" or v == "") then
        error("opts." .. name .. " must be a non-empty string", 3)
    end
    return v
end


-- p = publish.new(opts): see docs/publish.md for every option. Every
-- option is checked before anything is created.
function _M.new(opts)
    if type(opts) ~= "table" then
        error("opts must be a table", 2)
    end
    for k in pairs(opts) do
        if not OPTIONS[k] then
            error("opts." .. tostring(k) .. ": unknown option", 2)
        end
    end
    local project, topic = opts.project, opts.topic
    if type(project) ~= "string" or not project:match("^[%w][%w.:-]*$") then
        error("opts.project must be a project id", 2)
    end
    if type(topic) ~= "string" or #topic < 3 or #topic > 255
       or not topic:match("^%a[%w%-_.~+%%]*$") or sub(topic, 1, 4) == "goog"
    then
        error("opts.topic must be a topic id (3-255 characters, starting "
              .. "with a letter)", 2)
    end
    local overflow = opts.overflow or "reject"
    if overflow ~= "reject" and overflow ~= "drop_oldest" then
        error("opts.overflow must be \"reject\" or \"drop_oldest\"", 2)
    end
    for _, cb in ipairs({ "on_success", "on_error" }) do
        if opts[cb] ~= nil and type(opts[cb]) ~= "function" then
            error("opts." .. cb .. " must be a function", 2)
        end
    end
    if opts.ssl_verify ~= nil and type(opts.ssl_verify) ~= "boolean" then
        error("opts.ssl_verify must be a boolean", 2)
    end
    local name = str(opts, "name")
    local user_project = str(opts, "user_project")
    local server_name = str(opts, "server_name")

    local emulator = opts.emulator_host
    if emulator == nil then
        emulator = os.getenv("PUBSUB_EMULATOR_HOST")
        if emulator == "" then
            emulator = nil
        end
    end
    local endpoint = opts.endpoint or "https://pubsub.googleapis.com"
    local cred_opts = opts.credentials
    if emulator then
        if type(emulator) ~= "string" then
            error("opts.emulator_host must be host:port or false", 2)
        end
        -- unused here, but a mistake in them must not wait for production
        if cred_opts ~= nil then
            auth.check(cred_opts, "opts.credentials")
        end
        endpoint = "http://" .. emulator
        cred_opts = { type = "none" }
    elseif cred_opts == nil then
        error("opts.credentials is required (or opts.emulator_host)", 2)
    end
    local scheme, host, port = http.parse_url(endpoint)
    if not scheme then
        error("opts.endpoint: " .. host, 2)
    end

    local timeout = num(opts, "timeout", 10, 3600)
    local concurrency = num(opts, "concurrency", 4, 64, true)
    local retry_initial = num(opts, "retry_initial_backoff", 0.1, 3600)
    local retry_max_backoff = num(opts, "retry_max_backoff", 10, 3600)
    if retry_initial > retry_max_backoff then
        error("opts.retry_initial_backoff must be at most "
              .. "opts.retry_max_backoff (" .. retry_max_backoff .. ")", 2)
    end
    local batch_max_messages = num(opts, "batch_max_messages", MAX_MESSAGES,
                                   MAX_MESSAGES, true)
    local batch_max_bytes = num(opts, "batch_max_bytes", 1000000,
                                MAX_REQUEST_BYTES - ENVELOPE, true)
    local batch_max_delay = num(opts, "batch_max_delay", 0.05, 3600)
    local buffer_max_messages = num(opts, "buffer_max_messages", 100000, 1e9,
                                    true)
    local buffer_max_bytes = num(opts, "buffer_max_bytes", 64 * 1024 * 1024,
                                 1e12, true)
    local retry_deadline = num(opts, "retry_deadline", 60, MAX_SECONDS)
    local flush_timeout = num(opts, "flush_timeout", 3, 3600)
    local warn_interval = num(opts, "warn_interval", 10, MAX_SECONDS)
    -- the credentials check their own options (and raise) before the
    -- client is made
    local cred = auth.new(cred_opts, "opts.credentials")

    local self = {
        name = name or (project .. "/" .. topic),
        project = project,
        topic = topic,
        path = "/v1/projects/" .. project .. "/topics/" .. topic
               .. ":publish",
        headers = "Content-Type: application/json\r\n"
                  .. (user_project and ("X-Goog-User-Project: "
                      .. user_project .. "\r\n") or ""),
        batch_max_messages = batch_max_messages,
        batch_max_bytes = batch_max_bytes,
        batch_max_delay = batch_max_delay,
        buffer_max_messages = buffer_max_messages,
        buffer_max_bytes = buffer_max_bytes,
        overflow = overflow,
        concurrency = concurrency,
        timeout = timeout,
        retry_deadline = retry_deadline,
        retry_initial = retry_initial,
        retry_max_backoff = retry_max_backoff,
        flush_timeout = flush_timeout,
        warn_interval = warn_interval,
        on_success = opts.on_success,
        on_error = opts.on_error,
        cred = cred,
        client = http.new({
            scheme = scheme, host = host, port = port,
            ssl_verify = opts.ssl_verify, server_name = server_name,
            connect_timeout = min(timeout, 5), send_timeout = timeout,
            read_timeout = timeout, timeout = timeout,
            pool_size = concurrency * 2, keepalive_timeout = 60,
        }),
        -- state
        queues = {},
        opening = fifo_new(),    -- batches by creation time (deadlines)
        sealed = fifo_new(),     -- batches ready to go
        sending = {},            -- batches in flight (set)
        sema = semaphore.new(0),
        scratch = buf_new(2048),
        scratch_tail = buf_new(2048),
        free_bufs = {},
        backlog = false,         -- draining a big buffer: see dispatch()
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
    local phase = ngx.get_phase()
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


-- in init_worker, for publishers made in init: starts token refreshers
function _M.init_worker()
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
