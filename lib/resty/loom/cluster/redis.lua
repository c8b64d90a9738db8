-- Connections to the cluster's Redis master: directly, or found through
-- Sentinel (ask each Sentinel in turn, promote the one that answered, and
-- check ROLE on every new connection: a demoted master is never written
-- to). The master's address is kept in the worker's copy of the conf and
-- asked again only when it fails: a refused connection, a ROLE that is not
-- master, a socket error or a READONLY/MASTERDOWN reply (see failed()).
-- Each worker also follows the Sentinels' failover events (watch()): from
-- the moment one is about to promote a replica until it names the new
-- master, nothing is written anywhere, so no write lands on the old master
-- after the promotion (such writes are lost when it is demoted).
-- Also the validation of the `redis` option and the reconnect backoff, which
-- the cluster bus and the cluster timers share.


local ok_redis, redis = pcall(require, "nginx.redis")    -- Debian's path
if not ok_redis then
    redis = require "resty.redis"
end
local options = require "resty.loom.opts"

local ngx_null = ngx.null
local ngx_now = ngx.now
local ngx_sleep = ngx.sleep
local ngx_log = ngx.log
local ngx_NOTICE = ngx.NOTICE
local ngx_ERR = ngx.ERR
local ngx_WARN = ngx.WARN
local worker_exiting = ngx.worker.exiting
local thread_spawn = ngx.thread.spawn
local thread_wait = ngx.thread.wait
local timer_at = ngx.timer.at
local unpack = unpack
local str_match = string.match
local random = math.random
local min = math.min
local type = type
local tostring = tostring
local error = error
local pairs = pairs
local str_find = string.find

local LOG_TAG = "[loom.cluster] "

-- the Sentinel events watch() follows: the leader Sentinel is about to
-- send REPLICAOF NO ONE to the replica it chose (pause), the failover was
-- given up (resume), the new master (resume there)
local WATCHED = { "+failover-state-send-slaveof-noone", "-failover-abort-*",
                  "+failover-end-for-timeout", "+switch-master" }
-- a pause ends at the latest this long after it began (a lost message
-- must not stop the node): then the Sentinels are asked again
local PAUSE_MAX = 10
-- how often a follower looks up from its subscription (worker exit)
local WATCH_READ = 1

local HOST = options.text(255)
local PORT = options.whole(1, 65535)

-- a list of 1 to 64 tables, and nothing else
local function is_sentinels(v)
    if type(v) ~= "table" or #v < 1 or #v > 64 then
        return false
    end
    local n = 0
    for _, s in pairs(v) do
        if type(s) ~= "table" then
            return false
        end
        n = n + 1
    end
    return n == #v
end

local RULES = {
    host = HOST,
    port = PORT,
    sentinels = options.test(is_sentinels,
                             "a list of 1 to 64 { host = ..., port = ... }"),
    master_name = options.text(255),
    password = options.nonempty,
    db = options.whole(0, 65535),
    connect_timeout = options.number(0.001, 60),
}
local SENTINEL_RULES = { host = HOST, port = PORT }


local _M = { _VERSION = "0.2.0" }

-- the lua-resty-redis module found (Debian's nginx.redis or OpenResty's
-- resty.redis), for the tests' and benchmarks' own Redis calls
_M.driver = redis

-- what connect() returns during a failover: an expected state, logged at
-- notice level (log_level)
local FAILOVER = "failover in progress"


