-- The jobs the Lua offload runtime and ngx.run_worker_thread both run in
-- the benchmark (bench/offload/run.py): the same module, the same code.
--   io_cpu(port): a blocking PING round trip to a local redis-server over
--                 lua-socket (a connection kept by the module while its VM
--                 lives), then CPU_ROUNDS rounds of arithmetic
--   cpu():        CPU_ROUNDS * 4 rounds of arithmetic

local socket = require "socket"

local tonumber = tonumber

local CPU_ROUNDS = 20000

local _M = {}

local conn


local function burn(rounds)
    local x = 0
    for i = 1, rounds do
        x = (x * 31 + i) % 1000003
    end
    return x
end


function _M.io_cpu(port)
    if not conn then
        conn = assert(socket.connect("127.0.0.1", tonumber(port)))
        conn:settimeout(5)
    end
    local ok, err = conn:send("PING\r\n")
    local line = ok and conn:receive("*l")
    if line ~= "+PONG\r" and line ~= "+PONG" then
        conn:close()
        conn = nil
        error("redis: " .. tostring(line or err))
    end
    return tostring(burn(CPU_ROUNDS))
end


function _M.cpu()
    return tostring(burn(CPU_ROUNDS * 4))
end


return _M
