-- A misbehaving bus client, run inside a worker (so it passes the peer
-- credential check) to send the broker bad handshakes and frames.

local ffi = require "ffi"
local buffer = require "string.buffer"
local frame = require "resty.loom.events.frame"

ffi.cdef [[ long long ngx_loom_ffi_generation(void); ]]

local _M = {}


local function hello(over)
    local h = {
        version = frame.VERSION,
        worker = ngx.worker.id(),
        pid = ngx.worker.pid(),
        generation = tonumber(ffi.C.ngx_loom_ffi_generation()),
    }
    for k, v in pairs(over or {}) do
        h[k] = v
    end
    local out = buffer.new()
    frame.put_control(out, frame.HELLO, 0, h)
    return out:get()
end


local function trailer()
    local out = buffer.new()
    frame.put_trailer(out, 1, 0)
    return out:get()
end


local function header(version, typ, len)
    local out = buffer.new()
    frame.put_header(out, typ, 0, len, 1)
    local s = out:get()
    -- the version byte follows the 4-byte low half of the sequence
    return s:sub(1, 4) .. string.char(version) .. s:sub(6)
end


local KINDS = {
    garbage = function() return "\255\1\2\3 this is not a frame at all" end,
    version = function() return header(9, frame.HELLO, 10) .. "0123456789" end,
    not_hello = function() return header(1, frame.EVENT, 0) end,
    hello_garbage = function()
        return header(1, frame.HELLO, 12) .. "not-a-buffer" .. trailer()
    end,
    lying_pid = function() return hello({ pid = 1 }) end,
    bad_worker = function() return hello({ worker = 99 }) end,
    generation = function() return hello({ generation = 12345 }) end,
    oversize = function()
        return hello() .. header(1, frame.EVENT, 0x7fffffff)
    end,
    bad_type = function() return hello() .. header(1, 200, 0) end,
    -- an event whose unique key length points far past the frame
    bad_lengths = function()
        local out = buffer.new()
        frame.put_header(out, frame.EVENT, 0, frame.EVENT_SIZE, 2)
        local e = ffi.cast("loom_ev_event_t *", out:reserve(frame.EVENT_SIZE))
        ffi.fill(e, frame.EVENT_SIZE)
        e.target = frame.UNIQUE
        e.key_len = 0x01000000
        out:commit(frame.EVENT_SIZE)
        frame.put_trailer(out, 2, 0)
        return hello() .. out:get()
    end,
    -- an SHM frame for a run that is not in the ring, and one for a run
    -- in another worker's ring
    shm_nowhere = function()
        local out = buffer.new()
        frame.put_shm(out, 2, ngx.worker.id(), 5, 8 * 1000, 640)
        return hello() .. out:get()
    end,
    shm_other = function()
        local out = buffer.new()
        frame.put_shm(out, 2, 1 - ngx.worker.id(), 1, 0, 64)
        return hello() .. out:get()
    end,
    -- what a client does: the upgrade, then nothing (counted, harmless)
    probe = function() return "" end,
}


function _M.handle()
    local kind = ngx.var.arg_kind
    local only = tonumber(ngx.var.arg_only)
    if only and only ~= ngx.worker.id() then
        -- the test wants this run from another worker
        ngx.status = 409
        ngx.say("worker ", ngx.worker.id())
        return
    end
    local sock = ngx.socket.tcp()
    sock:settimeout(3000)
    assert(sock:connect("unix:" .. ngx.config.prefix() .. "sock/bus.sock"))
    assert(sock:send("GET / HTTP/1.1\r\nHost: x\r\nUpgrade: loom-events/1\r\n"
                     .. "Connection: Upgrade\r\n\r\n"))
    local line = sock:receive("*l")
    if line ~= "HTTP/1.1 101 Switching Protocols" then
        ngx.say("refused: ", line)
        return
    end
    repeat line = sock:receive("*l") until line == "" or not line
    local bytes = KINDS[kind]()
    if bytes == "" then
        -- a probe: the broker answered the upgrade; hang up
        sock:close()
        ngx.say("closed")
        return
    end
    assert(sock:send(bytes))
    -- the broker must close the connection (after a reject frame or not)
    while true do
        local data, err = sock:receiveany(65536)
        if not data then
            ngx.say(err == "closed" and "closed" or ("not closed: " .. err))
            break
        end
    end
    sock:close()
end


return _M
