-- The pure-LuaJIT unit tests' helpers (tests/unit/*.lua): a named case,
-- which prints "ok <name>" once its function returns, and two checks that
-- fail at the caller's line.

local _M = {}


function _M.case(name, fn)
    fn()
    print("ok " .. name)
end


function _M.check(cond, msg)
    if not cond then
        error(msg or "check failed", 2)
    end
end


function _M.eq(a, b, msg)
    if a ~= b then
        error((msg or "") .. ": expected " .. tostring(b) .. ", got "
              .. tostring(a), 2)
    end
end


return _M
