-- Hierarchical timing wheel over integer ticks (Varghese & Lauck scheme 7),
-- and the ready list of timers that are due.
--
-- 6 levels of 64 slots; level k has a granularity of 64^k ticks, so the
-- wheel spans 2^36 ticks (about 21 years at 10 ms, 2 years at 1 ms); later
-- deadlines are parked in the top level and re-inserted until due.
-- A timer sits in exactly one slot of a doubly-linked list whose links are
-- kept in an FFI array indexed by timer id: insert and remove are O(1) and
-- remove frees the slot at once (the links grow with mremap, without a
-- copy: resty.loom.timer.array). When the level-0 index wraps, the next
-- level's current slot is cascaded down; each timer moves down at most once
-- per level, so it expires exactly on its tick (never before it).
-- The ready list (push, pop) is one more list of the same links, in order
-- of arrival: a due timer waits there for its run without a copy, and
-- remove() takes it out of either.
-- Ids are small positive integers handed out by the caller (0 means none).


local ffi = require "ffi"
local bit = require "bit"
local array = require "resty.loom.timer.array"

local ffi_new = ffi.new
local ffi_sizeof = ffi.sizeof
local arr_new = array.new
local arr_grow = array.grow
local floor = math.floor
local rshift = bit.rshift
local ceil = math.ceil
local setmetatable = setmetatable


pcall(ffi.cdef, [[
typedef struct {
    double   tick;      /* in a slot: the due tick; ready: when it came */
    int32_t  next;
    int32_t  prev;
    int32_t  slot;      /* slot + 1 (READY + 1: ready); 0: in neither */
    int32_t  pad;
} loom_timer_wnode_t;
]])


local NODES = ffi.typeof("loom_timer_wnode_t[?]")
local NODE_PTR = ffi.typeof("loom_timer_wnode_t *")
local NODE_SIZE = ffi_sizeof("loom_timer_wnode_t")
local LEVELS = 6
local SLOTS = 64
local SPAN = {}           -- SPAN[k] = 64^k: granularity of level k
for k = 0, LEVELS do
    SPAN[k] = SLOTS ^ k
end
local TOP = SPAN[LEVELS] - 1
local READY = LEVELS * SLOTS        -- the ready list's "slot"


local _M = { _VERSION = "0.2.0", LEVELS = LEVELS, SLOTS = SLOTS }
local mt = { __index = _M }


-- now: the first tick not yet processed; cap: initial id capacity
function _M.new(now, cap)
    cap = cap or 1024
    local store = arr_new(NODE_PTR, NODES, NODE_SIZE, cap + 1)
    local self = {
        store = store,
        nodes = store.ptr,
        cap = cap,
        head = ffi_new("int32_t[?]", LEVELS * SLOTS),
        cnt = ffi_new("int32_t[?]", LEVELS),    -- timers per level
        now = now or 0,
        count = 0,              -- timers in the slots
        ready = 0,              -- timers in the ready list
    }
    return setmetatable(self, mt)
end


-- makes room for ids up to cap (keeps the links; the node array may move)
function _M.grow(self, cap)
    if cap <= self.cap then
        return
    end
    self.nodes = arr_grow(self.store, cap + 1)
    self.cap = cap
end


local function link(self, id, tick)
    local nodes = self.nodes
    local nd = nodes[id]
    local tj = self.now
    local d = tick - tj
    local lvl, idx
    if d < SLOTS then
        if d < 0 then
            idx = tj % SLOTS                -- overdue: the next tick
        else
            idx = tick % SLOTS
        end
        lvl = 0

    else
        -- unrolled: an inner loop here would break the caller's trace
        if d < 4096 then
            lvl = 1
        elseif d < 262144 then
            lvl = 2
        elseif d < 16777216 then
            lvl = 3
        elseif d < 1073741824 then
            lvl = 4
        else
            lvl = 5
        end
        local t = tick
        if d > TOP then
            t = tj + TOP                    -- parked; re-inserted on cascade
        end
        idx = floor(t / SPAN[lvl]) % SLOTS
    end

    local slot = lvl * SLOTS + idx
    local head = self.head
    local h = head[slot]
    nd.next = h
    nd.prev = 0
    nd.slot = slot + 1
    if h ~= 0 then
        nodes[h].prev = id
    end
    head[slot] = id
    local cnt = self.cnt
    cnt[lvl] = cnt[lvl] + 1
end


function _M.insert(self, id, tick)
    self.nodes[id].tick = tick
    self.count = self.count + 1
    link(self, id, tick)
end


-- The ready list is circular through node 0 (id 0 is no timer): its
-- next is the first id, its prev the last, 0 when the list is empty. No
-- operation on it branches on an end of the list, so that a trace
-- recorded on the last timer of a burst is the one every run takes.

