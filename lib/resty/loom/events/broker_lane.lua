-- A worker's lane: its second connection, which carries only urgent events
-- (collect and its answers) and pings, so that they never wait behind its
-- events.


local buffer = require "string.buffer"
local frame = require "resty.loom.events.frame"
local semaphore = require "ngx.semaphore"
local reader = require "resty.loom.events.broker_reader"
local route = require "resty.loom.events.broker_route"

local frame_seq = frame.seq
local ngx = ngx
local ngx_log = ngx.log
local ngx_exit = ngx.exit
local spawn = ngx.thread.spawn
local kill = ngx.thread.kill
local buf_new = buffer.new
local tostring = tostring

local WARN = ngx.WARN

local T_WELCOME = frame.WELCOME
local T_PING = frame.PING
local T_PONG = frame.PONG
local T_URGENT = frame.URGENT
local READ_SIZE = frame.READ_SIZE
local CHUNK = frame.CHUNK
local HELLO_TIMEOUT = reader.HELLO_TIMEOUT
local SEND_TIMEOUT = reader.SEND_TIMEOUT

local forward_urgent = route.forward_urgent


local _M = { _VERSION = "0.2.0" }


local function log(level, ...)
    ngx_log(level, "[loom.events] ", ...)
end


-- Reads a worker's lane: urgent events and pings only.
local function lane_reader(bus, b, l)
    local sock = l.sock
    local rbuf = buf_new(READ_SIZE)
    sock:settimeouts(HELLO_TIMEOUT * 1000, SEND_TIMEOUT * 1000,
                     bus.opts.heartbeat * 3000)
    local err
    while not l.closed do
        local data
        data, err = sock:receiveany(READ_SIZE)
        if not data then
            break
        end
        rbuf:put(data)
        while true do
            local h, pp, size = frame.peek(rbuf, CHUNK)
            if not h then
                err = h == false and pp or nil
                break
            end
            if h.type == T_URGENT then
                local ok, why = forward_urgent(bus, b, l, pp, h.len)
                if not ok then
                    err = why
                    break
                end
            elseif h.type == T_PING then
                frame.put_empty(l.ctl, T_PONG, frame_seq(h))
                l.sema:post(1)
            else
                err = "unexpected frame type " .. tostring(h.type)
                    .. " on the lane"
                break
            end
            rbuf:skip(size)
        end
        if err then
            break
        end
    end
    if err and err ~= "closed" and not ngx.worker.exiting() then
        log(WARN, "closed worker ", l.wid, "'s lane: ", err)
    end
    l.closed = true
    l.sema:post(1)
end


-- Serves a worker's lane: a second connection that carries only urgent
-- events (collect and its answers) both ways, so that they never wait
-- behind the events of its connection, which the broker and the worker
-- stop reading while a queue is full (back-pressure). It lives as long
-- as the worker's connection, whose liveness decides.
local function serve_lane(bus, b, q, sock, pid)
    local l = {
        sock = sock,
        wid = q.wid,
        pid = pid,
        ctl = buf_new(256),
        sema = semaphore.new(),
        closed = false,
    }
    local out = buf_new()
    frame.put_control(out, T_WELCOME, 0, { broker_pid = ngx.worker.pid() })
    local ok = sock:send(out:get())
    if not ok then
        return ngx_exit(444)
    end
    if q.lane then
        q.lane.closed = true
        q.lane.sema:post(1)
    end
    q.lane = l
    local rt = spawn(lane_reader, bus, b, l)
    while not l.closed do
        if #l.ctl == 0 then
            l.sema:wait(1)
        end
        if #l.ctl > 0 and not sock:send(l.ctl:get()) then
            break
        end
    end
    l.closed = true
    kill(rt)
    if q.lane == l then
        q.lane = nil
    end
    return ngx_exit(444)
end


_M.serve_lane = serve_lane


return _M
