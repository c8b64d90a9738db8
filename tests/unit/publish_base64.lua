-- resty.loom.publish.base64 against a plain reference encoder.

local ffi = require "ffi"
local bit = require "bit"
local b64 = require "resty.loom.publish.base64"

local ALPHABET =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


local function reference(s)
    local out = {}
    for i = 1, #s, 3 do
        local a, b, c = s:byte(i, i + 2)
        local v = a * 65536 + (b or 0) * 256 + (c or 0)
        local q = {}
        for k = 3, 0, -1 do
            local x = bit.band(bit.rshift(v, 6 * k), 63) + 1
            q[#q + 1] = ALPHABET:sub(x, x)
        end
        if not b then
            q[3], q[4] = "=", "="
        elseif not c then
            q[4] = "="
        end
        out[#out + 1] = table.concat(q)
    end
    return table.concat(out)
end


local buf = ffi.new("uint8_t[?]", 8192)

local function encode(s)
    local n = b64.encode_into(buf, s, #s)
    assert(n == b64.encoded_len(#s), "length")
    return ffi.string(buf, n)
end

-- known vectors (RFC 4648)
local vectors = {
    [""] = "", f = "Zg==", fo = "Zm8=", foo = "Zm9v", foob = "Zm9vYg==",
    fooba = "Zm9vYmE=", foobar = "Zm9vYmFy",
}
for input, want in pairs(vectors) do
    assert(encode(input) == want, input .. " -> " .. encode(input))
end
print("ok rfc4648 vectors")

math.randomseed(42)
for n = 0, 300 do
    local t = {}
    for i = 1, n do
        t[i] = string.char(math.random(0, 255))
    end
    local s = table.concat(t)
    local got, want = encode(s), reference(s)
    assert(got == want, "length " .. n .. ": " .. got .. " ~= " .. want)
end
print("ok random inputs 0..300 bytes")

-- every byte value in every position of a 3-byte group
for pos = 1, 3 do
    for v = 0, 255 do
        local t = { "a", "b", "c" }
        t[pos] = string.char(v)
        local s = table.concat(t)
        assert(encode(s) == reference(s))
    end
end
print("ok all byte values")

-- writing at an odd address (buffers are not aligned for us)
local odd = ffi.cast("uint8_t *", buf) + 1
local s = string.rep("\255\0\128", 100) .. "xy"
local n = b64.encode_into(odd, s, #s)
assert(ffi.string(odd, n) == reference(s))
print("ok unaligned destination")
