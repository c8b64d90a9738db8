-- Folded stacks to a self-contained SVG flame graph.
--
-- Input is the "folded" format that flamegraph.pl and speedscope read: one
-- line per stack, frames separated by ";", then a space and a number
-- ("main;handler;work 42"). Identical stacks are summed, children are
-- sorted by name and drawn on top of their parent, widths are proportional
-- to the values. The SVG has no scripts and no external references; every
-- frame carries a <title> tooltip with its value and share.


local options = require "resty.loom.opts"

local floor = math.floor
local type = type
local pairs = pairs
local ipairs = ipairs
local tonumber = tonumber
local tostring = tostring
local error = error
local str_byte = string.byte
local str_find = string.find
local str_format = string.format
local str_gsub = string.gsub
local str_gmatch = string.gmatch
local str_match = string.match
local str_sub = string.sub
local tbl_concat = table.concat
local tbl_sort = table.sort


local DEFAULTS = {
    width = 1200,
    frame_height = 16,
    font_size = 12,
    min_width = 0.1,        -- pixels: narrower frames are not drawn
    title = "Flame Graph",
    unit = "samples",
    max_depth = 256,
}

local RULES = {
    width = options.whole(100, 100000),
    frame_height = options.whole(4, 200),
    font_size = options.whole(4, 100),
    min_width = options.number(0, 1000),
    title = options.string,
    unit = options.string,
    max_depth = options.whole(1, 10000),
}


local XML_ESC = { ["&"] = "&amp;", ["<"] = "&lt;", [">"] = "&gt;",
                  ['"'] = "&quot;", ["'"] = "&#39;" }


local _M = { _VERSION = "0.2.0" }

-- the rules of svg()'s options: a caller that renders late (the watchdog
-- drains its reports first) checks them up front
_M.RULES = RULES


local function xml(s)
    s = str_gsub(tostring(s), "[&<>\"']", XML_ESC)
    -- control characters are not allowed in XML 1.0
    return (str_gsub(s, "[%z\1-\8\11\12\14-\31]", "?"))
end


-- a stable warm colour from the frame name (the "hot" palette)
local function colour(name)
    local h = 5381
    for i = 1, #name do
        h = (h * 33 + str_byte(name, i)) % 4294967296
    end
    local v1 = (h % 1000) / 1000
    local v2 = (floor(h / 1000) % 1000) / 1000
    local v3 = (floor(h / 1000000) % 1000) / 1000
    return str_format("rgb(%d,%d,%d)", 205 + floor(50 * v3),
                      floor(230 * v1), floor(55 * v2))
end


local function format_value(v)
    if v == floor(v) then
        return tostring(floor(v))
    end
    return str_format("%.3f", v)
end


