-- Handlers run by the Lua offload runtime (runtimes/lua) in
-- tests/test_offload_lua.py: each offload thread requires this module once
-- into its own resident state.

-- the runtime's global table (loom.cancelled, loom.log, loom.thread)
-- luacheck: read globals loom

local socket = require "socket"

local tonumber = tonumber

local _M = {}

-- module-level state: lives as long as the thread's state
local loads = (_G.offload_lua_handlers_loads or 0) + 1
_G.offload_lua_handlers_loads = loads
local calls = 0


function _M.echo(data)
    return data
end


-- "<calls on this thread> <times this module was loaded> <thread>"
function _M.count()
    calls = calls + 1
    return calls .. " " .. loads .. " " .. loom.thread
end


function _M.fail(data)
    error("boom: " .. data)
end


function _M.fail_table()
    error({ code = 7 })
end


function _M.bad_return()
    return { 1 }
end


-- a blocking round trip through lua-socket: "<port> <line>"
function _M.roundtrip(data)
    local port, line = data:match("^(%d+) (.*)$")
    local c = assert(socket.connect("127.0.0.1", tonumber(port)))
    c:settimeout(5)
    assert(c:send(line .. "\n"))
    local answer = assert(c:receive("*l"))
    c:close()
    return answer
end


function _M.sleep(data)
    socket.sleep(tonumber(data))
    return "slept"
end


-- loops until nobody waits for the answer any more
function _M.until_cancelled()
    local n = 0
    while not loom.cancelled() do
        n = n + 1
        if n % 1000 == 0 then
            socket.sleep(0.001)
        end
    end
    loom.log(loom.LOG_NOTICE, "until_cancelled saw the cancel")
    return "cancelled"
end


function _M.execute(data)
    return tostring(os.execute(data))
end


function _M.cpu(data)
    local x = 0
    for i = 1, tonumber(data) do
        x = (x + i * 7) % 1000003
    end
    return tostring(x)
end


-- an error value whose __tostring itself fails: the traceback handler
-- errors too
function _M.fail_tostring()
    error(setmetatable({}, { __tostring = function() error("again") end }))
end


-- kilobytes this state's heap holds after a full collection
function _M.heap_kb()
    collectgarbage()
    collectgarbage()
    return string.format("%.1f", collectgarbage("count"))
end


-- makes garbage (a table of strings) and answers with part of it
function _M.churn(data)
    local t = {}
    for i = 1, 20 do
        t[i] = data .. i
    end
    return table.concat(t, ",", 1, 2)
end


return _M
