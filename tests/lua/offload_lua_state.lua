-- A module both the Lua offload runtime and ngx.run_worker_thread run in
-- tests/test_offload_lua.py::test_state_kept_between_calls_*: it uses
-- nothing but plain Lua, so it loads in either kind of state.

local tostring = tostring

local _M = {}

-- module-level state: lives as long as the state that loaded the module
local calls = 0


-- how many calls this copy of the module has served, this one included
function _M.count()
    calls = calls + 1
    return tostring(calls)
end


return _M
