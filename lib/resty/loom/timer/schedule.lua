-- Scheduling: a job waits in the timing wheel until its tick, then in the
-- wheel's ready list (in order of arrival) until a lane runs it. The
-- driver is woken when the earliest deadline moves sooner.


local job = require "resty.loom.timer.jobs"

local floor = math.floor
local ceil = math.ceil
local AWAKE = -math.huge            -- sleep_until while the driver is awake

local PENDING = job.PENDING
local QUEUED = job.QUEUED


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
    self.jobs[id].state = QUEUED
    self.wheel:push(id, now)
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


local _M = {
    _VERSION = "0.2.0",
    notify = notify,
    enqueue = enqueue,
    schedule = schedule,
}


-- moves every timer due at now_us (default: the clock) to the ready list;
-- returns its length
function _M.advance(self, now_us)
    now_us = now_us or self.clock()
    self.now_us = now_us
    local w = self.wheel
    w:advance(floor(now_us / self.res), on_expire, self)
    return w.ready
end


-- when the driver must wake next (us), or nil when nothing is scheduled
function _M.next_wake(self)
    if self.wheel.ready > 0 then
        return 0
    end
    local t = self.wheel:next_tick()
    if t then
        return t * self.res
    end
    return nil
end


-- the next wheel deadline (us) only, ignoring the ready list
function _M.next_deadline(self)
    local t = self.wheel:next_tick()
    if t then
        return t * self.res
    end
    return nil
end


function _M.queued(self)
    return self.wheel.ready
end


return _M
