-- A handler module for tests/test_offload_lua.py that answers any
-- function name: each function returns "<its name>|<data>", so a call
-- shows which name and which data reached the handler.

return setmetatable({}, {
    __index = function(_, name)
        return function(data)
            return name .. "|" .. data
        end
    end,
})
