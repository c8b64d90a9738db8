"""The C base64 encoder that resty.loom.publish uses inside nginx, checked
against ngx.encode_base64 (nginx's own encoder)."""


def test_native_encoder_matches_nginx(nginx):
    n = nginx(workers=1, server="""
    location = /b64 { content_by_lua_block {
        local ffi = require "ffi"
        local b64 = require "resty.loom.publish.base64"
        if not b64.native then
            ngx.say("not native")
            return
        end
        local buf = ffi.new("uint8_t[?]", 8200)
        local function check(s, dst)
            local got = ffi.string(dst, b64.encode_into(dst, s, #s))
            if got ~= ngx.encode_base64(s) then
                error("length " .. #s .. ": " .. got)
            end
        end
        math.randomseed(7)
        local cases = 0
        for len = 0, 300 do
            local t = {}
            for i = 1, len do
                t[i] = string.char(math.random(0, 255))
            end
            -- every offset of an 8-byte word, to cover the wide loop's edges
            check(table.concat(t), buf + len % 8)
            cases = cases + 1
        end
        for v = 0, 255 do
            for pos = 1, 6 do
                local t = { "a", "b", "c", "d", "e", "f", "g", "h" }
                t[pos] = string.char(v)
                check(table.concat(t), buf)
                cases = cases + 1
            end
        end
        check(string.rep("\\255", 6000), buf)
        ngx.say("checked ", cases + 1)
    } }""")
    r = n.get("/b64")
    assert r.status == 200
    assert r.text.strip() == "checked %d" % (301 + 256 * 6 + 1)
