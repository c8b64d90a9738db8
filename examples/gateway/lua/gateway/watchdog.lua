-- The example gateway's event-loop watchdog: started in every worker,
-- GET /loom/blocking for the figures and reports, GET /loom/demo/block to
-- see a report made (the error log gets one line for it too).


local ffi = require "ffi"
local reply = require("gateway.json").reply
local watchdog = require "resty.loom.watchdog"

local C = ffi.C
local ngx_md5 = ngx.md5
local random = math.random
local tostring = tostring
local tonumber = tonumber

ffi.cdef[[
int socket(int domain, int type, int protocol);
int setsockopt(int fd, int level, int name, const void *val,
               unsigned int len);
long recv(int fd, void *buf, size_t len, int flags);
int close(int fd);
struct loom_gw_timeval { long tv_sec; long tv_usec; };
]]

local AF_INET = 2
local SOCK_DGRAM = 2
local SOL_SOCKET = 1
local SO_RCVTIMEO = 20


local _M = {}


function _M.init_worker()
    if not ngx.worker.id() then
        return      -- a helper process: no event loop of requests
    end
    local ok, err = watchdog.start({ threshold = 100 })
    if not ok then
        ngx.log(ngx.ERR, "[gateway] failed to start the watchdog: ", err)
    end
end


-- GET /loom/blocking: every worker's figures and reports from the
-- status collector; ?format=svg a flame graph of the stalls
function _M.blocking()
    if ngx.var.arg_format ~= "svg" then
        return require("gateway.observe").serve("watchdog")
    end
    local all = {}
    for _, w in pairs(watchdog.collect(2)) do
        for _, r in ipairs(w.reports or {}) do
            all[#all + 1] = r
        end
    end
    -- only the SVG: flamegraph() may return more than one value
    local svg = watchdog.flamegraph(all)
    ngx.header["Content-Type"] = "image/svg+xml"
    ngx.print(svg)
end


-- the seed case: hashing random strings in a loop, then a blocking socket
-- call (a UDP receive with a timeout: nobody sends)
local function hash_random_strings(ms)
    ngx.update_time()
    local deadline = ngx.now() + ms / 1000
    local last
    repeat
        for i = 1, 1000 do
            last = ngx_md5(tostring(random()) .. i)
        end
        ngx.update_time()
    until ngx.now() >= deadline
    return last
end


local function blocking_receive(ms)
    local fd = C.socket(AF_INET, SOCK_DGRAM, 0)
    if fd < 0 then
        return nil, "socket() failed"
    end
    local tv = ffi.new("struct loom_gw_timeval")
    tv.tv_sec = math.floor(ms / 1000)
    tv.tv_usec = (ms % 1000) * 1000
    C.setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, tv, ffi.sizeof(tv))
    local buf = ffi.new("char[16]")
    local n = C.recv(fd, buf, 16, 0)
    C.close(fd)
    return tonumber(n)
end


-- ?cpu_ms= and ?socket_ms=: whole milliseconds, 0 to 5000
local function millis(arg, default)
    if arg == nil then
        return default
    end
    local ms = tonumber(arg)
    if not ms or ms ~= math.floor(ms) or ms < 0 or ms > 5000 then
        return nil
    end
    return ms
end


function _M.demo()
    local args = ngx.req.get_uri_args()
    local cpu_ms = millis(args.cpu_ms, 200)
    local socket_ms = millis(args.socket_ms, 150)
    if not cpu_ms or not socket_ms then
        return reply(400, { error = "cpu_ms and socket_ms must be whole "
                                    .. "milliseconds from 0 to 5000" })
    end
    local digest = hash_random_strings(cpu_ms)
    if socket_ms > 0 then           -- a zero SO_RCVTIMEO waits forever
        blocking_receive(socket_ms)
    end
    reply(200, { blocked_ms = cpu_ms + socket_ms, digest = digest,
                 see = "/loom/blocking" })
end


return _M
