-- frame.copy_data(v) gives what decoding the encoded v would give: the
-- publisher's own handlers get the same data as the other workers'.

local buffer = require "string.buffer"
local frame = require "resty.loom.events.frame"

local copy = frame.copy_data


-- structural equality; table keys are matched by content
local function same(a, b, seen)
    if type(a) ~= type(b) then
        return false
    end
    if type(a) ~= "table" then
        return a == b
    end
    if getmetatable(a) ~= getmetatable(b) then
        return false
    end
    local n = 0
    for k, v in pairs(a) do
        n = n + 1
        local w = b[k]
        if type(k) == "table" then
            w = nil
            for k2, v2 in pairs(b) do
                if type(k2) == "table" and same(k, k2) then
                    w = v2
                end
            end
        end
        if not same(v, w) then
            return false
        end
    end
    for _ in pairs(b) do
        n = n - 1
    end
    return n == 0
end


local function decoded(v)
    return buffer.decode(buffer.encode(v))
end

local shared = { x = 1 }
local cases = {
    "plain string", 42, -0.5, true, false,
    { seq = 1, kind = "health", port = 8080, ok = true },
    { 1, 2, 3, nil, 5, n = 5 },
    { nested = { deeper = { deepest = { "a", "b" } } }, list = { {}, {} } },
    setmetatable({ a = 1, b = { c = 2 } }, { __index = function() return 9 end }),
    { [{ "table", "key" }] = "value", other = { [{ k = 1 }] = { v = 2 } } },
    { twice = shared, again = shared },
    { blob = string.rep("0123456789abcdef", 640) },
}
for i, v in ipairs(cases) do
    local c = copy(v)
    assert(same(c, decoded(v)), "case " .. i .. " differs from the codec")
    if type(v) == "table" then
        assert(c ~= v, "case " .. i .. " is not a copy")
        assert(getmetatable(c) == nil, "case " .. i .. " kept its metatable")
    end
end
print("ok copies match the codec")

-- the copy does not follow later changes of the original, nor the reverse
local orig = { a = { b = 1 }, list = { 1, 2 } }
local c = copy(orig)
orig.a.b = 2
orig.list[3] = 3
c.a.extra = true
assert(c.a.b == 1 and #c.list == 2 and orig.a.extra == nil)
print("ok copies are independent")

-- a value used twice is copied twice, as the codec does
local c2 = copy(cases[11])
assert(c2.twice ~= c2.again and c2.twice ~= shared)
print("ok shared tables copied like the codec")
