-- Copyright (C) resty-loom authors
--
-- resty.loom.offload: non-blocking calls into native runtimes (shared
-- libraries implementing include/loom_offload.h) that run on their own
-- threads; the calling coroutine yields until the answer comes back.


local ffi = require "ffi"
local base = require "resty.core.base"
local options = require "resty.loom.opts"
local yield = require("resty.loom.yield").yield
require "resty.core.phase"
require "ngx.semaphore"     -- declares ngx_http_lua_sema_t and its FFI


-- string.buffer (OpenResty's LuaJIT) for payloads and answers, optional
local BUFFER_MT
do
    local ok, buffer = pcall(require, "string.buffer")
    if ok then
        BUFFER_MT = getmetatable(buffer.new())
    end
end


local C = ffi.C
local ffi_new = ffi.new
local ffi_str = ffi.string
local get_request = base.get_request
local get_string_buf = base.get_string_buf
local get_size_ptr = base.get_size_ptr
local co_yield = coroutine._yield
local ngx_get_phase = ngx.get_phase
local ngx_sleep = ngx.sleep
local ngx_now = ngx.now
local ngx_update_time = ngx.update_time
local ngx_worker_id = ngx.worker.id
local type = type
local getmetatable = getmetatable
local error = error
local tostring = tostring
local setmetatable = setmetatable
local str_find = string.find
local pcall = pcall
local math_floor = math.floor


ffi.cdef[[
typedef struct loom_offload_queue_s  loom_offload_queue_t;
typedef struct loom_offload_task_s   loom_offload_task_t;

typedef struct {
    double  state;
    double  threads;
    double  queued;
    double  running;
    double  submitted;
    double  completed;
    double  errors;
    double  timeouts;
    double  rejected;
    double  closed;
    double  aborted;
    double  late;
    double  lat_n;
    double  lat_mean;
    double  lat_max;
    double  p50;
    double  p90;
    double  p99;
    double  p999;
    double  polled;
    double  polled_hits;
    double  peak_queued;
    double  reclaimed;
    double  misused;
} ngx_loom_offload_stats_t;

int ngx_loom_offload_ffi_load(const char *path, const char *config,
    size_t config_len, int threads, int bound, int grace_ms, int spin_us,
    int poll_us, int reclaim_ms, int global, loom_offload_queue_t **out,
    unsigned char *err, size_t *errlen);
int ngx_loom_offload_ffi_poll(loom_offload_task_t *t);
int ngx_loom_offload_ffi_submit(ngx_http_request_t *r,
    loom_offload_queue_t *q, const char *name, size_t name_len,
    const char *data, size_t len, loom_offload_task_t **out,
    ngx_http_lua_sema_t **sem);
int ngx_loom_offload_ffi_result(loom_offload_task_t *t, const char **data,
    size_t *len);
void ngx_loom_offload_ffi_release(loom_offload_task_t *t);
int ngx_loom_offload_ffi_cancel(loom_offload_task_t *t);
int ngx_loom_offload_ffi_state(loom_offload_queue_t *q, const char **err);
int ngx_loom_offload_ffi_close(loom_offload_queue_t *q);
void ngx_loom_offload_ffi_stats(loom_offload_queue_t *q,
    ngx_loom_offload_stats_t *st);
void ngx_loom_offload_ffi_histogram(loom_offload_queue_t *q, int which,
    const double *le, int n, double *out);
]]


local loom_load = C.ngx_loom_offload_ffi_load
local loom_submit = C.ngx_loom_offload_ffi_submit
local loom_poll = C.ngx_loom_offload_ffi_poll
local loom_result = C.ngx_loom_offload_ffi_result
local loom_release = C.ngx_loom_offload_ffi_release
local loom_cancel = C.ngx_loom_offload_ffi_cancel
local loom_state = C.ngx_loom_offload_ffi_state
local loom_close = C.ngx_loom_offload_ffi_close
local loom_stats = C.ngx_loom_offload_ffi_stats
local sema_wait = C.ngx_http_lua_ffi_sema_wait


local FFI_OK = base.FFI_OK
local FFI_AGAIN = base.FFI_AGAIN
local FFI_BUSY = base.FFI_BUSY
local FFI_DECLINED = base.FFI_DECLINED
local FFI_BAD_CONTEXT = base.FFI_BAD_CONTEXT

local RESULT_OK = 0
local RESULT_ERROR = 1
local RESULT_CLOSED = 2

local ERR_BUF_SIZE = 256

local DEFAULT_THREADS = 2
local DEFAULT_QUEUE = 1024
local DEFAULT_TIMEOUT = 10
local DEFAULT_GRACE = 5
local DEFAULT_SPIN_US = 60
local DEFAULT_POLL_US = 10
local DEFAULT_RECLAIM = 60
-- ngx.semaphore waits take an int of milliseconds: about 24.8 days
local MAX_TIMEOUT = 2e6

-- the options of load() and call()
local LOAD_RULES = {
    threads = options.whole(1, 1024),
    queue = options.whole(1, 1e8),
    timeout = options.number(0.001, MAX_TIMEOUT),       -- s
    grace = options.number(0, 86400),                   -- s
    spin_us = options.whole(0, 1e6),
    poll_us = options.whole(0, 1e6),
    reclaim = options.number(0.001, MAX_TIMEOUT),       -- s
    global = options.boolean,
}

local CALL_RULES = {
    timeout = options.above(0, MAX_TIMEOUT),            -- s
    into = options.test(function(v)
        return BUFFER_MT ~= nil and getmetatable(v) == BUFFER_MT
    end, "a string.buffer"),
}

local STATES = { [0] = "starting", "ready", "failed", "closed" }

-- calls answered in a row without yielding before call() yields once
local FAST_STREAK_MAX = 64

-- contexts where the calling coroutine may yield
local YIELDABLE = {
    rewrite = true,
    server_rewrite = true,
    access = true,
    content = true,
    timer = true,
}


-- scratch cdata, used only between an FFI call and the next yield
local ptask = ffi_new("loom_offload_task_t *[1]")
local psem = ffi_new("ngx_http_lua_sema_t *[1]")
local pdata = ffi_new("const char *[1]")
local plen = ffi_new("size_t[1]")
local pqueue = ffi_new("loom_offload_queue_t *[1]")
local perr = ffi_new("const char *[1]")
local stats_buf = ffi_new("ngx_loom_offload_stats_t")


-- runtimes loaded by this worker, by path and configuration
local loaded = {}
local loaded_list = {}

local fast_streak = 0


local function resolve_path(name)
    if str_find(name, "/", 1, true) then
        return name
    end

    local path = package.searchpath(name, package.cpath)
    if path then
        return path
    end

    -- let dlopen() search the system directories
    if str_find(name, ".so", 1, true) then
        return name
    end

    return "lib" .. name .. ".so"
end


local _M = { _VERSION = "0.2.0" }
local mt = { __index = _M }


function _M.load(name, config, opts)
    if type(name) ~= "string" or name == "" then
        error("name must be a non-empty string", 2)
    end

    if config ~= nil and type(config) ~= "string" then
        error("config must be a string", 2)
    end

    -- nil or false: no options (`t and { timeout = t }` is common)
    if opts then
        options.check(opts, LOAD_RULES, 2)
    end

    config = config or ""
    opts = opts or {}

    local threads = opts.threads or DEFAULT_THREADS
    local queue = opts.queue or DEFAULT_QUEUE
    local timeout = opts.timeout or DEFAULT_TIMEOUT
    local grace = opts.grace or DEFAULT_GRACE
    local spin_us = opts.spin_us or DEFAULT_SPIN_US
    local poll_us = opts.poll_us or DEFAULT_POLL_US
    local reclaim = opts.reclaim or DEFAULT_RECLAIM

    if ngx_get_phase() == "init" then
        error("runtimes are loaded per worker: call offload.load() in "
              .. "init_worker_by_lua* or later", 2)
    end

    local path = resolve_path(name)
    local key = path .. "\0" .. config

    local rt = loaded[key]
    if rt then
        return rt
    end

    local err = get_string_buf(ERR_BUF_SIZE)
    local errlen = get_size_ptr()
    errlen[0] = ERR_BUF_SIZE

    local rc = loom_load(path, config, #config, threads, queue,
                         grace * 1000, spin_us, poll_us,
                         math_floor(reclaim * 1000 + 0.5),
                         opts.global and 1 or 0,
                         pqueue, err, errlen)

    if rc == FFI_BAD_CONTEXT then
        return nil, ffi_str(err, errlen[0])
    end

    if rc ~= FFI_OK then
        return nil, "failed to load " .. name .. ": "
                    .. ffi_str(err, errlen[0])
    end

    rt = setmetatable({
        name = name,
        path = path,
        config = config,
        timeout_ms = math_floor(timeout * 1000 + 0.5),
        queue = pqueue[0],
    }, mt)

    loaded[key] = rt
    loaded_list[#loaded_list + 1] = rt

    return rt
end


function _M.call(self, payload, opts, named_opts)
    local name, name_len = nil, 0

    if type(opts) == "string"
       or BUFFER_MT and getmetatable(opts) == BUFFER_MT
    then
        -- rt:call(name, data[, opts]) for runtimes that dispatch by name
        -- (Lua, Java): the request is the name, a NUL byte, the data,
        -- put together by the submission (one copy of the data)
        if type(payload) ~= "string" or payload == ""
           or str_find(payload, "\0", 1, true)
        then
            error("name must be a non-empty string without NUL bytes", 2)
        end

        name, name_len = payload, #payload
        payload = opts
        opts = named_opts
    end

    -- nil or false: no options (`t and { timeout = t }` is common)
    if opts then
        options.check(opts, CALL_RULES, 2)
    end

    local phase = ngx_get_phase()
    if not YIELDABLE[phase] then
        return nil, "API disabled in the context of " .. phase
    end

    local r = get_request()

    local timeout_ms = self.timeout_ms
    local into

    if opts then
        local t = opts.timeout
        if t then
            timeout_ms = math_floor(t * 1000 + 0.5)
            if timeout_ms < 1 then
                timeout_ms = 1
            end
        end

        into = opts.into
    end

    local data, len
    if type(payload) == "string" then
        data, len = payload, #payload

    elseif BUFFER_MT and getmetatable(payload) == BUFFER_MT then
        -- a string.buffer: its bytes are read in place
        data, len = payload:ref()

    else
        error("payload must be a string or a string.buffer", 2)
    end

    local rc = loom_submit(r, self.queue, name, name_len, data, len, ptask,
                           psem)

    if rc ~= FFI_OK then
        if rc == FFI_BUSY then
            return nil, "queue full"
        end

        if rc == FFI_DECLINED then
            return nil, "closed"
        end

        return nil, "failed to submit: no memory"
    end

    local task = ptask[0]

    local pause = false

    if loom_poll(task) == 1 then
        -- answered while the event loop polled: no yield. Yield now and
        -- then all the same (below), so that a loop of fast calls does
        -- not keep other requests waiting
        fast_streak = fast_streak + 1
        if fast_streak >= FAST_STREAK_MAX then
            fast_streak = 0
            pause = true
        end

    else
        fast_streak = 0

        local err = get_string_buf(ERR_BUF_SIZE)
        local errlen = get_size_ptr()
        errlen[0] = ERR_BUF_SIZE

        rc = sema_wait(r, psem[0], timeout_ms, err, errlen)

        local ok, werr
        if rc == FFI_AGAIN then
            ok, werr = co_yield()

        elseif rc == FFI_OK then
            ok = true

        else
            werr = ffi_str(err, errlen[0])
            loom_cancel(task)
            return nil, "failed to wait: " .. werr
        end

        if not ok and loom_cancel(task) == 0 then
            if werr == "timeout" then
                return nil, "timeout"
            end

            return nil, "failed to wait: " .. tostring(werr)
        end
    end

    local status = loom_result(task, pdata, plen)

    if status == RESULT_OK then
        local res
        if into then
            into:putcdata(pdata[0], plen[0])
            res = into

        else
            res = ffi_str(pdata[0], plen[0])
        end

        loom_release(task)

        if pause then
            yield()
        end

        return res
    end

    if status == RESULT_CLOSED then
        loom_release(task)
        return nil, "closed"
    end

    local msg = status == RESULT_ERROR and ffi_str(pdata[0], plen[0])
                or "no memory"
    loom_release(task)

    return nil, "runtime error: " .. msg
end


-- "starting", "ready", "failed" or "closed", and the start-up error
function _M.state(self)
    local st = loom_state(self.queue, perr)
    local name = STATES[st]

    if name == "failed" then
        return name, ffi_str(perr[0])
    end

    return name
end


function _M.wait_ready(self, timeout)
    if timeout ~= nil and (type(timeout) ~= "number"
                           or not (timeout >= 0 and timeout <= MAX_TIMEOUT))
    then
        error("timeout must be a number from 0 to " .. MAX_TIMEOUT, 2)
    end

    ngx_update_time()
    local deadline = ngx_now() + (timeout or self.timeout_ms / 1000)
    local delay = 0.001

    while true do
        local st, err = _M.state(self)

        if st == "ready" then
            return true
        end

        if st == "failed" then
            return nil, "failed to start: " .. err
        end

        if st == "closed" then
            return nil, "closed"
        end

        ngx_update_time()
        if ngx_now() >= deadline then
            return nil, "timeout"
        end

        ngx_sleep(delay)
        if delay < 0.05 then
            delay = delay * 2
        end
    end
end


-- closes the queue: waiting and later calls get "closed"
function _M.close(self)
    loom_close(self.queue)
    return true
end


function _M.stats(self)
    loom_stats(self.queue, stats_buf)
    local s = stats_buf

    return {
        name = self.name,
        path = self.path,
        worker = ngx_worker_id(),
        state = STATES[s.state],
        threads = s.threads,
        queued = s.queued,
        running = s.running,
        in_flight = s.queued + s.running,
        submitted = s.submitted,
        completed = s.completed,
        errors = s.errors,
        timeouts = s.timeouts,
        rejected = s.rejected,
        closed = s.closed,
        aborted = s.aborted,
        late = s.late,
        polled = s.polled,
        polled_hits = s.polled_hits,
        peak_queued = s.peak_queued,
        reclaimed = s.reclaimed,
        misused = s.misused,
        -- round trips, in microseconds
        latency = {
            count = s.lat_n,
            mean = s.lat_mean,
            max = s.lat_max,
            p50 = s.p50,
            p90 = s.p90,
            p99 = s.p99,
            p999 = s.p999,
        },
    }
end


local HIST_WHICH = { call = 0, wait = 1 }


-- rt:histogram(which, le): the call-time ("call": submit to answer) or
-- queue-wait ("wait": submit to a thread taking the call) histogram as
-- cumulative counts at the increasing upper bounds le (seconds), each
-- internal bucket counted at the first bound at or above its middle:
-- { buckets = {...}, count = n, sum = seconds }
function _M.histogram(self, which, le)
    local w = HIST_WHICH[which]
    if not w then
        error("which must be \"call\" or \"wait\"", 2)
    end
    local n = #le
    local out = ffi_new("double[?]", n + 2)
    C.ngx_loom_offload_ffi_histogram(self.queue, w,
                                     ffi_new("double[?]", n, le), n, out)
    local buckets = {}
    for i = 1, n do
        buckets[i] = out[i - 1]
    end
    return { buckets = buckets, count = out[n], sum = out[n + 1] }
end


-- the runtimes this worker loaded
function _M.runtimes()
    local res = {}
    for i = 1, #loaded_list do
        res[i] = loaded_list[i]
    end
    return res
end


-- stats of every runtime this worker loaded
function _M.worker_stats()
    local res = {}
    for i = 1, #loaded_list do
        res[i] = _M.stats(loaded_list[i])
    end

    return res
end


local COLLECTOR = "loom.offload"


-- registers worker_stats with resty.loom.events (call in init or
-- init_worker); collect() then gathers every worker's figures
function _M.register_collector()
    local ok, events = pcall(require, "resty.loom.events")
    if not ok or type(events) ~= "table" or not events.register_collector
    then
        return nil, "resty.loom.events not available"
    end

    events.register_collector(COLLECTOR, _M.worker_stats)
    return true
end


-- { [worker_id] = { stats, ... }, ... } from all workers when an events
-- bus exists, else from this worker only (second value "local")
function _M.collect(timeout)
    local ok, events = pcall(require, "resty.loom.events")
    local bus = ok and type(events) == "table" and events.get
                and events.get()

    if bus then
        local res, err = bus:collect(COLLECTOR, timeout or 1)
        if res then
            return res
        end

        return nil, "failed to collect: " .. tostring(err)
    end

    local id = ngx_worker_id() or 0
    return { [id] = _M.worker_stats() }, "local"
end


return _M
