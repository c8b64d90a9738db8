-- Checks of option tables: one wording for every module's errors
-- ("opts.x is not an option", "opts.x must be a whole number from 1 to
-- 10"), raised at the line of the module's caller.
--
-- A rule is a function of the value returning nil when the value is fine,
-- or what it must be ("a boolean"). Rules are made once, at load time.


local type = type
local pairs = pairs
local ipairs = ipairs
local tostring = tostring
local error = error
local tbl_concat = table.concat


local _M = { _VERSION = "0.2.0" }


-- a number in [lo, hi] (NaN fails both comparisons, so it is refused, and
-- so are the infinities while hi is finite)
function _M.number(lo, hi)
    local what = "a number from " .. lo .. " to " .. hi
    return function(v)
        if type(v) ~= "number" or not (v >= lo and v <= hi) then
            return what
        end
    end
end


function _M.whole(lo, hi)
    local what = "a whole number from " .. lo .. " to " .. hi
    return function(v)
        if type(v) ~= "number" or not (v >= lo and v <= hi) or v % 1 ~= 0 then
            return what
        end
    end
end


local function of_type(name, what)
    return function(v)
        if type(v) ~= name then
            return what
        end
    end
end

_M.boolean = of_type("boolean", "a boolean")
_M.string = of_type("string", "a string")


-- one of the given strings: 'must be "a", "b" or "c"'
function _M.one_of(...)
    local set, quoted = {}, {}
    for i, s in ipairs({ ... }) do
        set[s] = true
        quoted[i] = '"' .. s .. '"'
    end
    local n = #quoted
    local what = n == 1 and quoted[1]
                 or tbl_concat(quoted, ", ", 1, n - 1) .. " or " .. quoted[n]
    return function(v)
        if not set[v] then
            return what
        end
    end
end


-- rule, or exactly value, which means what ("0 (off)", "false")
function _M.or_value(rule, value, what)
    return function(v)
        if v == value then
            return nil
        end
        local bad = rule(v)
        if bad then
            return bad .. ", or " .. what
        end
    end
end


-- raises "opts.<name> must be ..." unless rule accepts v; level as error()'s
-- counted from the function calling this one
function _M.value(name, v, rule, level)
    local bad = rule(v)
    if bad then
        error("opts." .. name .. " must be " .. bad, level + 1)
    end
end


-- every key of opts has a rule and passes it; level as in value()
function _M.check(opts, rules, level)
    if type(opts) ~= "table" then
        error("opts must be a table", level + 1)
    end
    for k, v in pairs(opts) do
        local rule = rules[k]
        if rule == nil then
            error("opts." .. tostring(k) .. " is not an option", level + 1)
        end
        _M.value(k, v, rule, level + 1)
    end
end


return _M
