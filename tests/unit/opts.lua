-- resty.loom.opts: each rule's verdicts and wording, and errors raised at
-- the line of the checking module's caller.

local opts = require "resty.loom.opts"

local n = 0
local function case(name, ok)
    n = n + 1
    if not ok then
        error("case failed: " .. name, 2)
    end
end

local RULES = {
    rate = opts.number(0.001, 1),
    count = opts.whole(1, 1024),
    verbose = opts.boolean,
    title = opts.string,
    mode = opts.one_of("reject", "drop_oldest", "wait"),
    only = opts.one_of("x"),
    interval = opts.or_value(opts.number(1, 1000), 0, "0 (auto)"),
    limit = opts.or_value(opts.number(1, 60), false, "false"),
}

-- what a module does: checks its caller's options (level 2)
local function configure(o)
    opts.check(o, RULES, 2)
    return true
end

local function message(o)
    local line = debug.getinfo(1, "l").currentline + 1
    local ok, err = pcall(function() local r = configure(o) return r end)
    if ok then
        return nil
    end
    -- raised at the caller's line (the closure above), not in opts.lua
    local at, text = err:match("^[^:]*:(%d+): (.*)$")
    case("line of " .. tostring(err), tonumber(at) == line)
    return text
end

local good = {
    {}, { rate = 0.001 }, { rate = 1 }, { count = 1 }, { count = 1024 },
    { verbose = false }, { title = "" }, { mode = "wait" }, { only = "x" },
    { interval = 0 }, { interval = 1000 }, { limit = false }, { limit = 60 },
}
for _, o in ipairs(good) do
    case("accepted", message(o) == nil)
end

local bad = {
    { "x", "opts must be a table" },
    { { ratee = 1 }, "opts.ratee is not an option" },
    { { [1] = 1 }, "opts.1 is not an option" },
    { { rate = 0 }, "opts.rate must be a number from 0.001 to 1" },
    { { rate = 0 / 0 }, "opts.rate must be a number from 0.001 to 1" },
    { { rate = 1 / 0 }, "opts.rate must be a number from 0.001 to 1" },
    { { rate = -1 / 0 }, "opts.rate must be a number from 0.001 to 1" },
    { { rate = "0.5" }, "opts.rate must be a number from 0.001 to 1" },
    { { count = 1.5 }, "opts.count must be a whole number from 1 to 1024" },
    { { count = 0 }, "opts.count must be a whole number from 1 to 1024" },
    { { count = 1e308 }, "opts.count must be a whole number from 1 to 1024" },
    { { count = 0 / 0 }, "opts.count must be a whole number from 1 to 1024" },
    { { verbose = 1 }, "opts.verbose must be a boolean" },
    { { title = 1 }, "opts.title must be a string" },
    { { mode = "rejct" },
      'opts.mode must be "reject", "drop_oldest" or "wait"' },
    { { only = "y" }, 'opts.only must be "x"' },
    { { interval = 0.5 },
      "opts.interval must be a number from 1 to 1000, or 0 (auto)" },
    { { limit = true }, "opts.limit must be a number from 1 to 60, or false" },
}
for _, b in ipairs(bad) do
    local got = message(b[1])
    case(tostring(got) .. " == " .. b[2], got == b[2])
end

-- value(): one option, same wording and level
local function set_limit(v)
    opts.value("limit", v, RULES.limit, 2)
end
local line = debug.getinfo(1, "l").currentline + 1
local ok, err = pcall(function() set_limit(0) return true end)
case("value raises", not ok)
case("value at the caller's line: " .. err, err:match("^[^:]*:(%d+): ")
     == tostring(line))
case("value wording", err:match(": (opts%.limit must be .*)$")
     == "opts.limit must be a number from 1 to 60, or false")

print("ok " .. n .. " cases")
