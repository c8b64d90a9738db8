-- The lane: a second connection to the broker for urgent events only
-- (collect and its answers), which neither side ever stops reading, so
-- that they do not wait behind this worker's events in either direction
-- while a queue is full (see broker.lua). It lives as long as the
-- connection; without it urgent events take the connection.


local buffer = require "string.buffer"
local frame = require "resty.loom.events.frame"
local receive = require "resty.loom.events.receive"
local evlog = require "resty.loom.events.log"
local handshake = require("resty.loom.events.handshake").handshake

local ngx = ngx
local ngx_now = ngx.now
local spawn = ngx.thread.spawn
local kill = ngx.thread.kill
local worker_exiting = ngx.worker.exiting
local buf_new = buffer.new
local pcall = pcall
local log = evlog.log
local warn_once = evlog.warn_once
local consume = receive.consume

local ERR = ngx.ERR

local READ_SIZE = frame.READ_SIZE
local CONNECT_TIMEOUT = receive.CONNECT_TIMEOUT
local SEND_TIMEOUT = receive.SEND_TIMEOUT
-- the lane's heartbeat: a header-only frame, always the same bytes
local PING
do
    local out = buf_new(64)
    frame.put_empty(out, frame.PING, 0)
    PING = out:get()
end


local _M = { _VERSION = "0.2.0" }


local function lane_reader(self, sock, lane)
    local rbuf = buf_new(READ_SIZE)
    local st = { got = 0 }
    sock:settimeouts(CONNECT_TIMEOUT * 1000, SEND_TIMEOUT * 1000,
                     self.opts.heartbeat * 3000)
    while not lane.closed do
        local data, err = sock:receiveany(READ_SIZE)
        if not data then
            lane.error = err
            break
        end
        rbuf:put(data)
        -- (the broker sends only urgent events and pongs here)
        local need
        need, err = consume(self, rbuf, st)
        if not need or st.got > 0 then
            lane.error = err or "events on the lane"
            break
        end
    end
    lane.closed = true
    lane.sema:post(1)
end


local function run_lane(self, lane)
    local sock = ngx.socket.tcp()
    sock:settimeout(CONNECT_TIMEOUT * 1000)
    local ok, err = handshake(self, sock, true)
    if not ok then
        sock:close()
        -- at a quit the master removes the socket file before the workers
        -- hear of it: a lane that fails then goes with its connection
        -- (which ends and closes the lane) and is no news
        if not lane.closed then
            lane.sema:wait(1)
        end
        if not lane.closed and not self.stopping and not worker_exiting()
        then
            warn_once(self, "lane", "failed to open the lane (collect "
                      .. "goes with the events): ", err)
        end
        return
    end
    local rt = spawn(lane_reader, self, sock, lane)
    self.lane = lane
    local hb = self.opts.heartbeat
    local last_send = ngx_now()
    while not lane.closed do
        if #self.urgent == 0 then
            lane.sema:wait(hb / 2)
        end
        if lane.closed then
            break
        end
        local data
        if #self.urgent > 0 then
            data = self.urgent:get()
        elseif ngx_now() - last_send >= hb / 2 then
            -- the broker times a silent lane out like a connection
            data = PING
        end
        if data then
            ok, err = sock:send(data)
            if not ok then
                lane.error = err
                break
            end
            last_send = ngx_now()
        end
    end
    self.lane = nil
    lane.closed = true
    kill(rt)
    sock:close()
    if lane.error and not self.stopping then
        warn_once(self, "lane", "lost the lane (collect goes with the "
                  .. "events): ", lane.error)
    end
    -- what is left goes with the events
    self.wsema:post(1)
end


-- The lane runs in a timer of its own, so that its handshake holds back
-- nginx's lines about its own connection only (see handshake).
local function lane_timer(premature, self, lane)
    if not premature then
        local ok, err = pcall(run_lane, self, lane)
        if not ok then
            log(ERR, "the lane failed: ", err)
        end
    end
    lane.ended = true
    lane.done:post(1)
end
_M.lane_timer = lane_timer


return _M
