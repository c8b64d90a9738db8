-- A FIFO of records of up to six values (events waiting for their
-- handlers): a ring in one table whose capacity doubles when full. Slots
-- are cleared on pop so the values can be collected, but the table is
-- allocated up front, so it stays in LuaJIT's array part (an array whose
-- keys keep growing while its head is cleared would be rehashed into the
-- hash part over and over).


local new_tab = require "table.new"

local W = 6              -- values per record
local MIN_CAP = 256      -- records


local _M = { _VERSION = "0.2.0" }
local mt = { __index = _M }


local function alloc(cap)
    local t = new_tab(cap * W, 0)
    for i = 1, cap * W do
        t[i] = false
    end
    return t
end


function _M.new()
    return setmetatable({ t = alloc(MIN_CAP), cap = MIN_CAP, head = 0,
                          n = 0 }, mt)
end


-- doubles the capacity, unrolling the ring so the oldest record is first
local function grow(self)
    local cap = self.cap
    local t, old = alloc(2 * cap), self.t
    local h = self.head
    for r = 0, cap - 1 do
        local src, dst = h * W, r * W
        for k = 1, W do
            t[dst + k] = old[src + k]
        end
        h = h + 1 == cap and 0 or h + 1
    end
    self.t, self.cap, self.head = t, 2 * cap, 0
end


function _M.push(self, a, b, c, d, e, f)
    local n = self.n
    if n == self.cap then
        grow(self)
    end
    local r = self.head + n
    if r >= self.cap then
        r = r - self.cap
    end
    local t, i = self.t, r * W
    t[i + 1], t[i + 2], t[i + 3], t[i + 4], t[i + 5], t[i + 6] =
        a, b, c, d, e, f
    self.n = n + 1
end


function _M.len(self)
    return self.n
end


-- the first value of the oldest record (nil when empty)
function _M.peek(self)
    if self.n == 0 then
        return nil
    end
    return self.t[self.head * W + 1]
end


-- Lowers value k of the newest records to v, back to the first record
-- whose value k is not above it: value k then never decreases from the
-- newest record to the oldest, whose value is the least of all.
function _M.lower(self, k, v)
    local t, cap, head = self.t, self.cap, self.head
    for j = self.n - 1, 0, -1 do
        local r = head + j
        if r >= cap then
            r = r - cap
        end
        local i = r * W + k
        local x = t[i]
        if not x or x <= v then
            return
        end
        t[i] = v
    end
end


-- the values of the oldest record (nothing when empty)
function _M.first(self)
    if self.n == 0 then
        return
    end
    local t, i = self.t, self.head * W
    return t[i + 1], t[i + 2], t[i + 3], t[i + 4], t[i + 5], t[i + 6]
end


-- removes the oldest record and returns its values (nothing when empty)
function _M.pop(self)
    local n = self.n
    if n == 0 then
        return
    end
    local h = self.head
    local t, i = self.t, h * W
    local a, b, c, d, e, f =
        t[i + 1], t[i + 2], t[i + 3], t[i + 4], t[i + 5], t[i + 6]
    t[i + 1], t[i + 2], t[i + 3], t[i + 4], t[i + 5], t[i + 6] =
        false, false, false, false, false, false
    self.n = n - 1
    self.head = h + 1 == self.cap and 0 or h + 1
    return a, b, c, d, e, f
end


return _M
