-- Test node for resty.loom.cluster: every handled event is appended to
-- logs/h-<worker id>.log (unbuffered, so a SIGKILL loses no line already
-- handled) as "<tag> <seq> <worker pid>". Each line goes in one write():
-- an unbuffered file:write(a, b, ...) makes one write() per argument, and a
-- SIGKILL between them left half a line that swallowed the next one.

local cjson = require "cjson.safe"
local events = require "resty.loom.events"
local cluster = require "resty.loom.cluster"
-- lua-resty-redis, found where the library finds it (Debian's or
-- OpenResty's path)
local redis = require("resty.loom.cluster.redis").driver

local _M = {}

local out


local function record(data)
    if not out then
        out = assert(io.open(ngx.config.prefix() .. "logs/h-"
                             .. ngx.worker.id() .. ".log", "a"))
        out:setvbuf("no")
    end
    out:write(data.tag .. " " .. data.seq .. " " .. ngx.worker.pid() .. "\n")
end


function _M.init(opts)
    events.new({ socket = ngx.config.prefix() .. "sock/bus.sock" })
    opts.shm = opts.shm or "cluster"
    _M.c = cluster.new(opts)
end


function _M.init_worker()
    local bus = events.get()
    assert(bus:init_worker())
    assert(_M.c:init_worker())
    bus:subscribe("test", "ev", record)
    bus:subscribe("test", "slow", function(data)
        ngx.sleep(data.sleep)
        record(data)
    end)
end


-- a cluster timer that appends "<what> <period> <epoch> <pid>" lines to
-- logs/timer.log; hold > 0: it sleeps that long inside the run, then
-- checks its epoch (the fencing case)
function _M.start_timer(interval, ttl, hold)
    local timer = require "resty.loom.timer"
    local ctimer = require "resty.loom.cluster.timer"
    local f = assert(io.open(ngx.config.prefix() .. "logs/timer.log", "a"))
    f:setvbuf("no")
    local pid = ngx.worker.pid()
    assert(timer.every({ interval = interval, ttl = ttl, name = "t",
                         unique = "cluster" },
                       function(premature, epoch, period)
        if premature then
            return
        end
        f:write("run " .. period .. " " .. epoch .. " " .. pid .. "\n")
        if hold > 0 then
            ngx.sleep(hold)
            local ok, err = ctimer.fence("t", epoch)
            f:write("fence " .. period .. " " .. epoch .. " " .. pid .. " "
                    .. tostring(ok or err):match("%S+") .. "\n")
        end
    end))
end


function _M.handle()
    local args = ngx.req.get_uri_args()
    local what = ngx.var.uri:match("/cl/(%w+)")
    local c = _M.c
    if what == "pub" then
        -- n events, `rate` per second (0: as fast as publish returns)
        local n = tonumber(args.n) or 1
        local rate = tonumber(args.rate) or 0
        local from = tonumber(args.from) or 1
        local ok, failed, last = 0, 0, nil
        local t0 = ngx.now()
        for i = from, from + n - 1 do
            local done, err = c:publish(args.target or "cluster", "test",
                                        args.event or "ev",
                                        { tag = args.tag or "t", seq = i,
                                          sleep = tonumber(args.sleep) })
            if done then
                ok = ok + 1
            else
                failed = failed + 1
                last = err
            end
            if rate > 0 and (i - from + 1) % 50 == 0 then
                ngx.update_time()
                local ahead = t0 + (i - from + 1) / rate - ngx.now()
                if ahead > 0 then
                    ngx.sleep(ahead)
                end
            end
        end
        ngx.say(cjson.encode({ ok = ok, failed = failed, err = last,
                                 worker = ngx.worker.id() }))

    elseif what == "plant" then
        -- a "one" entry that node "d" read and never acknowledged, in one
        -- transaction so this node's reader cannot take it first
        local red = redis:new()
        assert(red:connect("127.0.0.1", c.redis.port))
        red:init_pipeline()
        red:multi()
        red:xadd(c.stream_one, "*", "t", "o", "p",
                 require("string.buffer").encode({
                     i = "d/x/", q = tonumber(args.seq), s = "test",
                     e = "ev",
                     d = { tag = args.tag, seq = args.seq } }))
        red:xreadgroup("GROUP", "one", "d", "COUNT", 10, "STREAMS",
                       c.stream_one, ">")
        red:exec()
        local res = assert(red:commit_pipeline())
        local exec = res[#res]
        ngx.say(type(exec[2]) == "table" and "taken by d" or "not taken")

    elseif what == "stats" then
        local st = c:stats()
        st.pid = ngx.worker.pid()
        ngx.say(cjson.encode(st))

    else
        ngx.exit(404)
    end
end


return _M
