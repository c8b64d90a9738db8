-- Once-per-cluster timers: timer.every({ unique = "cluster", ... }, fn).
--
-- Every worker of every node runs two local timers: a renewer (every
-- ttl/3) that takes or keeps a lease in Redis (SET NX PX, with INCR of a
-- fencing epoch when taken), and a ticker that asks Redis, atomically,
-- whether this worker still holds the lease and the current period (from
-- Redis's clock) has not run yet; only then does it call the callback,
-- with the epoch. A holder that dies is replaced within ttl + ttl/3.


local rconn = require "resty.loom.cluster.redis"
local options = require "resty.loom.opts"

local ngx_log = ngx.log
local ngx_now = ngx.now
local timer_every = ngx.timer.every
local floor = math.floor
local min = math.min
local random = math.random
local type = type
local tostring = tostring
local error = error
local str_format = string.format

local LOG_TAG = "[loom.cluster.timer] "
local POOL_IDLE = 60000
local POOL_SIZE = 8
local RULES = {
    unique = options.one_of("cluster"),
    interval = options.number(0.01, 86400 * 366),
    name = options.text(200),
    ttl = options.number(0.1, 3600),
    cluster = options.test(function(c)
        return type(c) == "table" and type(c.redis) == "table"
    end, "a resty.loom.cluster"),
    -- as resty.loom.timer's own, checked here before any lease timer starts
    max_run_time = options.above(0, 1e9),
}

-- The scripts start with "#!lua" (no flags): Redis then refuses them on
-- a replica with READONLY before they run, reads included, so a demoted
-- master found in the pool is never used.

-- KEYS: lease, epoch; ARGV: token, ttl ms. Returns the holder's epoch,
-- or 0 when another holds the lease.
local ACQUIRE = [[#!lua
if redis.call('GET', KEYS[1]) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return tonumber(redis.call('GET', KEYS[2])) or redis.call('INCR', KEYS[2])
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return redis.call('INCR', KEYS[2])
end
return 0
]]

-- KEYS: lease, epoch, last period; ARGV: token, interval ms.
-- Returns { epoch, period } when this holder is to run the period now,
-- { 0, 0 } when it does not hold the lease, { -1, 0 } when another
-- holder ran it. The last period key holds "<period> <token>": the
-- holder that took a period gets it again (its reply may have been lost
-- on the way) and runs it if it has not yet (st.ran).
local RUN = [[#!lua
local epoch = tonumber(redis.call('GET', KEYS[2]))
if redis.call('GET', KEYS[1]) ~= ARGV[1] or not epoch then
    return { 0, 0 }
end
local t = redis.call('TIME')
local k = math.floor((t[1] * 1000 + math.floor(t[2] / 1000)) / ARGV[2])
local last, by = string.match(redis.call('GET', KEYS[3]) or '-1',
                              '^(%-?%d+) ?(.*)$')
last = tonumber(last) or -1
if k < last or (k == last and by ~= ARGV[1]) then
    return { -1, 0 }
end
if k > last then
    redis.call('SET', KEYS[3], k .. ' ' .. ARGV[1])
end
return { epoch, k }
]]

-- KEYS: lease; ARGV: token
local RELEASE = [[#!lua
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
]]

-- KEYS: epoch; ARGV: epoch
local FENCE = [[#!lua
return tonumber(redis.call('GET', KEYS[1]) or 0) == tonumber(ARGV[1])
       and 1 or 0
]]


local _M = { _VERSION = "0.2.0" }

local by_name = {}      -- name -> timer state, for fence()


-- runs a script on the master; once more on a new connection when a
-- pooled one failed or the master moved (running a script twice never
-- runs a period twice)
local function eval(conf, script, nkeys, ...)
    local res, err
    for _ = 1, 2 do
        local red
        red, err = rconn.connect(conf, 2)
        if not red then
            return nil, err
        end
        local reused = red:get_reused_times() > 0
        res, err = red:eval(script, nkeys, ...)
        if res ~= nil and res ~= false then
            red:set_keepalive(POOL_IDLE, POOL_SIZE)
            return res
        end
        red:close()
        if not rconn.failed(conf, res, err) and not (reused and res == nil)
        then
            break
        end
    end
    return nil, err
end


local function log_failure(st, what, err)
    local now = ngx_now()
    if now - st.logged >= 10 then
        st.logged = now
        ngx_log(rconn.log_level(err), LOG_TAG, st.name, ": failed to ",
                what, ": ", tostring(err))
    end
end


local function renew(premature, st)
    local conf = st.cluster.redis
    if premature then
        if st.epoch then
            eval(conf, RELEASE, 1, st.lease, st.token)
        end
        return
    end
    -- ngx.timer.every does not wait for the last run: while Redis is slow
    -- to answer, one renewal at a time
    if st.renewing then
        return
    end
    st.renewing = true
    local res, err = eval(conf, ACQUIRE, 2, st.lease, st.epoch_key,
                          st.token, st.ttl_ms)
    st.renewing = false
    if not res then
        -- the lease may still be this worker's: keep checking periods
        -- (RUN checks the lease in Redis) so that a holder does not wait
        -- for its next renewal once Redis is back
        log_failure(st, "renew the lease", err)
        return
    end
    st.epoch = type(res) == "number" and res > 0 and res or nil
end


local function tick(premature, st, callback, ...)
    if premature or not st.epoch then
        return
    end
    local res, err = eval(st.cluster.redis, RUN, 3, st.lease, st.epoch_key,
                          st.last_key, st.token, st.interval_ms)
    if not res then
        log_failure(st, "check the period", err)
        return
    end
    local epoch, period = res[1], res[2]
    if epoch == 0 then
        st.epoch = nil              -- the lease went to another worker
    elseif epoch > 0 and period ~= st.ran then
        st.ran = period
        return callback(false, epoch, period, ...)
    end
end


-- every(timer, opts, callback, ...) -> handle | nil, err (timer: the
-- resty.loom.timer module, which schedules the local ticks)
function _M.every(timer, opts, callback, ...)
    options.check(opts, RULES, 3)
    local interval, name = opts.interval, opts.name
    if interval == nil then
        error("opts.interval is required", 3)
    end
    if name == nil then
        error("opts.name is required", 3)
    end
    local ttl = opts.ttl or 3
    local c = opts.cluster or require("resty.loom.cluster").get()
    if c == nil then
        error("opts.cluster is required when no resty.loom.cluster was made "
              .. "yet", 3)
    end
    if type(callback) ~= "function" then
        error("callback must be a function", 3)
    end
    if by_name[name] then
        return nil, "name taken"
    end
    local prefix = c.stream .. ":timer:" .. name
    local st = {
        name = name,
        cluster = c,
        lease = prefix,
        epoch_key = prefix .. ":epoch",
        last_key = prefix .. ":period",
        token = str_format("%s/%d/%d/%d", c.node_id, ngx.worker.pid(),
                           floor(ngx_now() * 1000), random(1e9)),
        ttl_ms = floor(ttl * 1000),
        interval_ms = floor(interval * 1000),
        epoch = nil,
        ran = nil,          -- the last period this worker ran
        renewing = false,
        logged = 0,
    }
    local ok, err = timer_every(ttl / 3, renew, st)
    if not ok then
        return nil, "failed to start the lease: " .. tostring(err)
    end
    ok, err = ngx.timer.at(0, renew, st)     -- take it now, if free
    if not ok then
        return nil, "failed to start the lease: " .. tostring(err)
    end
    -- a period starts at most a quarter of it (or ttl/3) late
    local h
    h, err = timer.every({ interval = min(interval / 4, ttl / 3),
                           name = "cluster:" .. name,
                           max_run_time = opts.max_run_time },
                         tick, st, callback, ...)
    if not h then
        return nil, err
    end
    by_name[name] = st
    return h
end


-- true while `epoch` is still the current epoch of the named timer's
-- lease; nil, "stale epoch" once another holder has taken it since
function _M.fence(name, epoch)
    local st = by_name[name]
    if not st then
        error("no cluster timer named " .. tostring(name), 2)
    end
    local res, err = eval(st.cluster.redis, FENCE, 1, st.epoch_key, epoch)
    if not res then
        return nil, "failed to check the epoch: " .. tostring(err)
    end
    if res ~= 1 then
        return nil, "stale epoch"
    end
    return true
end


return _M
