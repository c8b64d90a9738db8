-- Unit tests of resty.loom.flamegraph (folded stacks -> SVG).

local fg = require "resty.loom.flamegraph"
local unit = require "unit"
local case = unit.case
local check = unit.check


case("folded: sums, sorts, skips junk", function()
    local txt = fg.folded({ ["a;b"] = 3, ["a;c"] = 1.5, ["z"] = 0, [1] = nil })
    check(txt == "a;b 3\na;c 1.500\n", txt)
    txt = fg.folded({ { "x;y", 2 }, { "x;y", 3 }, { "q", "bad" } })
    check(txt == "x;y 5\n", txt)
    check(fg.folded({}) == "")
    local p = fg.parse("a;b 3\n\nnot a line\na;b 2\nc 1e3\n")
    check(p["a;b"] == 5 and p.c == 1000)
end)


case("svg: widths proportional, children on their parent", function()
    local svg, frames = fg.svg("main;a;x 30\nmain;a;y 10\nmain;b 60\n",
                               { width = 1020, title = "T <&>" })
    check(frames == 6, "frames " .. tostring(frames))  -- all main a b x y
    check(svg:find("^<%?xml"))
    check(svg:find("</svg>\n$"))
    check(svg:find("T &lt;&amp;&gt;", 1, true), "title escaped")
    check(not svg:find("<script", 1, true))
    local rects = {}
    for title, x, w in svg:gmatch("<title>(%S+) [^<]*</title><rect x=\""
                                  .. "([%d.]+)\" y=\"%d+\" width=\"([%d.]+)\"")
    do
        rects[title] = { x = tonumber(x), w = tonumber(w) }
    end
    -- inner width 1000 for 100 units: 10 px per unit
    check(math.abs(rects.all.w - 1000) < 0.01)
    check(math.abs(rects.main.w - 1000) < 0.01)
    check(math.abs(rects.a.w - 400) < 0.01)
    check(math.abs(rects.b.w - 600) < 0.01)
    check(math.abs(rects.x.w - 300) < 0.01)
    check(math.abs(rects.y.w - 100) < 0.01)
    -- sorted by name: a then b; x then y within a
    check(rects.a.x < rects.b.x and rects.x.x < rects.y.x)
    check(math.abs(rects.b.x - (rects.a.x + 400)) < 0.01)
    check(rects.x.x == rects.a.x)
end)


case("svg: tiny frames dropped, labels truncated, empty input", function()
    local t = { ["big"] = 1e6, ["big;tiny"] = 1 }
    local long = string.rep("n", 300)
    t[long] = 1e5
    local svg, frames = fg.svg(t, { width = 400 })
    check(frames == 3, frames)             -- all, big, long; not tiny
    check(not svg:find(">" .. long .. "<", 1, true), "label truncated")
    check(svg:find("nn%.%.</text>"))
    local empty = fg.svg("")
    check(empty:find("no data", 1, true))
    check(not pcall(fg.svg, 42))
end)


case("svg: every option is checked", function()
    for _, opts in ipairs({ { width = 0 / 0 }, { width = 1 / 0 },
                            { width = 10.5 }, { frame_height = 0 },
                            { font_size = -1 }, { min_width = 0 / 0 },
                            { max_depth = 0 }, { title = 3 },
                            { widht = 800 } }) do
        local ok, err = pcall(function()
            local svg = fg.svg("a;b 1", opts)   -- not a tail call: a line
            return svg
        end)
        check(not ok and err:find("opts%.[%w_]+ "), tostring(err))
        check(err:find("timer_flamegraph.lua", 1, true), err)  -- caller's line
    end
    check(fg.svg("a;b 1", { width = 800, title = "t", min_width = 0 }))
end)
