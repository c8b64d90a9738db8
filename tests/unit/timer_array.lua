-- Unit tests of resty.loom.timer.array (pure LuaJIT, no nginx).

local ffi = require "ffi"
local array = require "resty.loom.timer.array"
local unit = require "unit"
local case = unit.case
local check = unit.check


pcall(ffi.cdef, [[
typedef struct { double a; int32_t b; int32_t c; } loom_timer_test_el_t;
]])
local PTR = ffi.typeof("loom_timer_test_el_t *")
local VLA = ffi.typeof("loom_timer_test_el_t[?]")
local SIZE = ffi.sizeof("loom_timer_test_el_t")


local function exercise(plain)
    local arr = array.new(PTR, VLA, SIZE, 10, plain)
    check(arr.mapped == (array.mapped and not plain), "mapping")
    local p = arr.ptr
    for i = 0, 9 do
        check(p[i].a == 0 and p[i].b == 0 and p[i].c == 0, "not zero")
        p[i].a = i + 0.5
        p[i].b = -i
        p[i].c = i * 3
    end
    local n = 10
    for _ = 1, 12 do                     -- up to 40960 elements
        local n2 = n * 2
        p = array.grow(arr, n2)
        check(p == arr.ptr and arr.n == n2)
        for i = 0, 9 do
            check(p[i].a == i + 0.5 and p[i].b == -i and p[i].c == i * 3,
                  "contents lost at " .. n2)
        end
        for i = n, n2 - 1 do
            check(p[i].a == 0 and p[i].b == 0 and p[i].c == 0,
                  "new element " .. i .. " not zero")
            p[i].b = i
        end
        for i = 10, n - 1 do
            check(p[i].b == i, "element " .. i .. " lost")
        end
        n = n2
    end
    check(array.grow(arr, 5) == arr.ptr and arr.n == n, "shrank")
    arr = nil                            -- luacheck: ignore 311
    collectgarbage()
    collectgarbage()
end


case("mapped arrays grow, keep contents, zero new elements", function()
    exercise(false)
end)


case("plain arrays (no mapping) do the same", function()
    exercise(true)
end)


case("many arrays are released by the GC", function()
    for _ = 1, 2000 do
        local arr = array.new(PTR, VLA, SIZE, 100000)
        arr.ptr[99999].b = 1
        array.grow(arr, 200000)
    end
    collectgarbage()
    collectgarbage()
end)
