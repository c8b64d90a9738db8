-- The sender: a timer in every worker that writes the worker's queue
-- (filled by publish()) to the streams with pipelined XADDs, backs off
-- while Redis is down, and flushes for a while at exit. Also the node's
-- "Redis down" mark that publish() checks (when_down = "reject").


local rconn = require "resty.loom.cluster.redis"
local resp = require "resty.loom.cluster.resp"
local stats = require "resty.loom.cluster.stats"

local ngx_now = ngx.now
local ngx_update_time = ngx.update_time
local ngx_sleep = ngx.sleep
local ngx_log = ngx.log
local ngx_ERR = ngx.ERR
local ngx_NOTICE = ngx.NOTICE
local worker_exiting = ngx.worker.exiting
local min = math.min
local tostring = tostring
local count = stats.count
local log_throttled = stats.log_throttled
local resp_put = resp.put
local resp_exchange = resp.exchange

local LOG_TAG = "[loom.cluster] "
-- in the node's dict while a worker last failed to reach Redis: with
-- when_down = "reject" every worker of the node refuses, not only those
-- whose own sender has tried since
local DOWN_KEY = "down"
local EXIT_FLUSH = 3              -- seconds the sender flushes at exit
-- seconds a new node's events wait for its reader to make the node's
-- group, at most (see sender())
local JOIN_WAIT = 5


local _M = { _VERSION = "0.2.0" }

_M.DOWN_KEY = DOWN_KEY


-- the node's "Redis down" mark (DOWN_KEY), set and cleared by any worker
local function mark_node_down(self, down)
    if down then
        self.dict:set(DOWN_KEY, true)
    elseif self.dict:get(DOWN_KEY) then
        self.dict:delete(DOWN_KEY)
    end
end


local function drop_queued(self, upto)
    local q_t, q_p = self.q_t, self.q_p
    for i = self.q_head + 1, upto do
        q_t[i], q_p[i] = nil, nil
    end
    self.q_head = upto
end


-- one pipeline of XADDs; true, or nil, err (the events stay queued: a
-- pipeline cut half-way is sent again whole, and the readers drop the ids
-- they have seen)
local function send_batch(self, r)
    local from = self.q_head + 1
    local to = min(self.q_tail, self.q_head + self.batch)
    local args, out = self.xadd_args, r.out
    local stream, one = self.stream, self.stream_one
    for i = from, to do
        local t = self.q_t[i]
        args[2] = t == "o" and one or stream
        args[8] = t
        args[10] = self.q_p[i]
        resp_put(out, args, 10)
    end
    local ok, err = resp_exchange(r, to - from + 1, self.replies)
    if not ok then
        return nil, err
    end
    drop_queued(self, to)
    count(self, "sent", to - from + 1)
    return true
end


local function sender(premature, self)
    if premature then
        return
    end
    local red, r, fails = nil, nil, 0
    local gen       -- self.redis.gen when red was made
    local exit_by
    local joined_key = "joined:" .. self.stream     -- set by the reader
    local joined, join_by
    while true do
        if worker_exiting() then
            ngx_update_time()
            exit_by = exit_by or ngx_now() + EXIT_FLUSH
            if self.q_tail == self.q_head or ngx_now() > exit_by then
                break
            end
        end
        if self.q_tail == self.q_head then
            self.sender_idle = true
            self.wake:wait(1)
            self.sender_idle = false

        else
            local err
            if red and gen ~= self.redis.gen then
                red:close()     -- a failover started or ended
                red = nil
            end
            if not red then
                red, err = rconn.connect(self.redis, 5)
                r = red and resp.reader(red)
                gen = self.redis.gen
            end
            local ok = red
            if red and not joined then
                join_by = join_by or ngx_now() + JOIN_WAIT
                joined = self.dict:get(joined_key) or ngx_now() >= join_by
            end
            if red and not joined then
                -- the node's group starts at the stream's end when its
                -- reader makes it: an event sent before would never reach
                -- this node's own workers, so the events wait queued
                ngx_sleep(0.01)
            elseif red then
                ok, err = send_batch(self, r)
                if not ok then
                    red:close()
                    red = nil
                end
            end
            if ok then
                if self.down then
                    self.down = false
                    ngx_log(ngx_NOTICE, LOG_TAG, "redis reachable again, ",
                            self.q_tail - self.q_head, " events queued")
                end
                mark_node_down(self, false)
                fails = 0
            else
                if not self.down then
                    self.down = true
                    count(self, "redis_down")
                end
                mark_node_down(self, true)
                count(self, "send_errors")
                log_throttled(self, rconn.log_level(err), "send",
                              "failed to send events: " .. tostring(err)
                              .. "; " .. (self.q_tail - self.q_head)
                              .. " queued")
                fails = fails + 1
                ngx_sleep(rconn.backoff(fails, self.backoff_min,
                                        self.backoff_max))
            end
        end
    end
    if red then
        red:close()
    end
    local left = self.q_tail - self.q_head
    if left > 0 then
        count(self, "dropped_at_exit", left)
        ngx_log(ngx_ERR, LOG_TAG, left, " events not sent at exit")
    end
end


_M.mark_node_down = mark_node_down
_M.run = sender


return _M
