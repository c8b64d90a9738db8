-- A FIFO of pairs of numbers in two parallel arrays: no allocation per
-- entry once the arrays have grown, so it is cheap on hot paths.


local _M = { _VERSION = "0.1.0" }
local mt = { __index = _M }


function _M.new()
    return setmetatable({ a = {}, b = {}, head = 1, tail = 0 }, mt)
end


function _M.push(self, x, y)
    local t = self.tail + 1
    self.tail = t
    self.a[t] = x
    self.b[t] = y
end


function _M.len(self)
    return self.tail - self.head + 1
end


-- the oldest pair, or nil
function _M.peek(self)
    local h = self.head
    if h > self.tail then
        return nil
    end
    return self.a[h], self.b[h]
end


function _M.pop(self)
    local h = self.head
    if h > self.tail then
        return nil
    end
    local x, y = self.a[h], self.b[h]
    self.a[h] = nil
    self.b[h] = nil
    if h == self.tail then
        -- empty: start over so the arrays stay small
        self.head = 1
        self.tail = 0
    else
        self.head = h + 1
    end
    return x, y
end


-- moves every pair, in order, to the end of dst
function _M.move_to(self, dst)
    while true do
        local x, y = self:pop()
        if not x then
            return
        end
        dst:push(x, y)
    end
end


function _M.clear(self)
    self.a = {}
    self.b = {}
    self.head = 1
    self.tail = 0
end


return _M
