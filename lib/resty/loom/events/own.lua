-- Our handlers' copies of our own events ("all", to our own worker id,
-- unique ones that land on us): in publish order, once the writer takes
-- the events they follow; a unique one waits for the broker's word on it,
-- and the copies behind it wait too.


local dispatch = require "resty.loom.events.dispatch"

local inbox_push = dispatch.inbox_push
local report_gap = dispatch.report_gap


local _M = { _VERSION = "0.2.0" }


-- a copy of our own event for our handlers: behind a unique event of
-- ours that waits for the broker's word, if any
local function hand_own(self, source, event, data, at)
    local held = self.held
    if held.n > 0 then
        held:push(false, source, event, data, at)
    else
        inbox_push(self, source, event, data, self.worker, at, self.pid)
    end
end
_M.hand_own = hand_own


-- The broker's word on our unique event seq that lands on us: our
-- handlers run it or not, then the copies held behind it, up to the
-- next such event. (A word for no event held: the second answer to an
-- event re-sent after a reconnect.)
local function own_unique(self, seq, run)
    local held = self.held
    if held.n == 0 or held:peek() ~= seq then
        return
    end
    local _, source, event, data, at = held:pop()
    if run then
        inbox_push(self, source, event, data, self.worker, at, self.pid)
    end
    while held.n > 0 and not held:peek() do
        _, source, event, data, at = held:pop()
        inbox_push(self, source, event, data, self.worker, at, self.pid)
    end
end
_M.own_unique = own_unique


-- The writer took events first..last for the broker, which sends "all"
-- events to the other workers only: our handlers get our copies now, in
-- publish order; a unique event of ours that lands on us waits for the
-- broker's word, and what follows it waits behind it. With everything
-- (nothing left unsent, or nothing ever to be taken: first > last),
-- every copy goes. A copy whose event was never taken was dropped by
-- drop_oldest: our handlers miss it like the others do. poll: copies of
-- events not taken yet go too, up to the first unique one.
local function release_own(self, first, last, everything, poll)
    local own = self.own
    local dropped = 0
    while own.n > 0 do
        local key, source, event, data, at, unique = own:first()
        if (not everything and key >= last + 1) or (poll and unique) then
            break
        end
        own:pop()
        if key % 1 ~= 0 or (key >= first and key <= last) then
            if unique then
                self.held:push(key, source, event, data, at)
            else
                hand_own(self, source, event, data, at)
            end
        elseif not unique then
            dropped = dropped + 1
        end
    end
    if dropped > 0 then
        report_gap(self, self.worker, self.pid, dropped)
    end
end
_M.release_own = release_own


-- the bus closed at exit: no word on our unique events will come (they
-- were not acknowledged: counted in dropped.exit); what they held runs
local function release_held(self)
    local held = self.held
    while held.n > 0 do
        own_unique(self, held:peek(), false)
    end
end
_M.release_held = release_held


return _M