-- appends id to the ready list; t: when it came (pop() gives it back)
function _M.push(self, id, t)
    local nodes = self.nodes
    local nd = nodes[id]
    local anchor = nodes[0]
    local tail = anchor.prev
    nd.tick = t
    nd.next = 0
    nd.prev = tail
    nd.slot = READY + 1
    nodes[tail].next = id
    anchor.prev = id
    self.ready = self.ready + 1
end


-- the first id of the ready list and when it came, or 0 when it is empty
function _M.pop(self)
    local nodes = self.nodes
    local id = nodes[0].next
    if id == 0 then
        return 0, 0
    end
    local nd = nodes[id]
    local nx = nd.next
    nodes[0].next = nx
    nodes[nx].prev = 0
    nd.slot = 0
    self.ready = self.ready - 1
    return id, nd.tick
end


-- unlinks id from its slot or from the ready list; returns false when it
-- was in neither
function _M.remove(self, id)
    local nodes = self.nodes
    local nd = nodes[id]
    local slot = nd.slot - 1
    if slot < 0 then
        return false
    end
    local nx, pv = nd.next, nd.prev
    nd.slot = 0
    if slot == READY then
        nodes[pv].next = nx
        nodes[nx].prev = pv
        self.ready = self.ready - 1
        return true
    end
    if pv ~= 0 then
        nodes[pv].next = nx
    else
        self.head[slot] = nx
    end
    if nx ~= 0 then
        nodes[nx].prev = pv
    end
    local lvl = rshift(slot, 6)             -- slot / SLOTS
    local cnt = self.cnt
    cnt[lvl] = cnt[lvl] - 1
    self.count = self.count - 1
    return true
end


-- in a slot (not in the ready list)
function _M.contains(self, id)
    local slot = self.nodes[id].slot
    return slot > 0 and slot <= READY
end


function _M.tick_of(self, id)
    return self.nodes[id].tick
end


-- moves the timers of one slot (level >= 1) down the wheel
local function cascade(self, lvl, idx)
    local slot = lvl * SLOTS + idx
    local head = self.head
    local id = head[slot]
    if id == 0 then
        return
    end
    head[slot] = 0
    local nodes = self.nodes
    local cnt = self.cnt
    while id ~= 0 do
        local nd = nodes[id]
        local nx = nd.next
        cnt[lvl] = cnt[lvl] - 1
        link(self, id, nd.tick)
        id = nx
    end
end


-- processes every tick up to and including target: calls
-- on_expire(ctx, id) for each timer due (the timer is out of the wheel by
-- then, so the callback may insert it again)
function _M.advance(self, target, on_expire, ctx)
    local head = self.head
    local cnt = self.cnt
    local tj = self.now
    while tj <= target do
        self.now = tj
        local i0 = tj % SLOTS
        if i0 == 0 then
            for lvl = 1, LEVELS - 1 do
                local idx = floor(tj / SPAN[lvl]) % SLOTS
                cascade(self, lvl, idx)
                if idx ~= 0 then
                    break
                end
            end
        end

        local id = head[i0]
        if id ~= 0 then
            head[i0] = 0
            self.now = tj + 1
            local nodes = self.nodes
            while id ~= 0 do
                local nd = nodes[id]
                local nx = nd.next
                nd.slot = 0
                cnt[0] = cnt[0] - 1
                if nd.tick > tj then
                    link(self, id, nd.tick)  -- parked beyond the top level
                else
                    self.count = self.count - 1
                    on_expire(ctx, id)
                end
                id = nx
                nodes = self.nodes           -- on_expire may have grown it
            end
        end
        tj = tj + 1

        if cnt[0] == 0 then
            -- nothing at level 0: jump to the next cascade that has work
            local lvl = 1
            while lvl < LEVELS and cnt[lvl] == 0 do
                lvl = lvl + 1
            end
            local span = SPAN[lvl]
            local nxt = ceil(tj / span) * span
            if nxt > target + 1 then
                nxt = target + 1
            end
            if nxt > tj then
                tj = nxt
            end
        end
    end
    if self.now < tj then
        self.now = tj
    end
end


-- the first tick at which advance() has work (an expiry or a cascade that
-- moves timers), or nil when the wheel is empty
function _M.next_tick(self)
    local head = self.head
    local cnt = self.cnt
    local tj = self.now
    local best
    if cnt[0] > 0 then
        for j = 0, SLOTS - 1 do
            local t = tj + j
            if head[t % SLOTS] ~= 0 then
                best = t
                break
            end
        end
    end
    for lvl = 1, LEVELS - 1 do
        if cnt[lvl] > 0 then
            local span = SPAN[lvl]
            local b = ceil(tj / span)
            local base = lvl * SLOTS
            for j = 0, SLOTS - 1 do
                if head[base + (b + j) % SLOTS] ~= 0 then
                    local t = (b + j) * span
                    if not best or t < best then
                        best = t
                    end
                    break
                end
            end
        end
    end
    return best
end


return _M
