-- A FIFO of pairs of numbers: a ring over two parallel arrays whose
-- capacity doubles when full. The arrays stay dense (slots are
-- overwritten, never set to nil), so they live in LuaJIT's array part: a
-- queue that never empties under load would otherwise push its keys into
-- the hash part and rehash over and over.


local new_tab = require "table.new"

local MIN_CAP = 64


local _M = { _VERSION = "0.2.0" }
local mt = { __index = _M }


local function filled(cap)
    local t = new_tab(cap, 0)
    for i = 1, cap do
        t[i] = 0
    end
    return t
end


function _M.new()
    return setmetatable({ a = filled(MIN_CAP), b = filled(MIN_CAP),
                          cap = MIN_CAP, head = 1, n = 0 }, mt)
end


-- doubles the capacity, unrolling the ring so the oldest pair is at 1
local function grow(self)
    local cap = self.cap
    local a, b = filled(2 * cap), filled(2 * cap)
    local oa, ob = self.a, self.b
    local h = self.head
    for i = 1, cap do
        a[i] = oa[h]
        b[i] = ob[h]
        h = h == cap and 1 or h + 1
    end
    self.a, self.b, self.cap, self.head = a, b, 2 * cap, 1
end


function _M.push(self, x, y)
    local n = self.n
    local cap = self.cap
    if n == cap then
        grow(self)
        cap = self.cap
    end
    local i = self.head + n
    if i > cap then
        i = i - cap
    end
    self.a[i] = x
    self.b[i] = y
    self.n = n + 1
end


function _M.len(self)
    return self.n
end


-- the oldest pair, or nil
function _M.peek(self)
    if self.n == 0 then
        return nil
    end
    local h = self.head
    return self.a[h], self.b[h]
end


function _M.pop(self)
    local n = self.n
    if n == 0 then
        return nil
    end
    local h = self.head
    local x, y = self.a[h], self.b[h]
    self.n = n - 1
    self.head = h == self.cap and 1 or h + 1
    return x, y
end


-- pops the pairs whose first value is below low; returns the second value
-- of the last one popped, or nil when none was
function _M.pop_below(self, low)
    local last
    while self.n > 0 do
        local h = self.head
        if self.a[h] >= low then
            break
        end
        last = self.b[h]
        self.n = self.n - 1
        self.head = h == self.cap and 1 or h + 1
    end
    return last
end


function _M.clear(self)
    self.head, self.n = 1, 0
end


-- moves every pair, in order, to the end of dst
function _M.move_to(self, dst)
    local n = self.n
    if n == 0 then
        return
    end
    if dst.n == 0 then
        -- the common case on the hot path: swap the rings
        self.a, dst.a = dst.a, self.a
        self.b, dst.b = dst.b, self.b
        self.cap, dst.cap = dst.cap, self.cap
        self.head, dst.head = dst.head, self.head
        self.n, dst.n = 0, n
        return
    end
    local a, b, h, cap = self.a, self.b, self.head, self.cap
    for _ = 1, n do
        dst:push(a[h], b[h])
        h = h == cap and 1 or h + 1
    end
    self.head, self.n = 1, 0
end


return _M
