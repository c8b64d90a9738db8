-- Scheduling: a job waits in the timing wheel until its tick, then in the
-- ready queue (FIFO; a token per entry skips jobs cancelled or paused while
-- queued). The driver is woken when the earliest deadline moves sooner.


local job = require "resty.loom.timer.jobs"

local floor = math.floor
local ceil = math.ceil
local AWAKE = -math.huge            -- sleep_until while the driver is awake

local PENDING = job.PENDING
local QUEUED = job.QUEUED
local GEN_SPAN = job.GEN_SPAN


-- sleep_until is a number whatever the driver does (-inf: awake), so
-- that this check has one shape in every phase: a trace recorded while
-- timers are created (driver not started) and run later by the lanes
-- (driver asleep) would otherwise leave on a type guard on every call and
-- grow side traces over the whole run path (issue 27)
local function notify(self, at)
    if at < self.sleep_until then
        self.sleep_until = AWAKE    -- one wake-up per sleep
        local wake = self.wake
        if wake then
            wake(self.ctx)
        end
    end
end


local function enqueue(self, id, now)
    local j = self.jobs[id]
    j.state = QUEUED
    local tok = (j.qtok + 1) % GEN_SPAN
    j.qtok = tok
    local qt = self.qt + 1
    self.qt = qt
    self.q_id[qt] = id
    self.q_tok[qt] = tok
    self.q_time[qt] = now
end


local function schedule(self, id, due)
    local j = self.jobs[id]
    j.due = due
    j.state = PENDING
    local res = self.res
    local tick = ceil(due / res)
    self.wheel:insert(id, tick)
    notify(self, tick * res)
end


-- called by the wheel for each expired id
local function on_expire(self, id)
    enqueue(self, id, self.now_us)
end


-- skips stale entries (jobs cancelled or paused while queued)
local function pop_slow(self)
    local qh, qt = self.qh, self.qt
    local jobs = self.jobs
    local q_id, q_tok = self.q_id, self.q_tok
    while qh <= qt do
        local id = q_id[qh]
        local tok = q_tok[qh]
        local qtime = self.q_time[qh]
        qh = qh + 1
        local j = jobs[id]
        if j.state == QUEUED and j.qtok == tok then
            if qh > qt then
                self.qh = 1
                self.qt = 0
            else
                self.qh = qh
            end
            return id, qtime
        end
    end
    self.qh = 1
    self.qt = 0
    return nil
end


-- loop-free in the common case, so that the caller's loop compiles
local function pop(self)
    local qh, qt = self.qh, self.qt
    if qh > qt then
        self.qh = 1
        self.qt = 0
        return nil
    end
    local id = self.q_id[qh]
    local j = self.jobs[id]
    if j.state == QUEUED and j.qtok == self.q_tok[qh] then
        local qtime = self.q_time[qh]
        if qh >= qt then
            self.qh = 1
            self.qt = 0
        else
            self.qh = qh + 1
        end
        return id, qtime
    end
    return pop_slow(self)
end


local _M = {
    _VERSION = "0.2.0",
    notify = notify,
    enqueue = enqueue,
    schedule = schedule,
    pop = pop,
}


-- moves every timer due at now_us (default: the clock) to the ready queue;
-- returns the queue length
function _M.advance(self, now_us)
    now_us = now_us or self.clock()
    self.now_us = now_us
    self.wheel:advance(floor(now_us / self.res), on_expire, self)
    return self.qt - self.qh + 1
end


-- when the driver must wake next (us), or nil when nothing is scheduled
function _M.next_wake(self)
    if self.qt >= self.qh then
        return 0
    end
    local t = self.wheel:next_tick()
    if t then
        return t * self.res
    end
    return nil
end


-- the next wheel deadline (us) only, ignoring the ready queue
function _M.next_deadline(self)
    local t = self.wheel:next_tick()
    if t then
        return t * self.res
    end
    return nil
end


function _M.queued(self)
    return self.qt - self.qh + 1
end


return _M
