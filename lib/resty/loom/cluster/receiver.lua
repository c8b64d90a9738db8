-- Every worker's side of the batches the node's reader hands over on the
-- bus: drops the events the worker slot has handled already (marks in the
-- shared dict, loaded from the marks file at start), hands the rest to the
-- bus's handlers, records them once they ran and confirms the batch.


local buffer = require "string.buffer"
local marks = require "resty.loom.cluster.marks"
local stats = require "resty.loom.cluster.stats"

local ngx_ERR = ngx.ERR
local decode = buffer.decode
local type = type
local pairs = pairs
local pcall = pcall
local tostring = tostring
local count = stats.count
local log_throttled = stats.log_throttled

local SRC = "loom.cluster"        -- the bus source of the internal events


local _M = { _VERSION = "0.2.0" }

_M.SRC = SRC


-- runs in the bus's handler timer of every worker of the node: hands the
-- events this worker slot has not handled to the bus's handlers; returns
-- the marks to set once they ran (key, value, ...). "cluster" events of
-- one publisher come in its order (the stream's), so a slot keeps the
-- highest sequence it handled per publisher; "nodes" and "one" events
-- (claimed ones come out of order) are marked one by one.
local function hand_over(self, items, node)
    local dict, bus, handing = self.dict, self.bus, self.handing
    local marks = {}
    local new, bad = 0, 0
    for i = 1, #items do
        local ok, m = pcall(decode, items[i])
        if not ok or type(m) ~= "table" or type(m.i) ~= "string"
           or type(m.q) ~= "number" or type(m.s) ~= "string"
           or type(m.e) ~= "string"
        then
            bad = bad + 1
            log_throttled(self, ngx_ERR, "decode", "an event not "
                          .. "decodable: " .. tostring(ok and "" or m))
        else
            local fresh
            local q = m.q
            if node then
                local key = self.mark_node .. m.i .. q
                fresh = not handing[key] and not dict:get(key)
                if fresh then
                    handing[key] = q
                    marks[#marks + 1] = key
                    marks[#marks + 1] = true
                end
            else
                local key = self.mark .. m.i
                local hw = handing[key] or dict:get(key) or 0
                fresh = q > hw
                if fresh then
                    handing[key] = q
                    local n = #marks
                    if marks[n - 1] == key then
                        marks[n] = q
                    else
                        marks[n + 1] = key
                        marks[n + 2] = q
                    end
                end
            end
            if fresh then
                bus:publish("current", m.s, m.e, m.d)
                if self.marks_w then
                    -- right after its handlers: into the marks file
                    bus:publish("current", SRC, node and "ran_node" or "ran",
                                m)
                end
                new = new + 1
            end
        end
    end
    count(self, "delivered", new)
    if bad > 0 then
        count(self, "undecodable", bad)
    end
    local dups = #items - new - bad
    if dups > 0 then
        count(self, "duplicates", dups)
    end
    return marks
end


local function on_batch(self, msg)
    local marks = hand_over(self, msg.items, msg.node)
    -- "current" events run in order: this one runs after the batch's
    -- handlers. Marking only then means a worker killed among them
    -- leaves its successor the events it had not marked (some of which
    -- may have run), rather than losing events marked and never run.
    self.bus:publish("current", SRC, "done",
                     { b = msg.b, r = msg.r, marks = marks })
end


local function confirm(self, b)
    local w = self.waits[b]
    if w then
        w.got = w.got + 1
        if w.got >= w.need then
            w.sema:post(1)
        end
    end
end


local function on_ran(self, m)
    marks.put(self.marks_w, marks.CLUSTER, m.i, m.q)
end


local function on_ran_node(self, m)
    marks.put(self.marks_w, marks.NODE, m.i, m.q)
end


-- the marks the file holds: "nodes"/"one" ones of every slot (any worker
-- may read for the node), "cluster" ones of this worker's slot
local function load_marks(self)
    local dict, window, slot = self.dict, self.dedupe_window, self.wid
    local high, n = {}, 0
    marks.each(self.marks, function(kind, key, q, s)
        if kind == marks.NODE then
            dict:set(self.mark_node .. key .. q, true, window)
            n = n + 1
        elseif s == slot and q > (high[key] or 0) then
            high[key] = q
        end
    end)
    for pub, q in pairs(high) do
        local key = self.mark .. pub
        if q > (dict:get(key) or 0) then
            dict:set(key, q, window)
        end
        n = n + 1
    end
    count(self, "marks_loaded", n)
end


local function on_done(self, msg)
    local dict, handing, window = self.dict, self.handing, self.dedupe_window
    local marks = msg.marks
    for i = 1, #marks - 1, 2 do
        local key, v = marks[i], marks[i + 1]
        dict:set(key, v, window)
        if handing[key] == v or v == true then
            handing[key] = nil
        end
    end
    if msg.r == self.wid then
        confirm(self, msg.b)
    else
        self.bus:publish(msg.r, SRC, "ack", msg.b)
    end
end


_M.on_batch = on_batch
_M.confirm = confirm
_M.on_ran = on_ran
_M.on_ran_node = on_ran_node
_M.load_marks = load_marks
_M.on_done = on_done


return _M
