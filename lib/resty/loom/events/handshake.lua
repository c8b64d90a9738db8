-- The client's handshake with the broker: the HTTP upgrade on the bus's
-- UNIX socket, then hello and welcome (or the broker's rejection), with
-- nginx's own lines about the connection held back meanwhile.


local ffi = require "ffi"
local buffer = require "string.buffer"
local frame = require "resty.loom.events.frame"
local get_request = require("resty.core.base").get_request

local C = ffi.C
local ngx = ngx
local buf_new = buffer.new
local error = error
local pcall = pcall
local tostring = tostring
local str_sub = string.sub

local ALERT = ngx.ALERT

local T_WELCOME = frame.WELCOME
local T_REJECT = frame.REJECT
local T_HELLO = frame.HELLO
local FRAME_SIZE = frame.FRAME_SIZE


ffi.cdef [[
int ngx_loom_ffi_connection_log_level(void *r, int level);
]]


local _M = { _VERSION = "0.2.0" }


local function talk(self, sock, lane)
    local ok, err = sock:connect("unix:" .. self.opts.socket)
    if not ok then
        return nil, "failed to connect: " .. err
    end
    ok, err = sock:send("GET /loom/events HTTP/1.1\r\nHost: loom\r\n"
                        .. "Upgrade: loom-events/1\r\n"
                        .. "Connection: Upgrade\r\n\r\n")
    if not ok then
        return nil, "failed to send the upgrade: " .. err
    end
    local line
    line, err = sock:receive("*l")
    if not line then
        return nil, "failed to read the upgrade response: " .. err
    end
    if str_sub(line, 1, 12) ~= "HTTP/1.1 101" then
        return nil, "broker refused the upgrade: " .. line
    end
    repeat
        line, err = sock:receive("*l")
        if not line then
            return nil, "failed to read the upgrade response: " .. err
        end
    until line == ""

    local out = buf_new(256)
    frame.put_control(out, T_HELLO, 0, {
        version = frame.VERSION,
        worker = self.worker,
        pid = self.pid,
        generation = self.generation,
        lane = lane,
    })
    ok, err = sock:send(out:get())
    if not ok then
        return nil, "failed to send the hello: " .. err
    end

    local hdr
    hdr, err = sock:receive(FRAME_SIZE)
    if not hdr then
        return nil, "no welcome: " .. err
    end
    local rbuf = buf_new()
    rbuf:put(hdr)
    local h = ffi.cast("loom_ev_frame_t *", (rbuf:ref()))
    local len = h.len
    local typ = h.type
    if h.version ~= frame.VERSION or len > 4096 then
        return nil, "bad welcome"
    end
    local rest
    rest, err = sock:receive(len + frame.TRAILER_SIZE)
    if not rest then
        return nil, "no welcome: " .. err
    end
    local body = str_sub(rest, 1, len)
    if typ == T_REJECT then
        local _, reason = pcall(buffer.decode, body)
        return nil, "rejected by the broker: " .. tostring(reason), reason
    end
    if typ ~= T_WELCOME then
        return nil, "bad welcome"
    end
    return true
end


-- Connects sock to the broker and says hello. A quit makes nginx log
-- what it does to a connection on its way: its master removes the socket
-- file as soon as it has told the workers to quit (a connect() to it then
-- is logged at [crit], ENOENT, whenever the client last saw the file),
-- and the kernel resets the connections still queued when the broker
-- closes its listener (a read then logs [error]). A worker starting (or
-- reconnecting) meanwhile finds no broker, which is no error: nginx's
-- own lines about the connection are held back until the broker welcomed
-- it (the caller's timer runs nothing else meanwhile, and its connection
-- has a log of its own), and the caller says what a failure means.
local function handshake(self, sock, lane)
    local r = get_request()
    local level = r and C.ngx_loom_ffi_connection_log_level(r, ALERT)
                  or -1
    local ok, a, b, c = pcall(talk, self, sock, lane)
    if level >= 0 then
        C.ngx_loom_ffi_connection_log_level(r, level)
    end
    if not ok then
        error(a, 0)
    end
    return a, b, c
end
_M.handshake = handshake


return _M
