-- Strings into a JSON body (resty.loom.publish): whether one can go in as
-- it is, needs escaping, or is not valid UTF-8 (which would make the whole
-- request invalid), and appending it.


local ffi = require "ffi"
local cjson = require "cjson.safe"

local json_encode = cjson.encode
local byte = string.byte
local find = string.find
local pcall = pcall

-- a byte JSON cannot hold as it is: not printable ASCII, or " or \
-- (a "]" first in a set is literal: the set is ]-~, space-!, #-[)
local NOT_PLAIN = "[^]-~ -!#-[]"


local _M = { _VERSION = "0.2.0" }


-- byte by byte (a loop: a trace that reaches it ends, so the common, plain
-- strings never do)
local function classify_bytes(s)
    local flag = 0
    local i, n = 1, #s
    while i <= n do
        local c = byte(s, i)
        if c < 0x80 then
            if c < 0x20 or c == 0x22 or c == 0x5c or c == 0x7f then
                flag = 1
            end
            i = i + 1
        else
            flag = 1
            local extra, lo
            if c >= 0xc2 and c <= 0xdf then
                extra, lo = 1, 0x80
            elseif c >= 0xe0 and c <= 0xef then
                extra, lo = 2, (c == 0xe0) and 0xa0 or 0x80
            elseif c >= 0xf0 and c <= 0xf4 then
                extra, lo = 3, (c == 0xf0) and 0x90 or 0x80
            else
                return nil
            end
            if i + extra > n then
                return nil
            end
            local c2 = byte(s, i + 1)
            local hi = 0xbf
            if c == 0xed then
                hi = 0x9f
            elseif c == 0xf4 then
                hi = 0x8f
            end
            if c2 < lo or c2 > hi then
                return nil
            end
            for j = i + 2, i + extra do
                local cj = byte(s, j)
                if cj < 0x80 or cj > 0xbf then
                    return nil
                end
            end
            i = i + extra + 1
        end
    end
    return flag
end


-- 0: plain printable ASCII without " or \ (goes in as it is); 1: valid
-- UTF-8 that needs escaping; nil: not valid UTF-8
function _M.classify_lua(s)
    if not find(s, NOT_PLAIN) then
        return 0
    end
    return classify_bytes(s)
end


-- the same in C when nginx has loaded our module: an FFI call keeps the
-- caller's trace going, where string.find with a pattern would end it
_M.classify = _M.classify_lua
do
    pcall(ffi.cdef, [[
    int ngx_loom_ffi_json_class(const unsigned char *s, size_t len);
    ]])
    local ok, json_class = pcall(function()
        return ffi.C.ngx_loom_ffi_json_class
    end)
    if ok then
        _M.classify = function(s)
            local flag = json_class(s, #s)
            if flag < 0 then
                return nil
            end
            return flag
        end
    end
end
local classify = _M.classify


-- appends s as a JSON string; returns nil when s is not valid UTF-8
function _M.put_string(buf, s)
    local flag = classify(s)
    if flag == 0 then
        buf:put('"', s, '"')
        return true
    end
    if flag == nil then
        return nil
    end
    buf:put(json_encode(s))
    return true
end


return _M
