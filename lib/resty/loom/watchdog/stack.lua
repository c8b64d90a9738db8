-- Lua stacks of the samples: the dumpstack text parsed into frames, their
-- labels, and the line of the blocking call an off-CPU sample resumed
-- after (found in the function's bytecode).


local bit = require "bit"
local jit_util = require "jit.util"
local vmdef = require "jit.vmdef"

local debug_getinfo = debug.getinfo
local debug_getregistry = debug.getregistry
local funcbc = jit_util.funcbc
local funcinfo = jit_util.funcinfo
local band = bit.band
local tonumber = tonumber
local type = type
local floor = math.floor
local str_byte = string.byte
local str_find = string.find
local str_gmatch = string.gmatch
local str_match = string.match
local str_sub = string.sub


-- "name@loc" -> { func =, source =, line = }
local function parse_frame(s)
    local at = str_find(s, "@", 1, true)
    local name, loc = s, s
    if at then
        name, loc = str_sub(s, 1, at - 1), str_sub(s, at + 1)
    end
    local src, line = str_match(loc, "^(.*):(%d+)$")
    if name == loc or (src and str_match(name, "^(.*):%d+$") == src) then
        name = nil          -- no name: a main chunk or an anonymous function
    end
    return {
        func = name,
        source = src or loc,
        line = tonumber(line),
    }
end


local function frame_label(f)
    local loc = f.line and (f.source .. ":" .. f.line) or f.source
    if f.func then
        return f.func .. " (" .. loc .. ")"
    end
    return loc
end


-- dumpstack text (outermost first, ";"-separated) -> frames innermost first
local function parse_stack(text)
    local frames = {}
    for part in str_gmatch(text, "[^;]+") do
        frames[#frames + 1] = parse_frame(part)
    end
    local n = #frames
    for i = 1, floor(n / 2) do
        frames[i], frames[n - i + 1] = frames[n - i + 1], frames[i]
    end
    return frames
end


local BCNAMES = vmdef.bcnames
local CALL_OPS = { CALL = true, CALLM = true, ITERC = true, ITERN = true }


-- An off-CPU sample is taken at the instruction after the blocking call:
-- find the line of a call whose next instruction is on "resume_line".
local function call_line(fn, resume_line)
    local best
    for pc = 1, 65536 do
        local ins = funcbc(fn, pc)
        if not ins then
            break
        end
        local op = band(ins, 0xff)
        local name = str_match(str_sub(BCNAMES, op * 6 + 1, op * 6 + 6),
                               "^(%S+)")
        if CALL_OPS[name] then
            local nxt = funcinfo(fn, pc + 1)
            if nxt and nxt.currentline == resume_line then
                local here = funcinfo(fn, pc).currentline
                if here and here <= resume_line
                   and (not best or here > best)
                then
                    best = here
                end
            end
        end
    end
    return best
end


local function fix_call_line(frames)
    local reg = debug_getregistry()
    local fn = reg["loom.watchdog.fn"]
    reg["loom.watchdog.fn"] = nil
    local top = frames[1]
    if type(fn) ~= "function" or not top or not top.line then
        return
    end
    local info = debug_getinfo(fn, "S")
    local src = info.source
    if str_byte(src, 1) == 64 or str_byte(src, 1) == 61 then
        src = str_sub(src, 2)
    end
    if src ~= top.source or top.line < info.linedefined
       or (info.lastlinedefined > 0 and top.line > info.lastlinedefined)
    then
        return
    end
    local line = call_line(fn, top.line)
    if line then
        top.resumed_at = top.line
        top.line = line
    end
end


local _M = { _VERSION = "0.2.0" }


_M.parse_stack = parse_stack
_M.frame_label = frame_label
_M.fix_call_line = fix_call_line


return _M
