-- Control of a timer by its handle (or name): cancel, pause, resume, and
-- its state.


local bit = require "bit"
local job = require "resty.loom.timer.jobs"
local sched = require "resty.loom.timer.schedule"

local band = bit.band
local bor = bit.bor
local bnot = bit.bnot
local lookup = job.lookup
local handle_of = job.handle_of
local release_name = job.release_name
local free_job = job.free_job
local enqueue = sched.enqueue
local notify = sched.notify
local schedule = sched.schedule

local PENDING = job.PENDING
local QUEUED = job.QUEUED
local RUNNING = job.RUNNING
local PAUSED = job.PAUSED
local STATE_NAMES = job.STATE_NAMES
local F_CANCEL = job.F_CANCEL
local F_PAUSE = job.F_PAUSE


-- the job behind a handle, unless it is gone or was cancelled while it
-- runs: id, job, state
local function live(self, h)
    local id = lookup(self, h)
    if not id then
        return nil
    end
    local j = self.jobs[id]
    local st = j.state
    if st == RUNNING and band(j.flags, F_CANCEL) ~= 0 then
        return nil
    end
    return id, j, st
end


local _M = { _VERSION = "0.2.0" }


function _M.cancel(self, h)
    local id, j, st = live(self, h)
    if not id then
        return nil, "not found"
    end
    if st == RUNNING then
        j.flags = bor(j.flags, F_CANCEL)
        release_name(self, id)
    else
        if st == PENDING or st == QUEUED then
            self.wheel:remove(id)
        end
        free_job(self, id)
    end
    local totals = self.totals
    totals.cancelled = totals.cancelled + 1
    return true
end


function _M.pause(self, h)
    local id, j, st = live(self, h)
    if not id then
        return nil, "not found"
    end
    if st == RUNNING then
        j.flags = bor(j.flags, F_PAUSE)
        return true
    end
    if st == PAUSED then
        return true
    end
    local remaining = 0
    if st == PENDING or st == QUEUED then
        self.wheel:remove(id)
    end
    if st == PENDING then
        remaining = j.due - self.clock()
        if remaining < 0 then
            remaining = 0
        end
    end
    j.due = remaining
    j.state = PAUSED
    self.paused = self.paused + 1
    return true
end


function _M.resume(self, h)
    local id, j, st = live(self, h)
    if not id then
        return nil, "not found"
    end
    if st == RUNNING then
        j.flags = band(j.flags, bnot(F_PAUSE))
        return true
    end
    if st ~= PAUSED then
        return true
    end
    self.paused = self.paused - 1
    local now = self.clock()
    local remaining = j.due
    if remaining <= 0 then
        j.due = now
        enqueue(self, id, now)
        notify(self, now)
    else
        schedule(self, id, now + remaining)
    end
    return true
end


-- "pending", "queued", "running", "paused", or nil (unknown, cancelled or
-- finished)
function _M.state(self, h)
    local id = lookup(self, h)
    if not id then
        return nil
    end
    local j = self.jobs[id]
    local f = j.flags
    if band(f, F_CANCEL) ~= 0 then
        return nil
    end
    if j.state == RUNNING and band(f, F_PAUSE) ~= 0 then
        return "paused"
    end
    return STATE_NAMES[j.state]
end


function _M.is_active(self, h)
    local st = _M.state(self, h)
    return st ~= nil and st ~= "paused"
end


-- the handle registered under name, or nil
function _M.handle(self, name)
    local id = lookup(self, name)
    if not id then
        return nil
    end
    return handle_of(self, id)
end


return _M