-- { [stack] = value } (or an array of { stack, value }) -> folded text
function _M.folded(tbl)
    if type(tbl) ~= "table" then
        error("tbl must be a table", 2)
    end
    local sums = {}
    if tbl[1] ~= nil then
        for _, item in ipairs(tbl) do
            local stack, v = item[1], tonumber(item[2])
            if type(stack) == "string" and v then
                sums[stack] = (sums[stack] or 0) + v
            end
        end
    else
        for stack, v in pairs(tbl) do
            v = tonumber(v)
            if type(stack) == "string" and v then
                sums[stack] = (sums[stack] or 0) + v
            end
        end
    end
    local lines = {}
    for stack, v in pairs(sums) do
        if v > 0 then
            lines[#lines + 1] = stack .. " " .. format_value(v)
        end
    end
    tbl_sort(lines)
    if #lines == 0 then
        return ""
    end
    return tbl_concat(lines, "\n") .. "\n"
end


-- folded text -> { [stack] = value }; malformed lines are skipped
function _M.parse(text)
    local sums = {}
    for line in str_gmatch(text, "[^\r\n]+") do
        local stack, v = str_match(line, "^(.-)%s+([%d%.eE%+%-]+)%s*$")
        v = tonumber(v)
        if stack and stack ~= "" and v and v > 0 then
            sums[stack] = (sums[stack] or 0) + v
        end
    end
    return sums
end


local function new_node(name)
    return { name = name, value = 0, children = {}, n = 0 }
end


local function build(sums, max_depth)
    local root = new_node("all")
    local depth = 0
    for stack, v in pairs(sums) do
        root.value = root.value + v
        local node = root
        local d = 0
        local pos = 1
        while pos <= #stack and d < max_depth do
            local s, e = str_find(stack, ";", pos, true)
            local frame
            if s then
                frame = str_sub(stack, pos, s - 1)
                pos = e + 1
            else
                frame = str_sub(stack, pos)
                pos = #stack + 1
            end
            if frame ~= "" then
                local child = node.children[frame]
                if not child then
                    child = new_node(frame)
                    node.children[frame] = child
                    node.n = node.n + 1
                end
                child.value = child.value + v
                node = child
                d = d + 1
            end
        end
        if d > depth then
            depth = d
        end
    end
    return root, depth
end


local function sorted_children(node)
    local list = {}
    for _, c in pairs(node.children) do
        list[#list + 1] = c
    end
    tbl_sort(list, function(a, b) return a.name < b.name end)
    return list
end


-- folded text or { [stack] = value } -> SVG document (string)
function _M.svg(input, opts)
    opts = opts or {}
    options.check(opts, RULES, 2)
    local o = {}
    for k, v in pairs(DEFAULTS) do
        local x = opts[k]
        if x == nil then
            x = v
        end
        o[k] = x
    end

    local sums
    if type(input) == "string" then
        sums = _M.parse(input)
    elseif type(input) == "table" then
        sums = _M.parse(_M.folded(input))
    else
        error("input must be folded text or a table", 2)
    end

    local root, depth = build(sums, o.max_depth)
    local width = o.width
    local fh = o.frame_height
    local fs = o.font_size
    local pad = 10
    local top = fs * 3 + 8
    local height = top + (depth + 1) * fh + pad + fs + 4
    local inner = width - 2 * pad
    local total = root.value
    local char_w = fs * 0.59

    local out = {}
    local n = 0
    local function put(s)
        n = n + 1
        out[n] = s
    end

    put('<?xml version="1.0" standalone="no"?>\n')
    put(str_format('<svg version="1.1" width="%d" height="%d" '
                   .. 'viewBox="0 0 %d %d" '
                   .. 'xmlns="http://www.w3.org/2000/svg">\n',
                   width, height, width, height))
    put('<style>text{font-family:Verdana,sans-serif;font-size:'
        .. fs .. 'px;fill:#000}rect{stroke:#fff;stroke-width:0.5}'
        .. '.t{font-size:' .. (fs + 5) .. 'px;text-anchor:middle}'
        .. '.s{fill:#555}</style>\n')
    put(str_format('<rect x="0" y="0" width="%d" height="%d" '
                   .. 'fill="#f8f8f0" style="stroke:none"/>\n',
                   width, height))
    put(str_format('<text class="t" x="%.1f" y="%d">%s</text>\n',
                   width / 2, fs * 2, xml(o.title)))
    put(str_format('<text class="s" x="%d" y="%d">total: %s %s, '
                   .. '%d stacks</text>\n', pad, height - 6,
                   xml(format_value(total)), xml(o.unit),
                   (function()
                       local c = 0
                       for _ in pairs(sums) do
                           c = c + 1
                       end
                       return c
                   end)()))

    if total <= 0 then
        put(str_format('<text x="%d" y="%d">no data</text>\n', pad,
                       top + fh))
        put('</svg>\n')
        return tbl_concat(out)
    end

    local scale = inner / total
    local frames = 0

    local function draw(node, x, d)
        local w = node.value * scale
        if w < o.min_width then
            return
        end
        frames = frames + 1
        local y = top + (depth - d) * fh
        local pct = node.value * 100 / total
        put('<g><title>')
        put(xml(node.name))
        put(str_format(' (%s %s, %.2f%%)</title>', format_value(node.value),
                       xml(o.unit), pct))
        put(str_format('<rect x="%.2f" y="%d" width="%.2f" height="%d" '
                       .. 'fill="%s" rx="2" ry="2"/>', x, y, w, fh - 1,
                       d == 0 and "rgb(220,220,220)" or colour(node.name)))
        local fit = floor((w - 6) / char_w)
        if fit >= 3 then
            local label = node.name
            if #label > fit then
                label = str_sub(label, 1, fit - 2) .. ".."
            end
            put(str_format('<text x="%.2f" y="%.1f">%s</text>', x + 3,
                           y + fh - 4.5, xml(label)))
        end
        put('</g>\n')
        local cx = x
        for _, c in ipairs(sorted_children(node)) do
            draw(c, cx, d + 1)
            cx = cx + c.value * scale
        end
    end

    draw(root, pad, 0)
    put('</svg>\n')
    return tbl_concat(out), frames
end


return _M
