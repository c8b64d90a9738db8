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
_M.table = of_type("table", "a table")
_M.func = of_type("function", "a function")


-- a number above lo (exclusive) and at most hi: timeouts, intervals
function _M.above(lo, hi)
    local what = "a number above " .. lo .. " and at most " .. hi
    return function(v)
        if type(v) ~= "number" or not (v > lo and v <= hi) then
            return what
        end
    end
end


-- a string of 1 to max bytes
function _M.text(max)
    local what = "a string of 1 to " .. max .. " bytes"
    return function(v)
        if type(v) ~= "string" or #v == 0 or #v > max then
            return what
        end
    end
end


-- anything ok(v) accepts (ok returns a true value); what says what it is:
-- for the rules no builder above covers ("an absolute path")
function _M.test(ok, what)
    return function(v)
        if not ok(v) then
            return what
        end
    end
end


-- a string of at least one byte and any length (keys, tokens, passwords)
function _M.is_nonempty(v)
    return type(v) == "string" and v ~= ""
end

_M.nonempty = _M.test(_M.is_nonempty, "a non-empty string")


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


-- raises "<path>.<name> must be ..." unless rule accepts v; level as
-- error()'s counted from the function calling this one; path defaults to
-- "opts" (a nested table's is "opts.redis")
function _M.value(name, v, rule, level, path)
    local bad = rule(v)
    if bad then
        error((path or "opts") .. "." .. name .. " must be " .. bad,
              level + 1)
    end
end


-- every key of opts has a rule and passes it; level and path as in value()
function _M.check(opts, rules, level, path)
    path = path or "opts"
    if type(opts) ~= "table" then
        error(path .. " must be a table", level + 1)
    end
    for k, v in pairs(opts) do
        local rule = rules[k]
        if rule == nil then
            error(path .. "." .. tostring(k) .. " is not an option",
                  level + 1)
        end
        _M.value(k, v, rule, level + 1, path)
    end
end


return _M
