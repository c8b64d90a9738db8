"""resty.loom.publish.json: the C classifier (used when our module is
loaded) and the Lua one agree, and both reject what is not UTF-8."""

SERVER = r"""
location = /t {
    content_by_lua_block {
        local json = require "resty.loom.publish.json"
        local c, lua = json.classify, json.classify_lua
        assert(c ~= lua, "the C classifier is not in use")
        local function show(v)
            return v == nil and "nil" or tostring(v)
        end
        -- named cases: string, expected
        local cases = {
            { "", 0 }, { "edge-1", 0 }, { "a b~}{[]", 0 },
            { 'say "hi"', 1 }, { "back\\slash", 1 }, { "tab\t", 1 },
            { "nul\0", 1 }, { "del\127", 1 },
            { "\195\169", 1 },                      -- U+00E9
            { "\226\130\172", 1 },                  -- U+20AC
            { "\240\159\152\128", 1 },              -- U+1F600
            { "\244\143\191\191", 1 },              -- U+10FFFF
            { "\237\159\191", 1 },                  -- U+D7FF
            { "\192\128", nil },                    -- overlong NUL
            { "\193\191", nil },                    -- overlong
            { "\224\128\128", nil },                -- overlong 3 bytes
            { "\240\128\128\128", nil },            -- overlong 4 bytes
            { "\237\160\128", nil },                -- surrogate U+D800
            { "\244\144\128\128", nil },            -- above U+10FFFF
            { "\245\128\128\128", nil },            -- lead byte F5
            { "\128", nil }, { "a\191", nil },      -- lone continuations
            { "\195", nil }, { "x\226\130", nil },  -- cut short
            { "\226\40\161", nil },                 -- bad continuation
            { "\255", nil },
        }
        local bad = {}
        for i, t in ipairs(cases) do
            local s, want = t[1], t[2]
            if c(s) ~= want or lua(s) ~= want then
                bad[#bad + 1] = i .. ": C " .. show(c(s)) .. ", Lua "
                                .. show(lua(s)) .. ", want " .. show(want)
            end
        end
        -- every byte alone and between plain ones
        for b = 0, 255 do
            for _, s in ipairs({ string.char(b), "ab" .. string.char(b) .. "cd" }) do
                if c(s) ~= lua(s) then
                    bad[#bad + 1] = "byte " .. b
                end
            end
        end
        -- random strings, weighted towards multi-byte sequences
        local pool = { 0x41, 0x22, 0x5c, 0x0a, 0x7f, 0x80, 0xbf, 0xc2, 0xdf,
                       0xe0, 0xed, 0xef, 0xf0, 0xf4, 0xf5, 0xa0, 0x9f, 0x90,
                       0x8f, 0xff }
        math.randomseed(7)
        local n = 0
        for _ = 1, 20000 do
            local t = {}
            for k = 1, math.random(0, 8) do
                t[k] = string.char(pool[math.random(#pool)])
            end
            local s = table.concat(t)
            if c(s) ~= lua(s) then
                bad[#bad + 1] = "random " .. ngx.encode_base64(s)
            end
            if c(s) == nil then
                n = n + 1
            end
        end
        ngx.say(#bad == 0 and "ok" or table.concat(bad, "\n"))
        ngx.say("invalid ", n)
    }
}
"""


def test_c_and_lua_classifiers_agree(nginx):
    n = nginx(workers=1, server=SERVER)
    out = n.get("/t").text.split("\n")
    assert out[0] == "ok", "\n".join(out)
    # the random strings did exercise both outcomes
    invalid = int(out[1].split()[1])
    assert 1000 < invalid < 19000
