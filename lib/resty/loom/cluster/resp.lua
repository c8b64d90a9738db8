-- The two hot Redis exchanges of the cluster bus, on the socket of a
-- lua-resty-redis connection: a pipeline of XADDs, and XREADGROUP.
-- lua-resty-redis reads every reply element with up to three socket
-- receive() calls (a stream entry of two fields: 17 calls); here the
-- replies are read 64 KiB at a time and parsed from the string. With the
-- envelope in one field (p), this took the CPU an event costs
-- (bench/cluster/run.py, stream mode: both nodes and Redis, 10,000
-- events/s) from about 50 to 29 µs when it came in (commit 7acbb51);
-- bench/results/cluster.json, after later changes, has 20 µs. Commands
-- are written as RESP arrays.


local buffer = require "string.buffer"

local ngx_null = ngx.null
local byte = string.byte
local sub = string.sub
local find = string.find
local tostring = tostring
local tonumber = tonumber
local rawget = rawget

local READ = 65536
local DOLLAR, STAR, COLON, PLUS, MINUS = 36, 42, 58, 43, 45


local _M = { _VERSION = "0.2.0" }


-- a reader: the socket, what was read and not parsed yet, the position
local function fill(r)
    local chunk, err = r.sock:receiveany(READ)
    if not chunk then
        r.sock:close()
        return nil, err
    end
    if r.pos > #r.buf then
        r.buf = chunk
    else
        r.buf = sub(r.buf, r.pos) .. chunk
    end
    r.pos = 1
    return true
end


local parse

parse = function(r)
    local e = find(r.buf, "\r\n", r.pos, true)
    while not e do
        local ok, err = fill(r)
        if not ok then
            return nil, err
        end
        e = find(r.buf, "\r\n", r.pos, true)
    end
    local buf, pos = r.buf, r.pos
    local prefix = byte(buf, pos)
    local line = sub(buf, pos + 1, e - 1)
    r.pos = e + 2
    if prefix == DOLLAR then
        local size = tonumber(line)
        if size < 0 then
            return ngx_null
        end
        while #r.buf < r.pos + size + 1 do
            local ok, err = fill(r)
            if not ok then
                return nil, err
            end
        end
        local p = r.pos
        r.pos = p + size + 2
        return sub(r.buf, p, p + size - 1)

    elseif prefix == STAR then
        local n = tonumber(line)
        if n < 0 then
            return ngx_null
        end
        local arr = {}
        for i = 1, n do
            local v, err = parse(r)
            if v == nil then
                return nil, err
            end
            arr[i] = v
        end
        return arr

    elseif prefix == COLON then
        return tonumber(line)

    elseif prefix == PLUS then
        return line

    elseif prefix == MINUS then
        return false, line
    end
    r.sock:close()
    return nil, "bad reply: " .. tostring(line)
end


-- one reader per lua-resty-redis connection
function _M.reader(red)
    return { sock = rawget(red, "_sock"), buf = "", pos = 1,
             out = buffer.new() }
end


-- appends one command (a list of strings and numbers)
local function put(out, args, n)
    out:put("*", n, "\r\n")
    for i = 1, n do
        local a = tostring(args[i])
        out:put("$", #a, "\r\n", a, "\r\n")
    end
end
_M.put = put


-- sends what was put; reads n replies into res; true, or nil, err
-- (a Redis error reply: nil, "<its text>")
function _M.exchange(r, n, res)
    local bytes, err = r.sock:send(r.out:get())
    if not bytes then
        r.sock:close()
        return nil, err
    end
    local first_err
    for i = 1, n do
        local v
        v, err = parse(r)
        if v == nil then
            return nil, err
        end
        if v == false then
            first_err = first_err or err
        end
        res[i] = v
    end
    if first_err then
        return nil, first_err
    end
    return true
end


return _M