-- validates opts.redis and returns a private copy (level: error level of
-- the user's call)
function _M.check(r, level)
    level = level + 1
    options.check(r, RULES, level, "opts.redis")
    -- gen: bumped when the master changes or a failover starts;
    -- connections made under another gen are not used again
    local conf = { port = 6379, db = r.db or 0,
                   connect_timeout = r.connect_timeout or 1,
                   password = r.password, gen = 0 }
    if r.sentinels ~= nil then
        if r.host ~= nil or r.port ~= nil then
            error("opts.redis takes host/port or sentinels, not both", level)
        end
        local list = {}
        for i = 1, #r.sentinels do
            local s = r.sentinels[i]
            local path = "opts.redis.sentinels[" .. i .. "]"
            options.check(s, SENTINEL_RULES, level, path)
            if s.host == nil then
                error(path .. ".host is required", level)
            end
            list[i] = { host = s.host, port = s.port or 26379 }
        end
        if r.master_name == nil then
            error("opts.redis.master_name is required with "
                  .. "opts.redis.sentinels", level)
        end
        conf.sentinels = list
        conf.master_name = r.master_name
    else
        if r.master_name ~= nil then
            error("opts.redis.master_name needs opts.redis.sentinels", level)
        end
        if r.host == nil then
            error("opts.redis.host or opts.redis.sentinels is required",
                  level)
        end
        conf.host = r.host
        conf.port = r.port or 6379
    end
    return conf
end


-- the master's address from the Sentinels; the one that answers moves to
-- the head of the list (this worker's copy)
local function discover(conf)
    local list = conf.sentinels
    local last
    for i = 1, #list do
        local s = list[i]
        local red = redis:new()
        red:set_timeout(conf.connect_timeout * 1000)
        local ok, err = red:connect(s.host, s.port)
        if ok then
            local res
            res, err = red["sentinel"](red, "get-master-addr-by-name",
                                       conf.master_name)
            red:close()
            if type(res) == "table" and res[1] and res[1] ~= ngx_null then
                if i > 1 then
                    list[1], list[i] = list[i], list[1]
                end
                return res[1], tonumber(res[2])
            end
            err = err or "master unknown"
        end
        last = s.host .. ":" .. s.port .. ": " .. tostring(err)
    end
    return nil, nil, "no sentinel knows the master (" .. tostring(last) .. ")"
end


-- a new connection to host:port, ready for commands; pooled ones were
-- made ready (and checked) when they were new
local function open(conf, host, port, read_timeout)
    local red = redis:new()
    red:set_timeout(conf.connect_timeout * 1000)
    -- a pool of our own: its connections are authenticated (with this
    -- password: another conf's must not get them), on conf.db, and were a
    -- master when made
    local ok, err = red:connect(host, port, {
        pool = "loom.cluster:" .. host .. ":" .. port .. ":" .. conf.db
               .. ":" .. (conf.password and ngx.crc32_long(conf.password)
                          or ""),
    })
    if not ok then
        return nil, host .. ":" .. port .. ": " .. tostring(err)
    end
    red:set_timeout(read_timeout * 1000)
    if red:get_reused_times() > 0 then
        return red
    end
    if conf.password then
        ok, err = red:auth(conf.password)
        if not ok then
            red:close()
            return nil, "auth: " .. tostring(err)
        end
    end
    if conf.db ~= 0 then
        ok, err = red:select(conf.db)
        if not ok then
            red:close()
            return nil, "select: " .. tostring(err)
        end
    end
    if conf.sentinels then
        -- a Sentinel may still name a master that was just demoted
        local role
        role, err = red:role()
        if type(role) ~= "table" or role[1] ~= "master" then
            red:close()
            return nil, host .. ":" .. port .. " is not a master ("
                        .. tostring(role and role[1] or err) .. ")"
        end
    end
    return red
end


-- connect(conf, read_timeout_s) -> red | nil, err
-- read_timeout: seconds for every later reply (longer than any BLOCK).
-- Give a connection back with set_keepalive only after a reply that was
-- not an error; after an error, close it and call failed().
function _M.connect(conf, read_timeout)
    if not conf.sentinels then
        return open(conf, conf.host, conf.port, read_timeout)
    end
    local paused = conf.paused_until
    if paused then
        if ngx_now() < paused then
            return nil, FAILOVER
        end
        conf.paused_until = nil
    end
    local host, port = conf.master_host, conf.master_port
    if host then
        local red = open(conf, host, port, read_timeout)
        if red then
            return red
        end
        conf.master_host = nil      -- failed: ask the Sentinels again
    end
    local err
    host, port, err = discover(conf)
    if not host then
        return nil, err
    end
    local red
    red, err = open(conf, host, port, read_timeout)
    if red then
        conf.master_host, conf.master_port = host, port
    end
    return red, err
end


-- after a command on a connection from connect() failed (res, err: what
-- it returned): forgets the master's address when the error says it may
-- no longer be the master. Returns true if it did.
function _M.failed(conf, res, err)
    if not conf.master_host then
        return false
    end
    -- nil: the socket (closed, timeout); false: an error reply
    if res == nil or str_find(tostring(err), "^READONLY")
       or str_find(tostring(err), "^MASTERDOWN")
    then
        conf.master_host = nil
        return true
    end
    return false
end


-- a Sentinel event about conf's master (see WATCHED)
local function on_event(conf, channel, data)
    if channel == "+switch-master" then
        -- "<master name> <old ip> <old port> <new ip> <new port>"
        local name, host, port = str_match(data,
                                           "^(%S+) %S+ %S+ (%S+) (%d+)$")
        if name ~= conf.master_name then
            return
        end
        port = tonumber(port)
        local moved = host ~= conf.master_host or port ~= conf.master_port
        if moved or conf.paused_until then
            ngx_log(ngx_NOTICE, LOG_TAG, "master ", name, " is now ", host,
                    ":", port)
        end
        conf.paused_until = nil
        if moved then
            conf.master_host, conf.master_port = host, port
            conf.gen = conf.gen + 1
        end
        return
    end
    -- "<type> <name> <ip> <port>[ @ <master name> <ip> <port>]"
    local name = str_match(data, " @ (%S+) ") or str_match(data,
                                                          "^master (%S+) ")
    if name ~= conf.master_name then
        return
    end
    if channel == "+failover-state-send-slaveof-noone" then
        ngx_log(ngx_NOTICE, LOG_TAG, "failover of ", name, " started: ",
                "nothing is written until the new master is known")
        conf.paused_until = ngx_now() + PAUSE_MAX
        conf.master_host = nil
        conf.gen = conf.gen + 1
    elseif conf.paused_until then
        ngx_log(ngx_NOTICE, LOG_TAG, "failover of ", name, " ended (",
                channel, ")")
        conf.paused_until = nil
    end
end


-- follows one Sentinel's events until the worker exits
local function follow(conf, s)
    local fails = 0
    while not worker_exiting() do
        local red = redis:new()
        red:set_timeout(conf.connect_timeout * 1000)
        local ok, err = red:connect(s.host, s.port)
        if ok then
            ok, err = red:psubscribe(unpack(WATCHED))
        end
        if ok then
            fails = 0
            red:set_timeout(WATCH_READ * 1000)
            while not worker_exiting() do
                local res
                res, err = red:read_reply()
                if res then
                    if res[1] == "pmessage" then
                        on_event(conf, res[3], res[4])
                    end
                elseif err ~= "timeout" then
                    break
                end
            end
        end
        red:close()
        if worker_exiting() then
            break
        end
        fails = fails + 1
        if fails == 1 then
            ngx_log(ngx_WARN, LOG_TAG, "cannot follow the failovers of ",
                    "sentinel ", s.host, ":", s.port, ": ", tostring(err))
        end
        ngx_sleep(_M.backoff(fails, 0.1, 5))
    end
end


local function watch_all(premature, conf, list)
    if premature then
        return
    end
    local threads = {}
    for i = 1, #list do
        threads[i] = thread_spawn(follow, conf, list[i])
    end
    for i = 1, #threads do
        thread_wait(threads[i])
    end
end


-- watch(conf): in init_worker, once per conf and worker: one connection
-- per Sentinel subscribed to its failover events (only the leader of a
-- failover sends the first one). A no-op without Sentinels.
function _M.watch(conf)
    if not conf.sentinels or conf.watching then
        return true
    end
    local list = {}
    for i = 1, #conf.sentinels do
        list[i] = conf.sentinels[i]
    end
    local ok, err = timer_at(0, watch_all, conf, list)
    if not ok then
        return nil, "failed to watch the sentinels: " .. tostring(err)
    end
    conf.watching = true
    return true
end


-- the level to log a failure to reach Redis at (err: what connect() or a
-- command returned)
function _M.log_level(err)
    return err == FAILOVER and ngx_NOTICE or ngx_ERR
end


-- seconds to wait before the attempt after `failures` failed ones:
-- doubling from lo to hi, then a uniform jitter of +-50 %
function _M.backoff(failures, lo, hi)
    local d = min(hi, lo * 2 ^ min(failures, 30))
    return d * (0.5 + random())
end


return _M
