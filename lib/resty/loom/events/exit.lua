-- Exit accounting: at a graceful exit the bus stays up while the worker
-- uses it (exit_watch); when the worker stops, what the bus will never
-- deliver is counted and logged, once: by exit_worker(), else at VM close.


local frame = require "resty.loom.events.frame"
local broker = require "resty.loom.events.broker"
local at_close = require "resty.loom.at_close"
local dispatch = require "resty.loom.events.dispatch"
local release_held = require("resty.loom.events.own").release_held
local log = require("resty.loom.events.log").log

local ngx = ngx
local ngx_now = ngx.now
local ngx_sleep = ngx.sleep
local pairs = pairs
local setmetatable = setmetatable
local inbox_len = dispatch.inbox_len

local WARN = ngx.WARN

-- an exiting worker's bus stays up until this long after its last publish
-- (its requests and timers may go on publishing for a while)
local EXIT_QUIET = 0.5


local function count(t, key, n)
    t[key] = (t[key] or 0) + (n or 1)
end


local _M = { _VERSION = "0.2.0" }

-- every bus of this process that init_worker() started, for exit_worker()
local living = setmetatable({}, { __mode = "k" })


-- At worker exit the bus stays up while the worker uses it: until
-- EXIT_QUIET s after its last publish, everything sent and acknowledged,
-- every handler run, and (on the broker worker) every other worker gone.
-- Then it says goodbye and publish() returns "closed". Waiting on
-- something that makes no progress (an unreachable broker, a handler
-- stuck) ends exit_timeout s after the last publish; what is left then is
-- counted and logged.
local function exit_watch(premature, self)
    if not premature then
        return
    end
    local timeout = self.opts.exit_timeout
    local is_broker = self.worker == self.opts.broker
    local since = ngx_now()     -- the worker's last use of the bus
    while true do
        ngx.update_time()
        local now = ngx_now()
        local peers = is_broker and broker.peers(self) > 0
        if peers or self.last_publish > since then
            since = peers and now or self.last_publish
        end
        if now - since >= EXIT_QUIET and self.pending == 0
           and inbox_len(self) == 0 then
            break
        end
        if now - since >= timeout and now - since >= EXIT_QUIET then
            break
        end
        self.wsema:post(1)
        ngx_sleep(0.01)
    end
    self.stopping = true
    self.exit_counted = true
    if self.pending > 0 then
        count(self.counters.dropped, "exit", self.pending)
        log(WARN, "worker exiting with ", self.pending,
            " event(s) not acknowledged by the broker")
    end
    release_held(self)
    self.wsema:post(1)
    self.isema:post(1)
end
_M.exit_watch = exit_watch


-- The worker stops (its Lua VM closes next): counts, once, what the bus
-- will never deliver. Returns the events published and not sent, sent
-- and not acknowledged by the broker (both unless exit_watch counted them
-- already: the rest of a graceful exit), received (or published to this
-- worker) and not handled, and held by the broker in this worker for
-- others that no publisher counts (see broker.count_left).
local function count_left(self)
    if self.left_counted then
        return 0, 0, 0, 0
    end
    self.left_counted = true
    self.stopping = true
    local unsent, unacked = 0, 0
    if not self.exit_counted then
        unsent = self.unsent_q:len()
        if self.worker == self.opts.broker then
            -- what the broker has not taken yet of the batch it is
            -- taking (the rest is in its queues); a chunked event whose
            -- first chunks it has taken counts by its first chunk, which
            -- is no longer there
            local link = self.local_link
            unacked = frame.count_events(self.spare:ref())
                      + (link and link.partial and 1 or 0)
        else
            unacked = self.pending - unsent
        end
    end
    local unhandled = inbox_len(self)
    local own = self.own
    while own.n > 0 do
        -- (copies of events to this worker published behind unsent
        -- ones: the other copies are of events counted as not sent)
        if own:pop() % 1 ~= 0 then
            unhandled = unhandled + 1
        end
    end
    local dropped = self.counters.dropped
    if unsent + unacked > 0 then
        count(dropped, "exit", unsent + unacked)
    end
    if unhandled > 0 then
        count(dropped, "not handled", unhandled)
    end
    return unsent, unacked, unhandled, broker.count_left(self)
end


-- at VM close (see resty.loom.at_close): what no exit_worker() reported
local function unreported_at_close()
    local unsent, unacked, unhandled, held = 0, 0, 0, 0
    for bus in pairs(living) do
        local u, a, h, b = count_left(bus)
        unsent, unacked = unsent + u, unacked + a
        unhandled, held = unhandled + h, held + b
    end
    local lost = unsent + unacked + unhandled + held
    if lost > 0 then
        return "warn", "[loom.events] " .. lost .. " event(s) lost at "
               .. "worker exit without a report (" .. unsent .. " not sent, "
               .. unacked .. " not acknowledged, " .. unhandled
               .. " not handled, " .. held .. " held by the broker): call "
               .. "require(\"resty.loom.events\").exit_worker() in "
               .. "exit_worker_by_lua_block"
    end
end


-- the bus is up in this worker: its losses are counted at exit
function _M.track(bus)
    living[bus] = true
    at_close.register(unreported_at_close)
    -- (the check reads this bus's buffers: see at_close.renew)
    at_close.renew()
end


-- events.exit_worker(), in exit_worker_by_lua*: a fast stop (SIGTERM,
-- SIGINT, nginx -s stop) runs no timer and no cosocket, so this is the
-- only code of the bus that runs then. Counts and logs what each bus of
-- the worker will never deliver; after a graceful exit, what it could not
-- (a stuck handler). Nothing once everything was delivered.
function _M.exit_worker()
    for bus in pairs(living) do
        local unsent, unacked, unhandled, held = count_left(bus)
        local lost = unsent + unacked + unhandled + held
        if lost > 0 then
            log(WARN, "worker stopping: ", lost, " event(s) lost: ", unsent,
                " published and not sent, ", unacked, " sent and not "
                .. "acknowledged by the broker (some may have reached "
                .. "their workers), ", unhandled, " received and not "
                .. "handled, ", held, " held by the broker for other "
                .. "workers (some may have reached them)")
        end
    end
    return true
end


return _M
